//! Activation checkpointing (`MODEL.USE_CHECKPOINT_ATTN` / `USE_CHECKPOINT_FFN`):
//! [`checkpoint`] runs a closure without keeping its activations and runs it again in
//! the backward pass, through a custom autograd function of the C++ shim
//! (`src/model/shim/checkpoint.cpp`), like PyTorch's reentrant
//! `torch.utils.checkpoint`. The recomputation sees the forward's RNG state (CPU and
//! the CUDA devices of the inputs) and autocast state, so drop path draws the same.
//!
//! As in PyTorch, parameters the closure uses get their gradient accumulated by a
//! nested backward pass, so the outer backward must be a plain `backward()` (not a
//! gradient with respect to chosen inputs), and tensors the closure captures must be
//! leaves (parameters, buffers), never results of the outer graph: pass those as
//! inputs.
//!
//! [`on_backward`] (in `hook`) uses the same shim for a backward hook: profiles time
//! each part of the backward pass with it.

mod ffi;
mod hook;

pub use hook::on_backward;

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use tch::Tensor;

use super::ModelError;
use crate::config::ModelConfig;

/// Which parts of a transformer block recompute their activations in the backward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checkpointing {
    /// Attention (with its norm and drop path): `MODEL.USE_CHECKPOINT_ATTN`.
    pub attn: bool,
    /// MLP (with its norm and drop path): `MODEL.USE_CHECKPOINT_FFN`.
    pub ffn: bool,
}

impl Checkpointing {
    /// The flags of a `MODEL` config.
    pub fn from_config(cfg: &ModelConfig) -> Checkpointing {
        Checkpointing {
            attn: cfg.use_checkpoint_attn,
            ffn: cfg.use_checkpoint_ffn,
        }
    }
}

/// A checkpointed closure.
type Closure = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>, ModelError> + Send;

/// What the shim holds for one checkpointed call: the closure, behind a mutex since
/// the backward pass may call it from another thread (an autograd worker).
struct Context {
    closure: Mutex<Box<Closure>>,
}

thread_local! {
    /// The error of the last closure that failed in a forward pass on this thread,
    /// handed back typed by [`checkpoint`].
    static FORWARD_ERROR: RefCell<Option<ModelError>> = const { RefCell::new(None) };
}

/// Whether autograd records operations on this thread.
pub fn grad_enabled() -> bool {
    // SAFETY: reads libtorch's thread-local grad mode; no arguments.
    unsafe { ffi::vs_ckpt_grad_enabled() != 0 }
}

