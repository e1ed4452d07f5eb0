//! Collectives across real processes on loopback (Gloo): all-reduce (sum, avg,
//! min, max, i64), broadcast, barrier, and failure within the time-out naming
//! the rank and op when a peer never joins or dies.

mod dist_support;

use std::time::{Duration, Instant};

use dist_support::{assert_all_ok, rank_env, run_ranks, torchrun_env};
use tch::{Kind, Tensor};
use vrtspike::ddp::{Backend, GroupOptions, ProcessGroup, ReduceOp};

fn join(timeout: Duration) -> ProcessGroup {
    let options =
        GroupOptions::for_rank(&torchrun_env(), Backend::Gloo, timeout).expect("torchrun env");
    ProcessGroup::new(&options).expect("join the group")
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).expect("f32 values")
}

#[test]
fn all_reduce_broadcast_barrier_on_two_ranks() {
    let Some((rank, world, _)) = rank_env() else {
        let outcomes = run_ranks("all_reduce_broadcast_barrier_on_two_ranks", 2, &[0, 1], &[]);
        assert_all_ok(&outcomes);
        return;
    };
    let mut group = join(Duration::from_secs(30));
    assert_eq!((group.rank(), group.world_size()), (rank, world));
    let r = rank as f32;

    // rank r holds [r+1, 10(r+1), -(r+1)]: sums, means, minima, maxima are known.
    let base = [1.0f32, 10.0, -1.0];
    let mine = || Tensor::from_slice(&base.map(|v| v * (r + 1.0)));
    let mut t = mine();
    group.all_reduce(&mut t, ReduceOp::Sum).expect("sum");
    assert_eq!(values(&t), vec![3.0, 30.0, -3.0]);
    let mut t = mine();
    group.all_reduce(&mut t, ReduceOp::Avg).expect("avg");
    assert_eq!(values(&t), vec![1.5, 15.0, -1.5]);
    let mut t = mine();
    group.all_reduce(&mut t, ReduceOp::Min).expect("min");
    assert_eq!(values(&t), vec![1.0, 10.0, -2.0]);
    let mut t = mine();
    group.all_reduce(&mut t, ReduceOp::Max).expect("max");
    assert_eq!(values(&t), vec![2.0, 20.0, -1.0]);

    // Integers reduce exactly (used for the parameter-hash exchange).
    let mut ints = Tensor::from_slice(&[i64::MAX / 4 + rank as i64, -7]);
    group.all_reduce(&mut ints, ReduceOp::Sum).expect("i64 sum");
    assert_eq!(
        Vec::<i64>::try_from(&ints).expect("i64"),
        vec![2 * (i64::MAX / 4) + 1, -14]
    );

    // A multi-megabyte tensor (several Gloo chunks).
    let n = 1_500_000i64;
    let mut big = Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * f64::from(r + 1.0);
    group.all_reduce(&mut big, ReduceOp::Sum).expect("big sum");
    let expected = Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 3.0;
    assert!(big.equal(&expected), "6 MB all-reduce wrong");

    // Broadcast from rank 1 overwrites rank 0's values.
    let mut b = Tensor::full(
        [4, 2],
        f64::from(r * 100.0 + 7.0),
        (Kind::Float, tch::Device::Cpu),
    );
    group.broadcast(&mut b, 1).expect("broadcast");
    assert_eq!(values(&b), vec![107.0; 8]);

    // Barrier: rank 1 arrives late; rank 0 must wait for it.
    let before = Instant::now();
    if rank == 1 {
        std::thread::sleep(Duration::from_millis(300));
    }
    group.barrier().expect("barrier");
    if rank == 0 {
        assert!(
            before.elapsed() >= Duration::from_millis(250),
            "barrier did not wait"
        );
    }
    let stats = group.stats();
    assert_eq!(
        (stats.all_reduces, stats.broadcasts, stats.barriers),
        (6, 1, 1)
    );
}

