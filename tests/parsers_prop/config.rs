//! The YAML config and `--set` overrides: documents of real and misspelt sections and
//! keys with values of every YAML kind, and override strings with random key paths
//! (long ones included) and values, give a config that validates or an error naming
//! the file or the override; never a panic or a hang.

use std::path::Path;
use std::time::Instant;

use proptest::prelude::*;

use vrtspike::config::Config;

use super::meta::yaml_value;
use super::{accepted, check, names};

const SECTIONS: [&str; 6] = ["DATA", "DATALOADER", "TRAIN", "MODEL", "LOG", "DIST"];

/// Real key names of every section (and some nested sections' keys).
const KEYS: [&str; 40] = [
    "CROP_SIZE",
    "TRAIN_CROP_SIZE",
    "VAL_CROP_SIZE",
    "CLIP_LEN",
    "CACHE_SIZE_GB",
    "ROOT",
    "AUGMENT",
    "HFLIP",
    "BLUR_DIR",
    "USE_RAM_CACHE",
    "USE_PRECOMPUTED_VOXELS",
    "SPIKE_BINS",
    "TOTAL_WORKERS",
    "NUM_WORKERS",
    "PREFETCH_FACTOR",
    "TRAIN_PREFETCH_FACTOR",
    "PIN_MEMORY",
    "LR",
    "BATCH_SIZE",
    "BETAS",
    "AMP_OPT_LEVEL",
    "AMP_DTYPE",
    "FIX_KEYS",
    "FIX_ITER",
    "TOTAL_STEPS",
    "WARMUP_STEPS",
    "SEED",
    "ARCH",
    "WINDOW_SIZE",
    "VRT_DEPTHS",
    "SPIKE_TSA",
    "CHUNK_SHAPE",
    "CHUNK_SIZE",
    "UNET",
    "EMBED_DIMS",
    "NUM_HEADS",
    "VAL_EVERY_STEPS",
    "KEEP_CHECKPOINTS",
    "BACKEND",
    "TIMEOUT_S",
];

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(KEYS.to_vec()).prop_map(str::to_string),
        1 => "[A-Z_]{1,10}",
        1 => "[a-z0-9 ]{0,6}",
    ]
}

fn section() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(SECTIONS.to_vec()).prop_map(str::to_string),
        1 => "[A-Z_]{1,8}",
    ]
}

fn config_text() -> impl Strategy<Value = String> {
    let body = prop::collection::vec(prop::collection::vec((key(), yaml_value()), 0..5), 0..4);
    let doc = (prop::collection::vec(section(), 0..4), body).prop_map(|(sections, bodies)| {
        let mut text = String::new();
        for (section, body) in sections.iter().zip(bodies) {
            text.push_str(&format!("{section}:\n"));
            for (k, v) in body {
                text.push_str(&format!("  {k}: {v}\n"));
            }
        }
        text
    });
    prop_oneof![6 => doc, 1 => yaml_value(), 1 => ".{0,60}"]
}

#[test]
fn any_config_document_validates_or_names_the_file() {
    let path = Path::new("/nowhere/prop-config.yaml");
    check("config yaml", 3000, config_text(), |text| {
        match Config::parse(&text, path) {
            Ok(_) => accepted(),
            Err(err) => names(&err.to_string(), "prop-config.yaml")?,
        }
        Ok(())
    });
}

/// A `--set` string: a key path (real, random, empty or very long segments), maybe
/// an `=`, and a value of any kind.
fn override_spec() -> impl Strategy<Value = String> {
    let segment = prop_oneof![
        3 => section(),
        3 => key(),
        1 => Just(String::new()),
        1 => "[ =.a-z]{0,3}",
    ];
    let real = (prop::sample::select(SECTIONS.to_vec()), key())
        .prop_map(|(section, key)| format!("{section}.{key}"));
    let good = prop::sample::select(vec![
        "DATA.CROP_SIZE=128",
        "DATA.VAL_CROP_SIZE=null",
        "TRAIN.LR=2.0e-4",
        "TRAIN.NUM_WORKERS=3",
        "DATALOADER.TOTAL_WORKERS=auto",
        "MODEL.WINDOW_SIZE=7",
        "MODEL.SPIKE_TSA.CHUNK_SHAPE=row",
        "LOG.VAL_EVERY_STEPS=100",
        "DIST.TIMEOUT_S=600",
    ])
    .prop_map(str::to_string);
    let path = prop_oneof![
        8 => real,
        8 => prop::collection::vec(segment, 0..5).prop_map(|s| s.join(".")),
        1 => (1..20_000usize).prop_map(|n| vec!["DATA"; n].join(".")),
        1 => (1..20_000usize).prop_map(|n| format!("DATA{}", ".".repeat(n))),
    ];
    let value = prop_oneof![4 => yaml_value(), 1 => ".{0,20}"];
    let random = (path, prop::option::weighted(0.9, value)).prop_map(|(path, value)| match value {
        Some(v) => format!("{path}={v}"),
        None => path,
    });
    prop_oneof![4 => random, 1 => good]
}

#[test]
fn any_override_applies_or_names_itself() {
    let base = Config::default();
    check("config --set", 3000, override_spec(), |spec| {
        let start = Instant::now();
        let result = base.with_overrides(std::slice::from_ref(&spec));
        prop_assert!(start.elapsed() < crate::HANG_GUARD, "slow override");
        if result.is_ok() {
            accepted();
        }
        if let Err(err) = result {
            let shown = err.to_string();
            prop_assert!(
                shown.contains(&spec),
                "error does not name the override: {shown}"
            );
        }
        Ok(())
    });
}
