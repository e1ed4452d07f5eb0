//! Gradient averaging overlapped with backward through PyTorch DDP's own engine,
//! `c10d::Reducer` (libtorch_cpu; driven through the c10d shim, see
//! `shim/c10d_shim.cpp`). Autograd hooks on each parameter's gradient accumulator
//! mark it ready and a bucket's all-reduce starts as soon as its last gradient
//! exists, while backward goes on (Li et al., "PyTorch Distributed: Experiences on
//! Accelerating Data Parallel Training", VLDB 2020).
//!
//! One iteration, as Python's `DistributedDataParallel` drives it: [`GradReducer::before_forward`]
//! before every micro-batch's forward pass, then [`GradReducer::backward`] instead of
//! `loss.backward()`. Only the optimizer step's last micro-batch reduces
//! ([`GradSync::Reduce`]); the others accumulate locally ([`GradSync::Accumulate`],
//! DDP's `no_sync`). With [`ReducerOptions::static_graph`] (DDP's `static_graph=True`)
//! the Reducer counts in its first reducing iteration how often each parameter's
//! accumulator fires, which is what lets the project's reentrant activation
//! checkpointing (one firing per recomputed block) work with it.
//!
//! libtorch's static graph takes the first backward pass that fires any hook as
//! that counting iteration, reducing or not, so a `no_sync` pass before the first
//! reducing one would be counted twice and no later bucket would ever be ready
//! (gradients silently left unaveraged). Hence every micro-batch reduces until
//! one has: averaging is linear and the earlier result is the same on every rank,
//! so reducing each micro-batch of the first step gives the same gradients, for
//! a few more all-reduces once.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use tch::Tensor;
use vrtspike_contract::heartbeat::CollectiveOp;

use super::error::DistError;
use super::ffi;
use super::flat::{verify_shapes, BUCKET_BYTES, FIRST_BUCKET_BYTES};
use super::group::ProcessGroup;
use super::progress::CollectiveObserver;

/// How gradient buckets travel (`DIST.GRAD_COMPRESSION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradCompression {
    /// In the gradients' own dtype (the Reducer's default all-reduce).
    #[default]
    None,
    /// Cast to float16 for the all-reduce (as libtorch's built-in `FP16_COMPRESS` hook).
    Fp16,
    /// Cast to bfloat16 for the all-reduce (the shim's hook: libtorch has it only in Python).
    Bf16,
}

impl GradCompression {
    fn code(self) -> c_int {
        match self {
            GradCompression::None => 0,
            GradCompression::Fp16 => 1,
            GradCompression::Bf16 => 2,
        }
    }
}

/// Whether a micro-batch's backward pass reduces the gradients over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradSync {
    /// The optimizer step's last micro-batch: gradients are averaged over ranks.
    Reduce,
    /// An earlier micro-batch: gradients accumulate locally (DDP's `no_sync`).
    Accumulate,
}

impl GradSync {
    /// `Reduce` for the last of `count` micro-batches, else `Accumulate`.
    pub fn for_micro_batch(index: usize, count: usize) -> GradSync {
        if index + 1 >= count {
            GradSync::Reduce
        } else {
            GradSync::Accumulate
        }
    }

    fn flag(self) -> c_int {
        c_int::from(self == GradSync::Reduce)
    }
}

/// Settings of a [`GradReducer`]; the defaults are PyTorch DDP's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReducerOptions {
    /// Cap of the first bucket (the first gradients to arrive), in bytes.
    pub first_bucket_bytes: usize,
    /// Cap of every later bucket, in bytes.
    pub bucket_bytes: usize,
    /// The communication hook.
    pub compression: GradCompression,
    /// DDP's `static_graph=True`: every iteration uses the same parameters the
    /// same number of times (needed with activation checkpointing).
    pub static_graph: bool,
}

impl Default for ReducerOptions {
    fn default() -> Self {
        ReducerOptions {
            first_bucket_bytes: FIRST_BUCKET_BYTES,
            bucket_bytes: BUCKET_BYTES,
            compression: GradCompression::None,
            static_graph: true,
        }
    }
}

/// One rank's Reducer over its model's parameters; every rank builds one over
/// the same parameter list, in the same order.
pub struct GradReducer {
    raw: *mut ffi::RawReducer,
    params: Vec<Tensor>,
    rank: usize,
    /// Whether a backward pass has reduced yet (see the module doc).
    reduced_once: bool,
}

