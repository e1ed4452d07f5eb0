//! Collective latency between CPU ranks on loopback (Gloo): runs itself as
//! `--ranks` processes and prints, from rank 0, one JSON line per size with
//! the median and mean all-reduce and broadcast times, and the barrier time.
//!
//! `cargo run --example dist_allreduce_bench -- --ranks 2 --sizes-mb 1,25`

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};
use vrtspike::ddp::{Backend, GroupOptions, ProcessGroup, ReduceOp};
use vrtspike_contract::env::{self as rank_env, RankEnv, Rendezvous};

const ITERS: usize = 20;
const WARMUP: usize = 3;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str, default: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| default.to_string())
    };
    let sizes: Vec<f64> = value("--sizes-mb", "1,25")
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .with_context(|| format!("--sizes-mb: bad size {s:?}"))
        })
        .collect::<Result<_>>()?;
    if std::env::var_os(rank_env::RANK).is_some() {
        return rank_main(&sizes);
    }
    let ranks: usize = value("--ranks", "2").parse().context("--ranks")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            let env = RankEnv {
                rank: rank as u32,
                local_rank: rank as u32,
                world_size: ranks as u32,
                local_world_size: ranks as u32,
                master: Some(Rendezvous {
                    addr: "127.0.0.1".into(),
                    port,
                }),
                ..RankEnv::single()
            };
            Command::new(&exe)
                .args(&args[1..])
                .envs(env.to_vars())
                .spawn()
                .context("spawn rank")
        })
        .collect::<Result<_>>()?;
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() {
            bail!("rank {rank} failed: {status}");
        }
    }
    Ok(())
}

fn rank_main(sizes_mb: &[f64]) -> Result<()> {
    tch::set_num_threads(1);
    let env = RankEnv::from_process_env()?;
    let options = GroupOptions::for_rank(&env, Backend::Gloo, Duration::from_secs(60))?;
    let mut group = ProcessGroup::new(&options)?;
    for &mb in sizes_mb {
        let elements = (mb * 1024.0 * 1024.0 / 4.0) as i64;
        let mut tensor = Tensor::ones([elements], (Kind::Float, Device::Cpu));
        let reduce = time(&mut group, |g| g.all_reduce(&mut tensor, ReduceOp::Avg))?;
        let broadcast = time(&mut group, |g| g.broadcast(&mut tensor, 0))?;
        let barrier = time(&mut group, |g| g.barrier())?;
        if group.rank() == 0 {
            println!(
                "{}",
                serde_json::json!({
                    "backend": "gloo",
                    "ranks": group.world_size(),
                    "size_mb": mb,
                    "all_reduce_avg_ms": { "median": reduce.0, "mean": reduce.1 },
                    "broadcast_ms": { "median": broadcast.0, "mean": broadcast.1 },
                    "barrier_ms": { "median": barrier.0, "mean": barrier.1 },
                    "all_reduce_bus_gb_s": mb / 1024.0 * 2.0 * (group.world_size() as f64 - 1.0)
                        / group.world_size() as f64 / (reduce.0 / 1000.0),
                })
            );
        }
    }
    Ok(())
}

/// Median and mean milliseconds of `op` over ITERS runs after WARMUP runs.
fn time(
    group: &mut ProcessGroup,
    mut op: impl FnMut(&mut ProcessGroup) -> Result<(), vrtspike::ddp::DistError>,
) -> Result<(f64, f64)> {
    let mut samples = Vec::with_capacity(ITERS);
    for i in 0..WARMUP + ITERS {
        group.barrier()?;
        let started = Instant::now();
        op(group)?;
        if i >= WARMUP {
            samples.push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    Ok((samples[samples.len() / 2], mean))
}
