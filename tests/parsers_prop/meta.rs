//! `dataset.yaml`: documents built from the real keys, misspelt keys and values of
//! every YAML kind, and plain random text, parse to metadata that passes its checks
//! or to an error naming the file.

use std::path::Path;

use proptest::prelude::*;

use vrtspike::dataset::DatasetMeta;

use super::{check, names};

/// A YAML value of any kind, as flow text.
pub fn yaml_value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        (0..100u32).prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        prop::sample::select(vec![
            "true", "false", "null", "~", "''", "auto", ".inf", "-.nan", "0x1F", "1e400",
            "99999999999999999999999", "&a 1", "*a", "!!binary aGk=", "{", "[", ":", "- x",
        ])
        .prop_map(str::to_string),
        "[a-zA-Z0-9 _.:,#'\"-]{0,12}",
    ];
    leaf.prop_recursive(3, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4).prop_map(|kv| {
                let items: Vec<String> = kv.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                format!("{{{}}}", items.join(", "))
            }),
        ]
    })
}

fn meta_text() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        4 => prop::sample::select(vec![
            "spike_height", "spike_width", "spike_flipped", "blur_frames",
        ])
        .prop_map(str::to_string),
        1 => "[a-z_]{1,14}",
    ];
    let lines = prop::collection::vec((key, yaml_value()), 0..6).prop_map(|kv| {
        kv.iter()
            .map(|(k, v)| format!("{k}: {v}\n"))
            .collect::<String>()
    });
    prop_oneof![4 => lines, 1 => ".{0,80}"]
}

#[test]
fn any_metadata_text_is_valid_metadata_or_names_the_file() {
    let path = Path::new("/data/case/dataset.yaml");
    check("dataset.yaml", 500, meta_text(), |text| {
        match DatasetMeta::parse(&text, path) {
            Ok(meta) => {
                prop_assert!(meta.spike_height > 0 && meta.spike_width > 0);
                prop_assert_eq!((meta.spike_height as u64 * meta.spike_width as u64) % 8, 0);
                prop_assert!(meta.blur_frames.values().all(|n| *n > 0));
            }
            Err(err) => names(&err.to_string(), "/data/case/dataset.yaml")?,
        }
        Ok(())
    });
}