// SAFETY: the shim's Reducer is used by one thread at a time (`GradReducer` owns
// its handle exclusively and is not `Sync`); its internal state is guarded by its
// own mutex against the autograd threads that fire its hooks.
unsafe impl Send for GradReducer {}

impl std::fmt::Debug for GradReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradReducer")
            .field("params", &self.params.len())
            .field("rank", &self.rank)
            .finish()
    }
}

impl GradReducer {
    /// Checks that every rank has the same parameter dtypes and shapes, overwrites
    /// them with rank 0's values, and hooks the Reducer onto their gradient
    /// accumulators. Every rank must call this.
    pub fn new(
        group: &mut ProcessGroup,
        params: Vec<Tensor>,
        options: ReducerOptions,
    ) -> Result<GradReducer, DistError> {
        let rank = group.rank();
        verify_shapes(group, &params)?;
        if let Some(frozen) = params.iter().position(|p| !p.requires_grad()) {
            return Err(DistError::Tensor {
                rank,
                op: "reducer init",
                message: format!("parameter #{frozen} does not require grad"),
            });
        }
        let ptrs: Vec<*mut c_void> = params.iter().map(|p| p.as_ptr() as *mut c_void).collect();
        let caps = (
            i64::try_from(options.first_bucket_bytes).unwrap_or(i64::MAX),
            i64::try_from(options.bucket_bytes).unwrap_or(i64::MAX),
        );
        let mut raw: *mut ffi::RawReducer = std::ptr::null_mut();
        group.run_collective(CollectiveOp::Broadcast, |group_raw| {
            // SAFETY: `ptrs` holds one live `at::Tensor*` per parameter (owned by
            // `params`, which the returned value keeps alive) and outlives the call;
            // `raw` is written only on success.
            unsafe {
                ffi::vs_reducer_new(
                    group_raw,
                    ptrs.as_ptr(),
                    ptrs.len(),
                    caps.0,
                    caps.1,
                    options.compression.code(),
                    c_int::from(options.static_graph),
                    &mut raw,
                )
            }
        })?;
        if raw.is_null() {
            return Err(DistError::Tensor {
                rank,
                op: "reducer init",
                message: "the shim returned no Reducer".into(),
            });
        }
        tracing::debug!(rank, params = params.len(), ?options, "reducer ready");
        Ok(GradReducer {
            raw,
            params,
            rank,
            reduced_once: false,
        })
    }

    /// The parameters the Reducer averages (shallow handles on the model's tensors).
    pub fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    /// Before a micro-batch's forward pass: rebuilds the buckets in the order
    /// gradients arrived once a reducing iteration has shown it (a broadcast from
    /// rank 0, at the same micro-batch on every rank), and counts the pass as an
    /// iteration of the Reducer's from the first reducing one on.
    pub fn before_forward(&mut self, sync: GradSync) -> Result<(), DistError> {
        let count = self.reduced_once || self.effective(sync) == GradSync::Reduce;
        // SAFETY: `self.raw` is the live Reducer this value owns.
        let status = unsafe { ffi::vs_reducer_forward(self.raw, c_int::from(count)) };
        ffi::take_error(status).map_err(|message| DistError::Tensor {
            rank: self.rank,
            op: "reducer before forward",
            message,
        })
    }

    /// `sync`, or `Reduce` while no backward pass has reduced yet.
    fn effective(&self, sync: GradSync) -> GradSync {
        if self.reduced_once {
            sync
        } else {
            GradSync::Reduce
        }
    }