#[test]
fn a_rank_that_never_joins_fails_the_others_in_time_naming_it() {
    let Some((rank, _, _)) = rank_env() else {
        // Only rank 0 of a world of 2 starts.
        let outcomes = run_ranks(
            "a_rank_that_never_joins_fails_the_others_in_time_naming_it",
            2,
            &[0],
            &[],
        );
        assert_all_ok(&outcomes);
        assert!(
            outcomes[0].elapsed < Duration::from_secs(15),
            "took {:?}",
            outcomes[0].elapsed
        );
        return;
    };
    assert_eq!(rank, 0);
    let options = GroupOptions::for_rank(&torchrun_env(), Backend::Gloo, Duration::from_secs(2))
        .expect("env");
    let started = Instant::now();
    let err = ProcessGroup::new(&options).expect_err("rank 1 never joins");
    let waited = started.elapsed();
    let text = err.to_string();
    assert!(text.contains("rank 0 of 2"), "{text}");
    assert!(text.contains("rank(s) [1] of 2 did not join"), "{text}");
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
}

#[test]
fn without_rank_0_the_store_is_unreachable_in_time() {
    let Some((rank, _, _)) = rank_env() else {
        let outcomes = run_ranks(
            "without_rank_0_the_store_is_unreachable_in_time",
            2,
            &[1],
            &[],
        );
        assert_all_ok(&outcomes);
        return;
    };
    assert_eq!(rank, 1);
    let options = GroupOptions::for_rank(&torchrun_env(), Backend::Gloo, Duration::from_secs(2))
        .expect("env");
    let started = Instant::now();
    let err = ProcessGroup::new(&options).expect_err("no rank 0");
    let text = err.to_string();
    assert!(text.contains("rank 1 of 2"), "{text}");
    assert!(
        text.contains("could not reach rank 0's rendezvous store"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_dies_fails_the_next_collective_naming_the_op() {
    let Some((rank, _, _)) = rank_env() else {
        let outcomes = run_ranks(
            "a_rank_that_dies_fails_the_next_collective_naming_the_op",
            2,
            &[0, 1],
            &[],
        );
        assert_all_ok(&outcomes);
        return;
    };
    let mut group = join(Duration::from_secs(3));
    let mut t = Tensor::ones([16], (Kind::Float, tch::Device::Cpu));
    group
        .all_reduce(&mut t, ReduceOp::Sum)
        .expect("first all-reduce");
    if rank == 1 {
        // Leave without a word, as a crashed rank would.
        std::process::exit(0);
    }
    let started = Instant::now();
    let err = group
        .all_reduce(&mut t, ReduceOp::Sum)
        .expect_err("peer is gone");
    let text = err.to_string();
    assert!(
        text.contains("rank 0 of 2: all_reduce #1 (gloo) failed"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_hangs_fails_the_others_at_the_timeout_naming_it() {
    let Some((rank, _, _)) = rank_env() else {
        let outcomes = run_ranks(
            "a_rank_that_hangs_fails_the_others_at_the_timeout_naming_it",
            2,
            &[0, 1],
            &[],
        );
        assert_all_ok(&outcomes);
        return;
    };
    let mut group = join(Duration::from_secs(2));
    let mut t = Tensor::ones([16], (Kind::Float, tch::Device::Cpu));
    group
        .all_reduce(&mut t, ReduceOp::Sum)
        .expect("first all-reduce");
    if rank == 1 {
        // Stuck (a dead-locked data loader, say) past the 2 s time-out.
        std::thread::sleep(Duration::from_secs(5));
        return;
    }
    let started = Instant::now();
    let err = group
        .all_reduce(&mut t, ReduceOp::Sum)
        .expect_err("rank 1 hangs");
    let waited = started.elapsed();
    let text = err.to_string();
    assert!(
        text.contains("rank 0 of 2: all_reduce #1 (gloo) failed"),
        "{text}"
    );
    assert!(
        text.contains("peers that never reached all_reduce #1: rank 1 last entered all_reduce #0"),
        "{text}"
    );
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(8),
        "{waited:?}"
    );
}
