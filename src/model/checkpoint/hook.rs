//! A backward hook: [`on_backward`] returns its input unchanged, and the backward
//! pass calls a closure when the gradient of that tensor is complete (every use of
//! it downstream has sent its part). The autograd engine runs the nodes of a pass
//! in reverse creation order, so hooks on the outputs of successive parts fire in
//! reverse order and the time between two is the backward pass of the part between.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::Tensor;

use super::{drop_boxed, ffi, grad_enabled};
use crate::model::ModelError;

/// A hook's closure; `Sync` since the backward pass may run it on an autograd thread.
type Hook = Box<dyn Fn() + Send + Sync>;

/// `x` with `f` called when the backward pass reaches it; `x` itself (no hook) when
/// autograd does not record or `x` needs no gradient.
pub fn on_backward<F>(x: &Tensor, f: F) -> Result<Tensor, ModelError>
where
    F: Fn() + Send + Sync + 'static,
{
    if !grad_enabled() || !x.requires_grad() {
        return Ok(x.shallow_clone());
    }
    let ctx = Box::into_raw(Box::new(Box::new(f) as Hook));
    let mut output: *mut c_void = std::ptr::null_mut();
    // SAFETY: `ctx` is a leaked Box<Hook> whose ownership passes to the shim, which
    // releases it through `drop_boxed` exactly once; `x` is alive for the call; the
    // out-pointer is valid for a write.
    let status = unsafe {
        ffi::vs_backward_hook(
            call_hook,
            drop_boxed::<Hook>,
            ctx as *mut c_void,
            x.as_ptr() as *const c_void,
            &mut output,
        )
    };
    ffi::take_error(status).map_err(ModelError::Checkpoint)?;
    // SAFETY: on success `output` is a tensor the shim allocated with `new` for us
    // to own; tch frees it with `delete`.
    Ok(unsafe { Tensor::from_ptr(output as *mut _) })
}

/// The shim's call-back: runs the hook of `ctx`, never unwinding into C++ (a panic
/// in a hook is dropped: the gradient still flows).
extern "C" fn call_hook(ctx: *mut c_void) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the Box<Hook> leaked by `on_backward`, alive until the shim
        // calls `drop_boxed`, which it does only after its last call here.
        let hook = unsafe { &*(ctx as *const Hook) };
        hook();
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use tch::{Device, Kind};

    #[test]
    fn hooks_fire_once_in_reverse_order_and_leave_gradients_alone() {
        let opts = (Kind::Float, Device::Cpu);
        let mut x = Tensor::randn([3, 4], opts).set_requires_grad(true);
        let order = Arc::new(Mutex::new(Vec::new()));
        let hooked = |t: &Tensor, name: &'static str| {
            let order = Arc::clone(&order);
            on_backward(t, move || order.lock().unwrap().push(name)).unwrap()
        };
        let a = hooked(&(x.tanh() * 2.0), "a");
        // `a` is used twice: its hook waits for both gradients.
        let b = hooked(&(a.sin() + &a), "b");
        b.square().sum(Kind::Float).backward();
        assert_eq!(*order.lock().unwrap(), vec!["b", "a"]);
        let with_hooks = x.grad().copy();
        x.zero_grad();
        let a = x.tanh() * 2.0;
        (a.sin() + &a).square().sum(Kind::Float).backward();
        assert!(with_hooks.allclose(&x.grad(), 1e-6, 1e-6, false));
    }

    #[test]
    fn no_hook_without_grad_and_the_closure_is_released() {
        let calls = Arc::new(AtomicUsize::new(0));
        let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let counter = Arc::clone(&calls);
        let y = tch::no_grad(|| {
            on_backward(&x, move || {
                counter.fetch_add(1, Ordering::SeqCst);
            })
        })
        .unwrap();
        // Without grad the input comes back as it is: no node in front of it.
        assert!(y.is_leaf() && y.data_ptr() == x.data_ptr());
        drop(y);
        assert_eq!(Arc::strong_count(&calls), 1, "the unused hook was kept");
        let counter = Arc::clone(&calls);
        let mut y = on_backward(&(&x * 1.0), move || {
            counter.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        // The hooked tensor may be changed in place, like any output.
        y += 1.0;
        let z = &y * 3.0;
        z.sum(Kind::Float).backward();
        assert_eq!(x.grad().sum(Kind::Float).double_value(&[]), 6.0);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        drop((y, z));
        // Only the test's handle is left once the graph is gone.
        assert_eq!(Arc::strong_count(&calls), 1);
    }
}