    /// Back-propagates `loss`; with [`GradSync::Reduce`] (and in every pass until
    /// one has reduced) every parameter's gradient holds the average over ranks
    /// when this returns (one numbered all-reduce collective of `group`, whose
    /// failure names the peers that never reached it). Returns the communication
    /// backward did not hide: from the last gradient's arrival to the return
    /// (zero for a pass that does not reduce).
    pub fn backward(
        &mut self,
        group: &mut ProcessGroup,
        loss: &Tensor,
        sync: GradSync,
    ) -> Result<Duration, DistError> {
        let sync = self.effective(sync);
        let loss_ptr = loss.as_ptr() as *mut c_void;
        let reducer = self.raw;
        let mut exposed_ns = 0i64;
        let mut call = |group_raw| {
            // SAFETY: the group, Reducer and loss handles are live for the call and
            // `exposed_ns` is writable; the shim runs backward to completion first.
            unsafe {
                ffi::vs_reducer_backward(group_raw, reducer, loss_ptr, sync.flag(), &mut exposed_ns)
            }
        };
        match sync {
            GradSync::Reduce => {
                let buckets = BucketProgress {
                    observer: group.observer(),
                    seq: group.next_seq(),
                };
                let _watch = BucketWatch::new(reducer, &buckets);
                group.run_collective(CollectiveOp::AllReduce, call)?;
                self.reduced_once = true;
            }
            GradSync::Accumulate => {
                ffi::take_error(call(std::ptr::null_mut())).map_err(|message| {
                    DistError::Tensor {
                        rank: self.rank,
                        op: "backward",
                        message,
                    }
                })?;
            }
        }
        Ok(Duration::from_nanos(u64::try_from(exposed_ns).unwrap_or(0)))
    }
}

/// Whom a reducing backward pass tells of its gradient buckets: the group's
/// observer, with the number of the collective the pass is.
struct BucketProgress {
    observer: Option<Arc<dyn CollectiveObserver>>,
    seq: u64,
}

/// The shim's Reducer calls this around each bucket it launches (see
/// `ffi::BucketFn`); `ctx` is the [`BucketProgress`] of the pass.
extern "C" fn on_bucket(ctx: *mut c_void, count: i64, launched: c_int) {
    // SAFETY: `ctx` is the `BucketProgress` a live `BucketWatch` handed to the shim;
    // the watch clears it before the value goes, and the shim calls this only during
    // the backward pass that the watch spans.
    let progress = unsafe { &*(ctx as *const BucketProgress) };
    let Some(observer) = &progress.observer else {
        return;
    };
    let count = u32::try_from(count).unwrap_or(u32::MAX);
    // A panic must not unwind into the autograd engine's C++ frames.
    let _ = catch_unwind(AssertUnwindSafe(|| match launched {
        0 => observer.bucket_launching(progress.seq, count),
        _ => observer.buckets_launched(progress.seq, count),
    }));
}

/// Points the shim's Reducer at a pass's [`BucketProgress`] while it lives.
struct BucketWatch {
    reducer: *mut ffi::RawReducer,
}

impl BucketWatch {
    fn new(reducer: *mut ffi::RawReducer, progress: &BucketProgress) -> BucketWatch {
        let ctx = progress as *const BucketProgress as *mut c_void;
        // SAFETY: `reducer` is the live Reducer of the caller; `ctx` outlives the
        // watch (the caller keeps `progress` until the watch is dropped).
        unsafe { ffi::vs_reducer_watch(reducer, Some(on_bucket), ctx) };
        BucketWatch { reducer }
    }
}

impl Drop for BucketWatch {
    fn drop(&mut self) {
        // SAFETY: the Reducer is still alive (its owner outlives this guard); nobody
        // hears of its buckets from now on.
        unsafe { ffi::vs_reducer_watch(self.reducer, None, std::ptr::null_mut()) };
    }
}

