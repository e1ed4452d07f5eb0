//! DDP semantics across real processes (Gloo on loopback): 2 ranks on batch 1
//! match 1 rank on the concatenated batch of 2 (SGD and Adam, 1e-5), gradient
//! accumulation communicates once per optimizer step, rank 0's weights win at
//! start, and shape mismatches, divergence and unused parameters are handled.

mod dist_support;

use std::path::PathBuf;

use dist_support::{
    assert_all_ok, data, join, load_sorted, max_abs_diff, rank_env, run_ranks, two_ranks_writing,
};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use vrtspike::ddp::{Ddp, DdpOptions, ProcessGroup};

const OUT_VAR: &str = "VRTSPIKE_TEST_OUT";

/// A tiny two-conv restoration net; its initial weights follow `seed`.
fn model(vs: &nn::VarStore, seed: i64, hidden: i64) -> impl Module {
    tch::manual_seed(seed);
    let root = vs.root();
    let conv = |c_in, c_out, name: &str| {
        let cfg = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        nn::conv2d(&root / name, c_in, c_out, 3, cfg)
    };
    nn::seq()
        .add(conv(3, hidden, "c1"))
        .add_fn(|x| x.relu())
        .add(conv(hidden, 3, "c2"))
}

#[derive(Clone, Copy)]
enum Opt {
    Sgd,
    Adam,
}

/// Trains `steps` optimizer steps. Without a group: one rank on every sample
/// of a step at once. With a group: this rank's share of each step, split into
/// `accumulation` micro-batches of one sample each, synchronised once a step.
fn train(
    mut group: Option<&mut ProcessGroup>,
    init_seed: i64,
    opt: Opt,
    steps: usize,
    accumulation: usize,
    ddp_options: DdpOptions,
) -> (Vec<(String, Tensor)>, usize) {
    let world = group.as_ref().map_or(1, |g| g.world_size());
    let rank = group.as_ref().map_or(0, |g| g.rank());
    let per_step = 2 * accumulation; // global batch of every step
    let (xs, ys) = data(steps, per_step);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs, init_seed, 8);
    let mut optimizer = match opt {
        Opt::Sgd => nn::sgd(0.9, 0.0, 0.0, false).build(&vs, 0.05),
        Opt::Adam => nn::Adam::default().build(&vs, 1e-3),
    }
    .expect("optimizer");
    let mut ddp = group
        .as_deref_mut()
        .map(|g| Ddp::new(g, vs.trainable_variables(), ddp_options).expect("ddp"));
    let mut buckets = 0;
    for step in 0..steps {
        let (x, y) = (xs.get(step as i64), ys.get(step as i64));
        optimizer.zero_grad();
        match (&mut ddp, group.as_deref_mut()) {
            (Some(ddp), Some(group)) => {
                let micro = per_step / world;
                for m in 0..micro {
                    let i = (rank * micro + m) as i64;
                    let loss = net
                        .forward(&x.narrow(0, i, 1))
                        .mse_loss(&y.narrow(0, i, 1), tch::Reduction::Mean);
                    (loss / micro as f64).backward();
                }
                let before = group.stats().all_reduces;
                ddp.sync_gradients(group).expect("sync");
                buckets = (group.stats().all_reduces - before) as usize;
            }
            _ => net
                .forward(&x)
                .mse_loss(&y, tch::Reduction::Mean)
                .backward(),
        }
        optimizer.step();
    }
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    (named, buckets)
}

fn out_path(rank: usize) -> PathBuf {
    PathBuf::from(std::env::var(OUT_VAR).expect("out dir")).join(format!("rank{rank}.ot"))
}

/// Runs `test` on 2 ranks that save their final parameters; returns them.
fn two_rank_params(test: &str) -> Vec<Vec<(String, Tensor)>> {
    let dir = two_ranks_writing(test, OUT_VAR);
    (0..2)
        .map(|r| load_sorted(&dir.path().join(format!("rank{r}.ot"))))
        .collect()
}

fn check_parity(test: &str, opt: Opt, steps: usize, accumulation: usize) {
    let ranks = two_rank_params(test);
    // Both ranks hold bit-identical weights...
    assert_eq!(max_abs_diff(&ranks[0], &ranks[1]), 0.0, "ranks diverged");
    // ...equal to one rank on the whole batch, which moved away from the start.
    let (reference, _) = train(None, 7, opt, steps, accumulation, DdpOptions::default());
    let diff = max_abs_diff(&ranks[0], &reference);
    assert!(diff < 1e-5, "2 ranks vs 1 rank differ by {diff}");
    let (start, _) = train(None, 7, opt, 0, accumulation, DdpOptions::default());
    assert!(
        max_abs_diff(&start, &reference) > 1e-3,
        "training did not move the weights"
    );
}

fn rank_trains_and_saves(
    opt: Opt,
    steps: usize,
    accumulation: usize,
    options: DdpOptions,
) -> usize {
    let mut group = join();
    let rank = group.rank();
    // Rank 1 starts from other weights: DDP's broadcast from rank 0 must fix that.
    let seed = if rank == 0 { 7 } else { 99 };
    let (named, buckets) = train(Some(&mut group), seed, opt, steps, accumulation, options);
    Tensor::save_multi(&named, out_path(rank)).expect("save");
    buckets
}

