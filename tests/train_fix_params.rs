//! The VRT recipe's fixed parameter group on CPU (`TRAIN.FIX_ITER` / `FIX_LR_MUL` /
//! `FIX_KEYS`): the matching parameters stay bit-identical to their initial values
//! for the first `FIX_ITER` steps and train after; the others train from step 1; a
//! run stopped before or after `FIX_ITER` and resumed ends bit-identical to an
//! uninterrupted one; a checkpoint whose fixed group differs, and keys that match
//! nothing, are errors naming `TRAIN.FIX_KEYS`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tch::{nn, Tensor};
use vrtspike::config::Config;
use vrtspike::synth::{self, SynthOptions};
use vrtspike::train::{train, RankEnv, TrainOptions};

const FIX_ITER: u64 = 3;

/// libtorch's generator is global and runs seed it: the tests of this file take
/// turns so that one's initialisation never draws from another's seed.
static SEEDED: Mutex<()> = Mutex::new(());
const TOTAL: u64 = 6;

fn dataset(dir: &Path) {
    let options = SynthOptions::small(11);
    synth::generate_folder(dir, &options, &|_| {}).unwrap();
}

/// A tiny spike U-Net whose `mid` and `tail` convolutions form the fixed group.
fn fix_config(root: &Path, fix_keys: &str) -> Config {
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: 32\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  USE_RAM_CACHE: false\n\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 2\n  TOTAL_STEPS: {TOTAL}\n  WARMUP_STEPS: 1\n  LR: 1.0e-3\n  MAX_GRAD_NORM: 0.5\n  WEIGHT_DECAY: 0.01\n  SEED: 3\n\
         \x20 FIX_ITER: {FIX_ITER}\n  FIX_LR_MUL: 0.5\n  FIX_KEYS: {fix_keys}\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  VAL_EVERY_STEPS: 100\n  CKPT_EVERY_STEPS: 1\n  KEEP_CHECKPOINTS: 0\n",
        root.display()
    );
    Config::parse(&text, Path::new("fix_params.yaml")).unwrap()
}

fn env(run_dir: &Path) -> RankEnv {
    RankEnv::from_vars(&|_| None, Some(run_dir), Some("cpu")).unwrap()
}

fn step_dir(run: &Path, step: u64) -> PathBuf {
    run.join(format!("checkpoints/step_{step:08}"))
}

/// The weights of the checkpoint of `step`, by name.
fn weights(run: &Path, step: u64) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(step_dir(run, step).join("model.safetensors"))
        .unwrap()
        .into_iter()
        .collect()
}

/// The weights a run starts from (the model built as the trainer builds it).
fn initial_weights(config: &Config) -> BTreeMap<String, Tensor> {
    tch::manual_seed(config.train.seed as i64);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _model = vrtspike::model::build(&vs.root(), &config.model).unwrap();
    vs.variables()
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect()
}

fn is_fixed(name: &str) -> bool {
    name.contains("mid") || name.contains("tail")
}

fn file(run: &Path, step: u64, name: &str) -> Vec<u8> {
    std::fs::read(step_dir(run, step).join(name)).unwrap()
}

fn state(run: &Path, step: u64) -> serde_json::Value {
    serde_json::from_slice(&file(run, step, "state.json")).unwrap()
}

/// Trains `run` to the end, stopped once after `stop` steps and resumed.
fn stop_and_resume(config: &Config, run: &Path, stop: u64) {
    let first = train(
        config,
        &env(run),
        &TrainOptions {
            stop_after_steps: Some(stop),
        },
    )
    .unwrap();
    assert!(first.preempted && first.steps == stop);
    let second = train(config, &env(run), &TrainOptions::default()).unwrap();
    assert!(second.completed && second.steps == TOTAL);
}

fn assert_same_end(a: &Path, b: &Path, what: &str) {
    for name in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            file(a, TOTAL, name) == file(b, TOTAL, name),
            "{what}: {name} differs"
        );
    }
    assert_eq!(
        state(a, TOTAL)["fixed_group"],
        state(b, TOTAL)["fixed_group"]
    );
}

#[test]
fn fixed_group_freezes_then_trains_and_resumes_exactly() {
    let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    dataset(&data);
    let config = fix_config(&data, "[mid, tail]");

    let whole = tmp.path().join("whole");
    let outcome = train(&config, &env(&whole), &TrainOptions::default()).unwrap();
    assert!(outcome.completed);
    let init = initial_weights(&config);
    let fixed: Vec<&String> = init.keys().filter(|n| is_fixed(n)).collect();
    assert!(
        !fixed.is_empty() && fixed.len() < init.len(),
        "the keys select a strict subset: {fixed:?}"
    );
    for step in 1..=TOTAL {
        let now = weights(&whole, step);
        assert_eq!(now.len(), init.len());
        for (name, start) in &init {
            let same = now[name].equal(start);
            if is_fixed(name) && step <= FIX_ITER {
                assert!(
                    same,
                    "{name} changed at step {step}, frozen until {FIX_ITER}"
                );
            } else {
                assert!(!same, "{name} unchanged at step {step}");
            }
        }
    }
    let saved = state(&whole, TOTAL);
    let saved_names: Vec<&str> = saved["fixed_group"]["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert_eq!(saved_names, fixed, "state.json names the fixed group");
    assert_eq!(saved["fixed_group"]["steps"], TOTAL - FIX_ITER);
    assert_eq!(state(&whole, FIX_ITER)["fixed_group"]["steps"], 0);

    // Stopped before FIX_ITER, and after it: both end as the uninterrupted run.
    let early = tmp.path().join("early");
    stop_and_resume(&config, &early, 2);
    assert_same_end(&whole, &early, "stopped at step 2");
    let late = tmp.path().join("late");
    stop_and_resume(&config, &late, FIX_ITER + 1);
    assert_same_end(&whole, &late, "stopped at step 4");

    // Resuming with a different fixed group is refused.
    let err = train(
        &fix_config(&data, "[mid]"),
        &env(&late),
        &TrainOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("TRAIN.FIX_KEYS") && err.contains("tail"),
        "{err}"
    );
}

#[test]
fn fix_keys_matching_nothing_is_a_config_error() {
    let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    dataset(&data);
    let err = train(
        &fix_config(&data, "[no_such_layer]"),
        &env(&tmp.path().join("run")),
        &TrainOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("TRAIN.FIX_KEYS") && err.contains("no_such_layer") && err.contains("head"),
        "{err}"
    );
}
