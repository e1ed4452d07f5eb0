//! Bad input to `vrtspike train` is reported, never a panic: a bad config key or
//! value names its key path, a missing dataset names the path.

use std::path::Path;
use std::process::Command;

use vrtspike::config::Config;
use vrtspike::train::{train, RankEnv, TrainOptions};

fn parse_err(text: &str) -> String {
    Config::parse(text, Path::new("t.yaml"))
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_train_log_dist_keys_and_values_name_the_key_path() {
    let err = parse_err("TRAIN:\n  LRR: 0.1\n");
    assert!(err.contains("TRAIN") && err.contains("LRR"), "{err}");
    for (text, key) in [
        ("TRAIN:\n  LR: -1\n", "TRAIN.LR"),
        ("TRAIN:\n  LR: fast\n", "TRAIN.LR"),
        (
            "TRAIN:\n  WARMUP_STEPS: 10\n  TOTAL_STEPS: 5\n",
            "TRAIN.WARMUP_STEPS",
        ),
        ("TRAIN:\n  AMP_DTYPE: fp8\n", "TRAIN.AMP_DTYPE"),
        ("TRAIN:\n  BETAS: [0.9, 1.5]\n", "TRAIN.BETAS"),
        ("TRAIN:\n  MAX_GRAD_NORM: -2\n", "TRAIN.MAX_GRAD_NORM"),
        ("LOG:\n  CKPT_EVERY_STEPS: 0\n", "LOG.CKPT_EVERY_STEPS"),
        ("DIST:\n  BACKEND: mpi\n", "DIST.BACKEND"),
        (
            "DATA:\n  VAL_TILE: 16\n  VAL_TILE_OVERLAP: 16\n",
            "DATA.VAL_TILE",
        ),
    ] {
        let err = parse_err(text);
        assert!(err.contains(key), "{text:?} gave {err}");
        assert!(err.contains("t.yaml"), "{err}");
    }
}

fn run_dir_env(dir: &Path) -> RankEnv {
    RankEnv::from_vars(&|_| None, Some(dir), Some("cpu")).unwrap()
}

#[test]
fn missing_dataset_names_the_path() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-dataset");
    let config = Config::parse(
        &format!("DATA:\n  ROOT: {}\n", missing.display()),
        Path::new("t.yaml"),
    )
    .unwrap();
    let err = train(
        &config,
        &run_dir_env(&tmp.path().join("run")),
        &TrainOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("DATA.ROOT") && err.contains(&missing.display().to_string()),
        "{err}"
    );
    // A root without its train split names the split folder (or its metadata file).
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let config = Config::parse(
        &format!("DATA:\n  ROOT: {}\n", empty.display()),
        Path::new("t.yaml"),
    )
    .unwrap();
    let err = train(
        &config,
        &run_dir_env(&tmp.path().join("run2")),
        &TrainOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains(&empty.display().to_string()), "{err}");
    // No DATA.ROOT at all.
    let err = train(
        &Config::default(),
        &run_dir_env(&tmp.path().join("run3")),
        &TrainOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("DATA.ROOT"), "{err}");
}

#[test]
fn the_binary_reports_a_bad_key_and_exits_non_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("bad.yaml");
    std::fs::write(&config, "TRAIN:\n  TOTAL_STEPS: many\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vrtspike"))
        .args(["train", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(tmp.path().join("run"))
        .env_remove("RANK")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("TRAIN.TOTAL_STEPS") && stderr.contains("bad.yaml"),
        "{stderr}"
    );
}
