//! Eight jobs on one dataset at once, each with `DATALOADER.TOTAL_WORKERS: 80`, with
//! real launchers and real `vrtspike train` CPU ranks sharing the node's cache
//! server (`DATA.CACHE_SHARING: node`): more loader workers than the server has
//! connections for on a small node (512 on up to 64 cores). Every job completes
//! without a restart; a worker the server had no connection for read from disk
//! (its rank said so once) instead of failing its rank, and a job whose attach got
//! none ran a server of its own. Prints how long the eight took, how many ranks
//! read from disk for want of a connection and how many jobs ran their own server
//! (the figures in docs/benchmarks.md).

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{launcher_command, read_json, synth_tiny, texts, wait_with_limit};
use common::{write_tiny_config, TinyTrain};
use vrtspike_contract::rundir::RunLayout;

/// A failure guard only: every job ends far sooner on a healthy run.
const LIMIT: Duration = Duration::from_secs(540);

/// Jobs started at once.
const JOBS: usize = 8;

/// What a rank logs when one of its loader workers got no connection.
const REFUSED: &str = "a loader worker got no connection to the cache server";

#[test]
fn eight_jobs_of_80_workers_on_one_node_all_complete() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let dir = tmp.path().to_path_buf();
    let data = synth_tiny(&dir);
    let run = TinyTrain {
        total_steps: 6,
        ckpt_every: 1000,
        timeout_s: 120,
    };
    let config = write_tiny_config(&dir, &data, &run);
    let text = std::fs::read_to_string(&config).unwrap_or_else(|e| panic!("{e}"));
    let text = text.replace("TOTAL_WORKERS: 2\n", "TOTAL_WORKERS: 80\n");
    assert!(text.contains("TOTAL_WORKERS: 80"), "{text}");
    std::fs::write(&config, text).unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    let jobs: Vec<(PathBuf, std::process::Child)> = (0..JOBS)
        .map(|j| {
            let run = dir.join(format!("job{j}"));
            let child = launcher_command(&config, &run)
                .args(["--gpus", "0", "--ranks", "1", "--max-restarts", "0"])
                .args(["--cache-size", "64M", "--cache-linger-s", "2"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("starting launcher {j}: {e}"));
            (run, child)
        })
        .collect();
    let waits: Vec<_> = jobs
        .into_iter()
        .map(|(run, child)| std::thread::spawn(move || (run, wait_with_limit(child, LIMIT))))
        .collect();
    let (mut refused_ranks, mut own_servers) = (0, 0);
    for wait in waits {
        let (run, output) = wait.join().unwrap_or_else(|_| panic!("a waiter panicked"));
        let (stdout, stderr) = texts(&output);
        assert!(
            output.status.success(),
            "{}: stdout:\n{stdout}\nstderr:\n{stderr}",
            run.display()
        );
        let layout = RunLayout::new(&run);
        let summary = read_json(&layout.launcher_summary(0));
        assert_eq!(summary["exit"], "completed", "{summary}");
        assert_eq!(summary["restarts"], 0, "{summary}");
        let log = std::fs::read_to_string(layout.rank_log(0)).unwrap_or_default();
        assert!(
            log.matches(REFUSED).count() <= 1,
            "warned more than once:\n{log}"
        );
        refused_ranks += usize::from(log.contains(REFUSED));
        own_servers += usize::from(summary["cache"]["sharing"]["mode"] == "job");
    }
    println!(
        "eight jobs of 80 loader workers: all completed in {:.1} s; {refused_ranks} of {JOBS} \
         ranks had workers read from disk for want of a connection; {own_servers} jobs found \
         no connection for their attach and ran a server of their own",
        started.elapsed().as_secs_f64()
    );
}
