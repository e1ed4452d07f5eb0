//! `vrtspike train --set`: overrides are typed like the file and the run directory
//! keeps the resolved config that ran (`config.resolved.yaml`); a bad override is
//! refused naming the key; precomputed voxel grids (`spike_vox/*.npy`) train with
//! `DATA.USE_PRECOMPUTED_VOXELS: true`, from disk without a cache server.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use vrtspike::config::Config;
use vrtspike::synth::{self, SynthOptions};
use vrtspike_contract::rundir::RunLayout;

fn synth_data(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    let options = SynthOptions {
        train_seqs: 1,
        test_seqs: 0,
        frames: 4,
        height: 32,
        width: 48,
        seed: 5,
    };
    synth::generate_folder(&data, &options, &|_| {}).unwrap();
    data
}

fn write_config(dir: &Path, data: &Path) -> PathBuf {
    let path = dir.join("tiny.yaml");
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 16\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  CACHE_SIZE_GB: 0.01\n\
         DATALOADER:\n  TOTAL_WORKERS: 1\n\
         TRAIN:\n  BATCH_SIZE: 1\n  TOTAL_STEPS: 1000\n  SEED: 1\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  VAL_EVERY_STEPS: 1000\n  CKPT_EVERY_STEPS: 1000\n  MEM_EVERY_STEPS: 1000\n",
        data.display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn train(config: &Path, run: &Path, sets: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_vrtspike"));
    command
        .arg("train")
        .arg("--config")
        .arg(config)
        .arg("--run-dir")
        .arg(run)
        .args(["--device", "cpu"]);
    for spec in sets {
        command.args(["--set", spec]);
    }
    for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("VRTSPIKE_")) {
        command.env_remove(name);
    }
    command
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn texts(output: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn overrides_run_and_the_resolved_config_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let data = synth_data(tmp.path());
    let config = write_config(tmp.path(), &data);
    let run = tmp.path().join("run");
    let output = train(
        &config,
        &run,
        &[
            "TRAIN.TOTAL_STEPS=2",
            "DATA.USE_RAM_CACHE=false",
            "DATALOADER.DROP_LAST=false",
            "TRAIN.COMPILE_MODEL=true",
        ],
    );
    assert!(output.status.success(), "{}", texts(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The notice of a key without an equivalent, once.
    assert_eq!(
        stderr.matches("config notice: TRAIN.COMPILE_MODEL").count(),
        1,
        "{stderr}"
    );
    let path = RunLayout::new(&run).resolved_config();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("TOTAL_STEPS: 2"), "{text}");
    // Only the keys unet_spike reads, so the file loads back.
    assert!(
        text.contains("CHANNELS: 4") && !text.contains("VRT_DEPTHS"),
        "{text}"
    );
    let resolved = Config::load(&path).unwrap();
    assert_eq!(resolved.train.total_steps, 2);
    assert!(!resolved.data.use_ram_cache && !resolved.dataloader.drop_last);
    let result = std::fs::read_to_string(RunLayout::new(&run).result()).unwrap();
    assert!(
        result.contains("\"steps\": 2") || result.contains("\"steps\":2"),
        "{result}"
    );

    // A bad override names the key and the argument; nothing runs.
    let other = tmp.path().join("run2");
    let output = train(&config, &other, &["TRAIN.TOTAL_STEP=2"]);
    assert!(!output.status.success(), "{}", texts(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--set TRAIN.TOTAL_STEP=2") && stderr.contains("TRAIN.TOTAL_STEP"),
        "{stderr}"
    );
    assert!(!RunLayout::new(&other).resolved_config().exists());
}

#[test]
fn precomputed_voxels_train_from_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let data = synth_data(tmp.path());
    let config = write_config(tmp.path(), &data);
    let run = tmp.path().join("run");
    let sets = [
        "TRAIN.TOTAL_STEPS=2",
        "DATA.USE_RAM_CACHE=false",
        "DATA.USE_PRECOMPUTED_VOXELS=true",
    ];
    // Without spike_vox the run fails naming what is missing.
    let output = train(&config, &run, &sets);
    assert!(!output.status.success(), "{}", texts(&output));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("spike_vox"),
        "{}",
        texts(&output)
    );
    assert_eq!(synth::write_precomputed_voxels(&data, 4).unwrap(), 4);
    let output = train(&config, &run, &sets);
    assert!(output.status.success(), "{}", texts(&output));
}
