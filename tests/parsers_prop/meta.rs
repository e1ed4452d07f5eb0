//! `dataset.yaml`: documents built from the real keys, misspelt keys and values of
//! every YAML kind, and plain random text, parse to metadata that passes its checks
//! or to an error naming the file.

use std::path::Path;

use proptest::prelude::*;

use vrtspike::dataset::DatasetMeta;

use super::{accepted, check, names};

/// A YAML value of any kind, as flow text.
pub fn yaml_value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        (0..100u32).prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        prop::sample::select(vec![
            "true",
            "false",
            "null",
            "~",
            "''",
            "auto",
            ".inf",
            "-.nan",
            "0x1F",
            "1e400",
            "99999999999999999999999",
            "&a 1",
            "*a",
            "!!binary aGk=",
            "{",
            "[",
            ":",
            "- x",
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

/// A key's value: mostly one the key takes, sometimes any YAML at all.
fn value(good: BoxedStrategy<String>) -> impl Strategy<Value = Option<String>> {
    prop::option::weighted(0.9, prop_oneof![4 => good, 1 => yaml_value().boxed()])
}

fn meta_text() -> impl Strategy<Value = String> {
    let size = || (1..5u32).prop_map(|v| (v * 8).to_string()).boxed();
    let fields = (
        value(size()),
        value(size()),
        value(any::<bool>().prop_map(|b| b.to_string()).boxed()),
        value(
            prop::collection::btree_map("[a-z0-9_]{1,6}", 0..4u32, 0..3)
                .prop_map(|m| format!("{m:?}").replace('"', ""))
                .boxed(),
        ),
        prop::collection::vec(("[a-z_]{1,14}", yaml_value()), 0..2),
    );
    let lines = fields.prop_map(|(h, w, flipped, blur, extra)| {
        let named = [
            ("spike_height", h),
            ("spike_width", w),
            ("spike_flipped", flipped),
            ("blur_frames", blur),
        ];
        let mut text: String = named
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}: {v}\n")))
            .collect();
        for (k, v) in extra {
            text.push_str(&format!("{k}: {v}\n"));
        }
        text
    });
    prop_oneof![6 => lines, 1 => ".{0,80}"]
}

#[test]
fn any_metadata_text_is_valid_metadata_or_names_the_file() {
    let path = Path::new("/data/case/dataset.yaml");
    check("dataset.yaml", 3000, meta_text(), |text| {
        match DatasetMeta::parse(&text, path) {
            Ok(meta) => {
                accepted();
                prop_assert!(meta.spike_height > 0 && meta.spike_width > 0);
                prop_assert_eq!((meta.spike_height as u64 * meta.spike_width as u64) % 8, 0);
                prop_assert!(meta.blur_frames.values().all(|n| *n > 0));
            }
            Err(err) => names(&err.to_string(), "/data/case/dataset.yaml")?,
        }
        Ok(())
    });
}
