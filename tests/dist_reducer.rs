//! PyTorch DDP's Reducer across real processes (Gloo on loopback): 2 ranks on
//! batch 1 match 1 rank on the concatenated batch, with and without activation
//! checkpointing (a weight used by two checkpointed blocks fires its accumulator
//! twice a backward: the static graph's counting), with gradient accumulation that
//! communicates once per optimizer step; bf16 and fp16 compression stay close; a
//! rank killed in the middle of backward is a named collective error on the other.

mod dist_support;

use std::path::PathBuf;

use dist_support::{data, join, load_sorted, max_abs_diff, rank_env, run_ranks, two_ranks_writing};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Tensor};
use vrtspike::ddp::{GradCompression, GradReducer, GradSync, ProcessGroup, ReducerOptions};
use vrtspike::model::checkpoint::{checkpoint_one, on_backward};

const OUT_VAR: &str = "VRTSPIKE_TEST_OUT";
/// The rank that dies in its second step's reducing backward.
const DIE_VAR: &str = "VRTSPIKE_TEST_DIE_IN_BACKWARD";

/// conv c1 -> relu -> [c2 -> relu] -> [c2]: c2 serves two blocks; with
/// `checkpointed` each block is recomputed in its own nested backward.
struct Net {
    c1: nn::Conv2D,
    c2: nn::Conv2D,
    checkpointed: bool,
}

impl Net {
    fn new(vs: &nn::VarStore, seed: i64, checkpointed: bool) -> Net {
        tch::manual_seed(seed);
        let cfg = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        Net {
            c1: nn::conv2d(vs.root() / "c1", 3, 3, 3, cfg),
            c2: nn::conv2d(vs.root() / "c2", 3, 3, 3, cfg),
            checkpointed,
        }
    }

    fn block(&self, x: &Tensor, relu: bool) -> Tensor {
        let (w, b) = (
            self.c2.ws.shallow_clone(),
            self.c2.bs.as_ref().map(|b| b.shallow_clone()),
        );
        let apply = move |x: &Tensor| {
            let y = x.conv2d(&w, b.as_ref(), [1, 1], [1, 1], [1, 1], 1);
            if relu {
                y.relu()
            } else {
                y
            }
        };
        if self.checkpointed {
            checkpoint_one(&[x], move |t| Ok(apply(&t[0]))).expect("checkpoint")
        } else {
            apply(x)
        }
    }

    /// With `die`, the process exits once backward reaches c1's output: after the
    /// gradients of c2 exist, before c1's.
    fn forward(&self, x: &Tensor, die: bool) -> Tensor {
        let h = tch::nn::Module::forward(&self.c1, x).relu();
        let h = if die {
            on_backward(&h, || std::process::exit(3)).expect("hook")
        } else {
            h
        };
        let h = self.block(&h, true);
        self.block(&h, false)
    }
}

/// What one training run is.
#[derive(Clone, Copy)]
struct Plan {
    steps: usize,
    accumulation: usize,
    checkpointed: bool,
    compression: GradCompression,
}

/// Trains with Adam. Without a group: one rank on every sample of a step at once.
/// With a group: this rank's share of each step in `accumulation` micro-batches,
/// reduced by the Reducer in the last one's backward. Returns the sorted named
/// parameters and the group's all-reduces per step.
fn train(group: Option<&mut ProcessGroup>, seed: i64, plan: Plan) -> (Vec<(String, Tensor)>, u64) {
    let per_step = 2 * plan.accumulation;
    let (xs, ys) = data(plan.steps, per_step);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = Net::new(&vs, seed, plan.checkpointed);
    let mut optimizer = nn::Adam::default().build(&vs, 1e-2).expect("adam");
    let mut per_step_reduces = 0;
    match group {
        Some(group) => {
            let options = ReducerOptions {
                compression: plan.compression,
                ..ReducerOptions::default()
            };
            let mut reducer =
                GradReducer::new(group, vs.trainable_variables(), options).expect("reducer");
            let (rank, world) = (group.rank(), group.world_size());
            let dying = std::env::var(DIE_VAR).is_ok_and(|r| r == rank.to_string());
            for step in 0..plan.steps {
                let (x, y) = (xs.get(step as i64), ys.get(step as i64));
                zero_grads(&vs);
                let before = group.stats().all_reduces;
                let micro = per_step / world;
                for m in 0..micro {
                    let sync = GradSync::for_micro_batch(m, micro);
                    reducer.before_forward(sync).expect("before forward");
                    let i = (rank * micro + m) as i64;
                    let die = dying && step == 1 && sync == GradSync::Reduce;
                    let out = net.forward(&x.narrow(0, i, 1), die);
                    let loss =
                        out.mse_loss(&y.narrow(0, i, 1), tch::Reduction::Mean) / micro as f64;
                    if let Err(e) = reducer.backward(group, &loss, sync).map(|_| ()) {
                        eprintln!("BACKWARD FAILED: {e}");
                        std::process::exit(7);
                    }
                }
                per_step_reduces = group.stats().all_reduces - before;
                optimizer.step();
            }
        }
        None => {
            for step in 0..plan.steps {
                let (x, y) = (xs.get(step as i64), ys.get(step as i64));
                optimizer.zero_grad();
                net.forward(&x, false)
                    .mse_loss(&y, tch::Reduction::Mean)
                    .backward();
                optimizer.step();
            }
        }
    }
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    (named, per_step_reduces)
}