#[test]
fn sgd_two_ranks_batch_one_match_one_rank_batch_two() {
    if rank_env().is_some() {
        rank_trains_and_saves(Opt::Sgd, 5, 1, DdpOptions::default());
        return;
    }
    check_parity(
        "sgd_two_ranks_batch_one_match_one_rank_batch_two",
        Opt::Sgd,
        5,
        1,
    );
}

#[test]
fn adam_two_ranks_batch_one_match_one_rank_batch_two() {
    if rank_env().is_some() {
        rank_trains_and_saves(Opt::Adam, 5, 1, DdpOptions::default());
        return;
    }
    check_parity(
        "adam_two_ranks_batch_one_match_one_rank_batch_two",
        Opt::Adam,
        5,
        1,
    );
}

#[test]
fn accumulation_communicates_once_per_step_in_buckets() {
    if rank_env().is_some() {
        // Tiny caps split the ~1.8 KB of parameters into 2 buckets: the last
        // conv (876 B >= 512 B) first, then the first conv.
        let options = DdpOptions {
            first_bucket_bytes: 512,
            bucket_bytes: 1024,
        };
        let buckets = rank_trains_and_saves(Opt::Adam, 3, 2, options);
        assert_eq!(
            buckets, 2,
            "one all-reduce a bucket per optimizer step, not per micro-batch"
        );
        return;
    }
    check_parity(
        "accumulation_communicates_once_per_step_in_buckets",
        Opt::Adam,
        3,
        2,
    );
}

#[test]
fn different_shapes_fail_on_every_rank_naming_the_parameter() {
    let Some((rank, _, _)) = rank_env() else {
        let outcomes = run_ranks(
            "different_shapes_fail_on_every_rank_naming_the_parameter",
            2,
            &[0, 1],
            &[],
        );
        assert_all_ok(&outcomes);
        return;
    };
    let mut group = join();
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = model(&vs, 7, if rank == 0 { 8 } else { 4 });
    let err = Ddp::new(&mut group, vs.trainable_variables(), DdpOptions::default())
        .expect_err("hidden width differs");
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "rank {rank}: parameter shapes differ across ranks"
        )),
        "{text}"
    );
    // Both convs' weights and the first bias differ; the last bias ([3]) matches.
    assert!(
        text.contains("3 of 4 parameters differ in dtype or shape"),
        "{text}"
    );
    assert!(
        text.contains(if rank == 0 {
            "[8, 3, 3, 3] on this rank"
        } else {
            "[4, 3, 3, 3] on this rank"
        }),
        "{text}"
    );
}

#[test]
fn divergence_is_reported_on_every_rank_naming_the_rank() {
    let Some((rank, _, _)) = rank_env() else {
        let outcomes = run_ranks(
            "divergence_is_reported_on_every_rank_naming_the_rank",
            2,
            &[0, 1],
            &[],
        );
        assert_all_ok(&outcomes);
        return;
    };
    let mut group = join();
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = model(&vs, 7 + rank as i64, 8);
    let ddp = Ddp::new(&mut group, vs.trainable_variables(), DdpOptions::default()).expect("ddp");
    ddp.check_parameters(&mut group, 10)
        .expect("identical after the broadcast");
    if rank == 1 {
        tch::no_grad(|| {
            let mut p = ddp.parameters()[0].shallow_clone();
            let _ = p.f_add_scalar_(1e-6).expect("nudge");
        });
    }
    let err = ddp
        .check_parameters(&mut group, 20)
        .expect_err("rank 1 diverged");
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "rank {rank}: parameters diverged across ranks at step 20"
        )),
        "{text}"
    );
    assert!(
        text.contains("rank(s) [1] hold different parameters from rank 0"),
        "{text}"
    );
}

#[test]
fn a_parameter_unused_on_one_rank_gets_an_averaged_zero_gradient() {
    let Some((rank, _, _)) = rank_env() else {
        let outcomes = run_ranks(
            "a_parameter_unused_on_one_rank_gets_an_averaged_zero_gradient",
            2,
            &[0, 1],
            &[],
        );
        assert_all_ok(&outcomes);
        return;
    };
    let mut group = join();
    let a = Tensor::from_slice(&[1.0f32, 1.0]).set_requires_grad(true);
    let b = Tensor::from_slice(&[1.0f32, 1.0]).set_requires_grad(true);
    let mut ddp = Ddp::new(
        &mut group,
        vec![a.shallow_clone(), b.shallow_clone()],
        DdpOptions::default(),
    )
    .expect("ddp");
    let x = Tensor::from_slice(&[2.0f32, 4.0]);
    let loss = if rank == 0 {
        (&a * &x).sum(Kind::Float) + (&b * &x).sum(Kind::Float)
    } else {
        (&a * &x).sum(Kind::Float)
    };
    loss.backward();
    ddp.sync_gradients(&mut group).expect("sync");
    let grad = |t: &Tensor| Vec::<f32>::try_from(&t.grad()).expect("grad");
    assert_eq!(grad(&a), vec![2.0, 4.0]);
    assert_eq!(grad(&b), vec![1.0, 2.0]); // (x + 0) / 2
}
