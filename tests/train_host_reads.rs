//! No tensor value is read back to the host on a training step that does not log
//! (issue 34): a CPU run of a small model with gradient accumulation and clipping,
//! stepped by hand with the standard periodic tasks, counts `util::readback`'s reads
//! around every step and every task. The optimizer step, the gradient norm, clipping,
//! the skip decision and the losses stay on the device; the `train` line's settle
//! reads them once a window, and `metrics.jsonl` carries each window's `host_reads`.

use std::path::Path;

use vrtspike::config::Config;
use vrtspike::synth::{self, SynthOptions};
use vrtspike::train::run::RunBuilder;
use vrtspike::train::{tasks, RankEnv, TrainOptions};
use vrtspike::util::readback;

fn config(root: &Path) -> Config {
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: 32\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  USE_RAM_CACHE: false\n\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 1\n  GRADIENT_ACCUMULATION_STEPS: 2\n  TOTAL_STEPS: 12\n  WARMUP_STEPS: 2\n  LR: 1.0e-3\n  MAX_GRAD_NORM: 0.05\n  SEED: 3\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 4\n  MEM_EVERY_STEPS: 3\n  VAL_EVERY_STEPS: 100\n  CKPT_EVERY_STEPS: 100\n  TENSORBOARD: false\n",
        root.display()
    );
    Config::parse(&text, Path::new("host_reads.yaml")).unwrap()
}

#[test]
fn steps_that_do_not_log_read_nothing_back() {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let options = SynthOptions::small(5);
    synth::generate_folder(&data, &options, &|_| {}).unwrap();
    let config = config(&data);
    let run_dir = tmp.path().join("run");
    let env = RankEnv::from_vars(&|_| None, Some(&run_dir), Some("cpu")).unwrap();
    let train_options = TrainOptions::default();
    let mut run = RunBuilder::new(&config, &env, &train_options)
        .build()
        .unwrap();
    let mut tasks = tasks::standard(&run);
    let mut reads_in_windows = Vec::new();
    let mut window = 0u64;
    while run.state.step < run.stop_at {
        let before = readback::count();
        let report = run.step().unwrap();
        assert_eq!(
            readback::count(),
            before,
            "step {} read tensor values back",
            report.step
        );
        let logs = report.step % 4 == 0 || report.step == run.stop_at;
        let before_tasks = readback::count();
        for task in tasks.iter_mut().filter(|t| t.due(&report)) {
            task.run(&mut run, &report).unwrap();
        }
        let in_tasks = readback::count() - before_tasks;
        window += readback::count() - before;
        if logs {
            assert!(
                in_tasks >= 1,
                "the log step {} settled nothing",
                report.step
            );
            reads_in_windows.push(window);
            window = 0;
        } else {
            // The memory sample of steps 3, 6 and 9 included.
            assert_eq!(in_tasks, 0, "the tasks of step {} read back", report.step);
        }
        if report.step == 4 {
            // The first window: steps 1-4, its settle the only read.
            assert_eq!(in_tasks, 1, "one read settles a window");
        }
    }
    assert_eq!(run.state.optimizer_steps, 12, "every step applied");
    assert_eq!(run.attempt.losses.len(), 12);
    assert!(run.attempt.losses.iter().all(|(_, l)| l.is_finite()));
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let logged: Vec<u64> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| {
            v["host_reads"]
                .as_u64()
                .expect("host_reads on a train line")
        })
        .collect();
    // Each window's settle; the final validation's read comes after the last line.
    assert_eq!(logged, [1, 1, 1], "{text}");
    assert_eq!(reads_in_windows[..2], [1, 1]);
    assert!(
        reads_in_windows[2] >= 2,
        "the final validation reads its sums"
    );
    let norms: Vec<f64> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| v["grad_norm"].as_f64().expect("a finite gradient norm"))
        .collect();
    assert!(norms.iter().all(|n| *n > 0.0), "{norms:?}");
}