/// Zeroes gradients in place: under the Reducer they are views of its buckets,
/// which tch's `zero_grad` (a `detach_`) refuses.
fn zero_grads(vs: &nn::VarStore) {
    for var in vs.trainable_variables() {
        let mut grad = var.grad();
        if grad.defined() {
            let _ = grad.zero_();
        }
    }
}

fn out_dir() -> PathBuf {
    PathBuf::from(std::env::var(OUT_VAR).expect("out dir"))
}

/// In a rank: trains each plan in turn (rank 1 from other weights, which the
/// Reducer's broadcast replaces) and saves the results as `rank<r>-<i>.ot`.
fn rank_runs(plans: &[Plan]) {
    let mut group = join();
    let rank = group.rank();
    let seed = if rank == 0 { 7 } else { 99 };
    for (i, plan) in plans.iter().enumerate() {
        let (named, reduces) = train(Some(&mut group), seed, *plan);
        // Every micro-batch of the first step reduces (see dist::reducer), one a
        // step after it.
        assert_eq!(reduces, 1, "one reducing backward per optimizer step");
        Tensor::save_multi(&named, out_dir().join(format!("rank{rank}-{i}.ot"))).expect("save");
    }
}

/// Runs `test` on 2 ranks; returns each plan's parameters of both ranks.
fn two_rank_results(test: &str, plans: usize) -> Vec<[Vec<(String, Tensor)>; 2]> {
    let dir = two_ranks_writing(test, OUT_VAR);
    let load = |r: usize, i: usize| load_sorted(&dir.path().join(format!("rank{r}-{i}.ot")));
    (0..plans).map(|i| [load(0, i), load(1, i)]).collect()
}

const PLAIN: Plan = Plan {
    steps: 4,
    accumulation: 2,
    checkpointed: false,
    compression: GradCompression::None,
};
const CHECKPOINTED: Plan = Plan {
    checkpointed: true,
    ..PLAIN
};

#[test]
fn two_ranks_match_one_rank_with_and_without_checkpointing() {
    if rank_env().is_some() {
        rank_runs(&[PLAIN, CHECKPOINTED]);
        return;
    }
    let results = two_rank_results("two_ranks_match_one_rank_with_and_without_checkpointing", 2);
    let (reference, _) = train(None, 7, PLAIN);
    let (start, _) = train(None, 7, Plan { steps: 0, ..PLAIN });
    assert!(
        max_abs_diff(&start, &reference) > 1e-3,
        "training did not move the weights"
    );
    for (plan, [r0, r1]) in ["plain", "checkpointed"].iter().zip(&results) {
        assert_eq!(max_abs_diff(r0, r1), 0.0, "{plan}: ranks diverged");
        let diff = max_abs_diff(r0, &reference);
        assert!(diff < 1e-5, "{plan}: 2 ranks vs 1 rank differ by {diff}");
    }
    let between = max_abs_diff(&results[0][0], &results[1][0]);
    assert!(
        between < 1e-6,
        "checkpointing changed the result by {between}"
    );
}

#[test]
fn compressed_gradients_stay_close() {
    let plans = [
        Plan {
            compression: GradCompression::Bf16,
            ..CHECKPOINTED
        },
        Plan {
            compression: GradCompression::Fp16,
            ..PLAIN
        },
    ];
    if rank_env().is_some() {
        rank_runs(&plans);
        return;
    }
    let results = two_rank_results("compressed_gradients_stay_close", 2);
    let (reference, _) = train(None, 7, PLAIN);
    let (start, _) = train(None, 7, Plan { steps: 0, ..PLAIN });
    let moved = max_abs_diff(&start, &reference);
    for (name, [r0, r1]) in ["bf16", "fp16"].iter().zip(&results) {
        assert_eq!(max_abs_diff(r0, r1), 0.0, "{name}: ranks diverged");
        let diff = max_abs_diff(r0, &reference);
        assert!(
            diff > 0.0,
            "{name}: bit-identical to float32, so nothing was compressed"
        );
        assert!(
            diff < 0.05 * moved,
            "{name}: {diff} off float32 (training moved {moved})"
        );
    }
}

#[test]
fn a_rank_killed_mid_backward_is_a_named_collective_error() {
    if rank_env().is_some() {
        rank_runs(&[PLAIN]);
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let outcomes = run_ranks(
        "a_rank_killed_mid_backward_is_a_named_collective_error",
        2,
        &[0, 1],
        &[
            (OUT_VAR, dir.path().display().to_string()),
            (DIE_VAR, "1".into()),
        ],
    );
    assert_eq!(
        outcomes[1].output.status.code(),
        Some(3),
        "{}",
        outcomes[1].stderr()
    );
    let survivor = &outcomes[0];
    assert_eq!(
        survivor.output.status.code(),
        Some(7),
        "{}",
        survivor.stderr()
    );
    let err = survivor.stderr();
    assert!(
        err.contains("BACKWARD FAILED: rank 0 of 2: all_reduce #") && err.contains("(gloo) failed"),
        "{err}"
    );
    // Gloo saw the peer go; it did not wait out the 30 s collective timeout.
    assert!(!err.to_lowercase().contains("timed out"), "{err}");
}
