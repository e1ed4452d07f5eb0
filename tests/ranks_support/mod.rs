//! CPU ranks of `vrtspike train` started by hand with the launcher's environment
//! contract (no launcher), and the wait for all of them to end well.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Ranks 0 and 1 of a world of two training with `config` into `run` (their logs
/// there as `rank<R>.log`), reading through the cache server at `cache`; with
/// `None`, as torchrun starts them (no launcher above them: local rank 0 starts
/// or attaches to the node's cache server itself).
pub fn start_ranks(config: &Path, run: &Path, cache: Option<&str>) -> Vec<Child> {
    start_world(config, run, cache, 2, &[])
}

/// Every rank of a world of `world` training with `config` into `run` (as
/// [`start_ranks`]), with the extra variables `extra`.
pub fn start_world(
    config: &Path,
    run: &Path,
    cache: Option<&str>,
    world: u32,
    extra: &[(&str, &str)],
) -> Vec<Child> {
    let port = free_port().to_string();
    (0..world)
        .map(|rank| {
            let mut command = Command::new(env!("CARGO_BIN_EXE_vrtspike"));
            match cache {
                Some(cache) => command.env("VRTSPIKE_CACHE_ADDR", cache),
                None => command.env_remove("VRTSPIKE_CACHE_ADDR"),
            };
            command
                .args(["train", "--config"])
                .arg(config)
                .envs(extra.iter().copied())
                .envs([
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("LOCAL_WORLD_SIZE", world.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("VRTSPIKE_RUN_DIR", run.display().to_string()),
                    ("VRTSPIKE_DEVICE", "cpu".into()),
                    ("OMP_NUM_THREADS", "1".into()),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(run.join(format!("rank{rank}.log"))).unwrap())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Waits up to `limit` for every rank to exit 0 (a failure shows its log; a rank
/// still running then is killed and the test fails).
pub fn wait_all(children: &mut [Child], run: &Path, limit: Duration) {
    let deadline = Instant::now() + limit;
    for (rank, child) in children.iter_mut().enumerate() {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let log = std::fs::read_to_string(run.join(format!("rank{rank}.log")))
                    .unwrap_or_default();
                assert!(status.success(), "rank {rank} {status}:\n{log}");
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("rank {rank} did not finish");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