impl Drop for GradReducer {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `vs_reducer_new`, is non-null, and is freed once;
        // freeing removes its hooks from the parameters' accumulators.
        unsafe { ffi::vs_reducer_free(self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_last_micro_batch_reduces() {
        let syncs: Vec<GradSync> = (0..3).map(|i| GradSync::for_micro_batch(i, 3)).collect();
        assert_eq!(
            syncs,
            vec![GradSync::Accumulate, GradSync::Accumulate, GradSync::Reduce]
        );
        assert_eq!(GradSync::for_micro_batch(0, 1), GradSync::Reduce);
    }

    /// Records what the group and the Reducer say of collectives and buckets.
    #[derive(Default)]
    struct Heard(std::sync::Mutex<Vec<String>>);

    impl Heard {
        fn push(&self, line: String) {
            if let Ok(mut heard) = self.0.lock() {
                heard.push(line);
            }
        }
    }

    impl CollectiveObserver for Heard {
        fn entered(&self, op: CollectiveOp, seq: u64) {
            self.push(format!("enter {} #{seq}", op.name()));
        }
        fn completed(&self, seq: u64) {
            self.push(format!("done #{seq}"));
        }
        fn bucket_launching(&self, seq: u64, index: u32) {
            self.push(format!("#{seq}: launching bucket {index}"));
        }
        fn buckets_launched(&self, seq: u64, launched: u32) {
            self.push(format!("#{seq}: {launched} launched"));
        }
    }

    /// The heartbeat hears of each gradient bucket a reducing backward pass
    /// launches, inside that pass's collective (the static graph's first pass
    /// launches them all once backward is done); a pass that only accumulates
    /// launches none.
    #[test]
    fn a_reducing_backward_tells_the_observer_of_each_bucket() {
        let mut group = crate::ddp::group::gloo_world_of_one();
        let heard = Arc::new(Heard::default());
        group.observe(heard.clone());
        let w = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
        let v = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let options = ReducerOptions {
            first_bucket_bytes: 4,
            bucket_bytes: 4,
            ..ReducerOptions::default()
        };
        let params = vec![w.shallow_clone(), v.shallow_clone()];
        let mut reducer = GradReducer::new(&mut group, params, options).expect("reducer");
        for sync in [GradSync::Reduce, GradSync::Accumulate, GradSync::Reduce] {
            reducer.before_forward(sync).expect("before forward");
            let loss = (&w.sum(tch::Kind::Float) * &v).sum(tch::Kind::Float);
            reducer.backward(&mut group, &loss, sync).expect("backward");
        }
        // The shape check's all-reduces and the broadcast of rank 0's values come
        // first; the passes follow.
        let heard = heard.0.lock().expect("lock").clone();
        let first = heard
            .iter()
            .position(|h| h.starts_with("enter broadcast #"))
            .expect("the broadcast");
        let b: u64 = heard[first]["enter broadcast #".len()..]
            .parse()
            .expect("seq");
        let pass = |seq: u64| {
            vec![
                format!("enter all_reduce #{seq}"),
                format!("#{seq}: launching bucket 0"),
                format!("#{seq}: 1 launched"),
                format!("#{seq}: launching bucket 1"),
                format!("#{seq}: 2 launched"),
                format!("done #{seq}"),
            ]
        };
        let mut expected = vec![format!("enter broadcast #{b}"), format!("done #{b}")];
        expected.extend(pass(b + 1));
        expected.extend(pass(b + 2));
        assert_eq!(heard[first..], expected[..]);
    }

    #[test]
    fn a_world_of_one_reduces_to_its_own_gradients_with_every_hook() {
        let w = Tensor::from_slice(&[1.0f32, -2.0, 3.0]).set_requires_grad(true);
        let x = Tensor::from_slice(&[0.5f32, 0.25, 2.0]);
        for compression in [
            GradCompression::None,
            GradCompression::Bf16,
            GradCompression::Fp16,
        ] {
            let mut group = crate::ddp::group::gloo_world_of_one();
            let options = ReducerOptions {
                compression,
                ..ReducerOptions::default()
            };
            let mut reducer =
                GradReducer::new(&mut group, vec![w.shallow_clone()], options).expect("reducer");
            for step in 0..3 {
                let mut grad = w.grad();
                if grad.defined() {
                    let _ = grad.zero_();
                }
                // Two micro-batches: the first accumulates, the second reduces.
                for micro in 0..2 {
                    let sync = GradSync::for_micro_batch(micro, 2);
                    reducer.before_forward(sync).expect("before forward");
                    let loss = (&w * &x).sum(tch::Kind::Float);
                    reducer.backward(&mut group, &loss, sync).expect("backward");
                }
                let got = Vec::<f32>::try_from(&w.grad()).expect("grad");
                assert_eq!(got, vec![1.0, 0.5, 4.0], "{compression:?} step {step}");
            }
            drop(reducer);
            // The hooks went with the Reducer: a plain backward still accumulates.
            let mut grad = w.grad();
            let _ = grad.zero_();
            (&w * &x).sum(tch::Kind::Float).backward();
            assert_eq!(
                Vec::<f32>::try_from(&w.grad()).expect("grad"),
                vec![0.5, 0.25, 2.0]
            );
        }
    }
}