/// Runs `f(inputs)` and returns its outputs; when autograd records, without keeping
/// the activations inside `f`: the backward pass runs `f` again (same RNG and autocast
/// state) and back-propagates through it. Without grad (evaluation, validation) this
/// is `f` called directly. `f` must own what it uses (it runs again after this returns).
pub fn checkpoint<F>(inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>, ModelError>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>, ModelError> + Send + 'static,
{
    if !grad_enabled() {
        let owned: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
        return f(&owned);
    }
    let boxed: Box<Closure> = Box::new(f);
    let ctx = Box::into_raw(Box::new(Context {
        closure: Mutex::new(boxed),
    }));
    let ptrs: Vec<*const c_void> = inputs.iter().map(|t| t.as_ptr() as *const c_void).collect();
    let mut outputs: *mut *mut c_void = std::ptr::null_mut();
    let mut n_outputs = 0usize;
    FORWARD_ERROR.with(|slot| slot.borrow_mut().take());
    // SAFETY: `ctx` is a leaked Box<Context> whose ownership passes to the shim, which
    // releases it through `drop_boxed` exactly once; `ptrs` point to live tensors
    // borrowed for this call; the out-pointers are valid for writes.
    let status = unsafe {
        ffi::vs_checkpoint(
            call_context,
            drop_boxed::<Context>,
            ctx as *mut c_void,
            ptrs.as_ptr(),
            ptrs.len(),
            &mut outputs,
            &mut n_outputs,
        )
    };
    if let Err(message) = ffi::take_error(status) {
        let typed = FORWARD_ERROR.with(|slot| slot.borrow_mut().take());
        return Err(typed.unwrap_or(ModelError::Checkpoint(message)));
    }
    let tensors = (0..n_outputs)
        // SAFETY: on success `outputs` holds `n_outputs` pointers to tensors the shim
        // allocated with `new` for us to own; tch frees each with `delete`.
        .map(|i| unsafe { Tensor::from_ptr(*outputs.add(i) as *mut _) })
        .collect();
    // SAFETY: the array came from the shim's malloc; its tensors are now owned above.
    unsafe { ffi::vs_ckpt_free_array(outputs) };
    Ok(tensors)
}

/// [`checkpoint`] of a closure with one output.
pub fn checkpoint_one<F>(inputs: &[&Tensor], f: F) -> Result<Tensor, ModelError>
where
    F: Fn(&[Tensor]) -> Result<Tensor, ModelError> + Send + 'static,
{
    let mut out = checkpoint(inputs, move |t| f(t).map(|y| vec![y]))?;
    match out.pop() {
        Some(y) if out.is_empty() => Ok(y),
        _ => Err(ModelError::Checkpoint(
            "checkpointed function returned other than one tensor".into(),
        )),
    }
}

/// The shim's call-back: runs the closure of `ctx`, never unwinding into C++.
extern "C" fn call_context(
    ctx: *mut c_void,
    phase: c_int,
    inputs: *const *mut c_void,
    n: usize,
    result: *mut c_void,
) -> c_int {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the Box<Context> leaked by `checkpoint`, alive until the
        // shim calls `drop_boxed`, which it does only after its last call here.
        let context = unsafe { &*(ctx as *const Context) };
        let tensors: Vec<Tensor> = (0..n)
            // SAFETY: the shim passes `n` pointers to tensors alive during this call;
            // each is shallow-copied into a tensor we own.
            .map(|i| unsafe { Tensor::clone_from_ptr(*inputs.add(i) as *mut _) })
            .collect();
        let closure = context
            .closure
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        closure(&tensors)
    }));
    let error = match outcome {
        Ok(Ok(outputs)) => {
            for t in &outputs {
                // SAFETY: `result` is the shim's CallResult for this call; `t` is alive.
                if unsafe { ffi::vs_ckpt_push(result, t.as_ptr() as *const c_void) } != 0 {
                    fail(result, "could not store the outputs (out of memory)");
                    return 1;
                }
            }
            return 0;
        }
        Ok(Err(e)) => {
            let message = e.to_string();
            if phase == ffi::PHASE_FORWARD {
                FORWARD_ERROR.with(|slot| *slot.borrow_mut() = Some(e));
            }
            message
        }
        Err(panic) => format!("panicked: {}", panic_message(panic.as_ref())),
    };
    fail(result, &error);
    1
}

/// Reports `message` as the failure of the call writing into `result`.
fn fail(result: *mut c_void, message: &str) {
    // SAFETY: `result` is the shim's CallResult for this call; the message is copied.
    unsafe { ffi::vs_ckpt_fail(result, message.as_ptr() as *const _, message.len()) };
}

/// The text of a panic payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// The shim's release call-back for a `Box<T>` leaked as `ctx` (a checkpoint's
/// [`Context`], a hook's closure): drops it, never unwinding into C++.
extern "C" fn drop_boxed<T>(ctx: *mut c_void) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is a Box<T> leaked by `checkpoint` or `on_backward` for the
        // shim, which calls this exactly once, after its last use.
        drop(unsafe { Box::from_raw(ctx as *mut T) });
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn without_grad_the_closure_runs_directly() {
        let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = tch::no_grad(|| checkpoint_one(&[&x], |t| Ok(&t[0] * 2.0))).unwrap();
        assert!(!y.requires_grad());
        assert_eq!(y.sum(Kind::Float).double_value(&[]), 6.0);
    }

    #[test]
    fn gradients_flow_through_inputs_and_captured_parameters() {
        let opts = (Kind::Float, Device::Cpu);
        let mut w = Tensor::randn([4, 4], opts).set_requires_grad(true);
        let mut x = Tensor::randn([2, 4], opts).set_requires_grad(true);
        let captured = w.shallow_clone();
        let y = checkpoint_one(&[&x], move |t| Ok(t[0].matmul(&captured).tanh())).unwrap();
        y.sum(Kind::Float).backward();
        let (gx, gw) = (x.grad(), w.grad());
        x.zero_grad();
        w.zero_grad();
        x.matmul(&w).tanh().sum(Kind::Float).backward();
        assert!(gx.allclose(&x.grad(), 1e-6, 1e-6, false));
        assert!(gw.allclose(&w.grad(), 1e-6, 1e-6, false));
        assert!(gw.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }
}
