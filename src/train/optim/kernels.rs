//! The multi-tensor kernels of an optimizer step, through the training shim
//! (`src/train/shim/update.cpp`; tch binds none of them): the global norm of a list,
//! a list scaled or zeroed in one call, AdamW fused (`_fused_adamw_`) or in its
//! multi-tensor form (`_foreach_*`), and the fp16 loss scaler's unscale-and-check and
//! scale update. Every entry point returns libtorch's error as a [`TchError`].

use std::ffi::{c_char, c_void, CStr};

use tch::{TchError, Tensor};

extern "C" {
    fn vs_update_string_free(text: *mut c_char);
    fn vs_update_total_norm(
        tensors: *const *mut c_void,
        n: usize,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn vs_update_mul_(tensors: *const *mut c_void, n: usize, factor: *const c_void) -> *mut c_char;
    fn vs_update_zero_(tensors: *const *mut c_void, n: usize) -> *mut c_char;
    fn vs_update_adamw_fused(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        n: usize,
        step: *const c_void,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        found_inf: *const c_void,
    ) -> *mut c_char;
    fn vs_update_adamw_foreach(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        n: usize,
        step: f64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> *mut c_char;
    fn vs_update_unscale_(
        grads: *const *mut c_void,
        n: usize,
        found_inf: *mut c_void,
        inv_scale: *const c_void,
    ) -> *mut c_char;
    fn vs_update_scale_(
        scale: *mut c_void,
        tracker: *mut c_void,
        found_inf: *const c_void,
        growth: f64,
        backoff: f64,
        interval: i64,
    ) -> *mut c_char;
}

/// AdamW's hyper-parameters of one group's update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWRates {
    /// Learning rate (the group's multiplier applied).
    pub lr: f64,
    /// First moment decay.
    pub beta1: f64,
    /// Second moment decay.
    pub beta2: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Denominator term.
    pub eps: f64,
}

/// Parameters with their gradients and moments, index for index (one group's
/// update).
pub struct AdamWLists<'a> {
    /// The parameters.
    pub params: &'a [Tensor],
    /// Their gradients.
    pub grads: &'a [Tensor],
    /// First moments.
    pub exp_avgs: &'a [Tensor],
    /// Second moments.
    pub exp_avg_sqs: &'a [Tensor],
}

/// Turns a status of the training shim (`src/train/shim/`) into a result, freeing
/// the shim's string.
pub(crate) fn status(raw: *mut c_char) -> Result<(), TchError> {
    if raw.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status is a NUL-terminated string the shim malloc'd; it is
    // copied before it is freed.
    let message = unsafe { CStr::from_ptr(raw) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `raw` came from the shim's malloc and is freed exactly once.
    unsafe { vs_update_string_free(raw) };
    Err(TchError::Torch(message))
}

/// The C tensor pointers of `tensors` (valid while `tensors` lives).
fn pointers(tensors: &[Tensor]) -> Vec<*mut c_void> {
    tensors.iter().map(|t| t.as_ptr() as *mut c_void).collect()
}

impl AdamWLists<'_> {
    /// The four lists' C tensor pointers (valid while the lists live).
    fn pointers(&self) -> [Vec<*mut c_void>; 4] {
        [
            pointers(self.params),
            pointers(self.grads),
            pointers(self.exp_avgs),
            pointers(self.exp_avg_sqs),
        ]
    }

    fn len(&self) -> Result<usize, TchError> {
        let n = self.params.len();
        if [
            self.grads.len(),
            self.exp_avgs.len(),
            self.exp_avg_sqs.len(),
        ] != [n, n, n]
        {
            return Err(TchError::Shape(format!(
                "AdamW lists of different lengths: {n} parameters, {} gradients, {} and {} moments",
                self.grads.len(),
                self.exp_avgs.len(),
                self.exp_avg_sqs.len()
            )));
        }
        Ok(n)
    }
}

/// The L2 norm of all `tensors` together as a 0-dim float tensor on their device
/// (one `_foreach_norm` and one norm); `None` for an empty list.
pub fn total_norm(tensors: &[Tensor]) -> Result<Option<Tensor>, TchError> {
    if tensors.is_empty() {
        return Ok(None);
    }
    let ptrs = pointers(tensors);
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: `ptrs` point to live `at::Tensor`s for the call; `out` is a valid
    // out-pointer that the shim fills with a new'd tensor on success.
    status(unsafe { vs_update_total_norm(ptrs.as_ptr(), ptrs.len(), &mut out) })?;
    // SAFETY: on success `out` is a tensor the shim allocated for the caller to own.
    Ok(Some(unsafe { Tensor::from_ptr(out as *mut _) }))
}

/// Multiplies every tensor of `tensors` in place by the 0-dim `factor`.
pub fn mul_(tensors: &[Tensor], factor: &Tensor) -> Result<(), TchError> {
    if tensors.is_empty() {
        return Ok(());
    }
    let ptrs = pointers(tensors);
    // SAFETY: the pointers are live `at::Tensor`s for the call.
    status(unsafe { vs_update_mul_(ptrs.as_ptr(), ptrs.len(), factor.as_ptr() as *const c_void) })
}

/// Zeroes every tensor of `tensors` in one call.
pub fn zero_(tensors: &[Tensor]) -> Result<(), TchError> {
    if tensors.is_empty() {
        return Ok(());
    }
    let ptrs = pointers(tensors);
    // SAFETY: the pointers are live `at::Tensor`s for the call.
    status(unsafe { vs_update_zero_(ptrs.as_ptr(), ptrs.len()) })
}

/// AdamW through libtorch's fused kernel: `step` is the 0-dim float step count the
/// bias corrections read (advanced for this update), on the parameters' device;
/// where `found_inf` (0-dim float, 0 or 1) is 1 nothing changes.
pub fn adamw_fused(
    lists: &AdamWLists<'_>,
    step: &Tensor,
    rates: AdamWRates,
    found_inf: Option<&Tensor>,
) -> Result<(), TchError> {
    let n = lists.len()?;
    if n == 0 {
        return Ok(());
    }
    let [p, g, m, v] = lists.pointers();
    let inf = found_inf.map_or(std::ptr::null(), |t| t.as_ptr() as *const c_void);
    // SAFETY: every pointer is a live `at::Tensor` for the call (`inf` may be null,
    // which the shim reads as no flag); the lists have `n` entries each.
    status(unsafe {
        vs_update_adamw_fused(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n,
            step.as_ptr() as *const c_void,
            rates.lr,
            rates.beta1,
            rates.beta2,
            rates.weight_decay,
            rates.eps,
            inf,
        )
    })
}

/// AdamW in PyTorch's multi-tensor form with the bias corrections of step count
/// `step` (>= 1).
pub fn adamw_foreach(lists: &AdamWLists<'_>, step: u64, rates: AdamWRates) -> Result<(), TchError> {
    let n = lists.len()?;
    if n == 0 {
        return Ok(());
    }
    let [p, g, m, v] = lists.pointers();
    // SAFETY: every pointer is a live `at::Tensor` for the call; the lists have `n`
    // entries each.
    status(unsafe {
        vs_update_adamw_foreach(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n,
            step as f64,
            rates.lr,
            rates.beta1,
            rates.beta2,
            rates.weight_decay,
            rates.eps,
        )
    })
}

/// Multiplies every gradient by `inv_scale` (0-dim float) and sets `found_inf` (0-dim
/// float) to 1 where one of them holds an inf or a NaN.
pub fn unscale_(
    grads: &[Tensor],
    found_inf: &mut Tensor,
    inv_scale: &Tensor,
) -> Result<(), TchError> {
    if grads.is_empty() {
        return Ok(());
    }
    let ptrs = pointers(grads);
    // SAFETY: the pointers are live `at::Tensor`s for the call; `found_inf` is
    // borrowed mutably for it.
    status(unsafe {
        vs_update_unscale_(
            ptrs.as_ptr(),
            ptrs.len(),
            found_inf.as_mut_ptr() as *mut c_void,
            inv_scale.as_ptr() as *const c_void,
        )
    })
}

/// The loss scaler's update: `scale` (0-dim float) times `backoff` where `found_inf`
/// is 1, else times `growth` once `tracker` (0-dim int32) counts `interval` good
/// steps.
pub fn update_scale_(
    scale: &mut Tensor,
    tracker: &mut Tensor,
    found_inf: &Tensor,
    growth: f64,
    backoff: f64,
    interval: i64,
) -> Result<(), TchError> {
    // SAFETY: the three tensors are live for the call; the two updated in place are
    // borrowed mutably.
    status(unsafe {
        vs_update_scale_(
            scale.as_mut_ptr() as *mut c_void,
            tracker.as_mut_ptr() as *mut c_void,
            found_inf.as_ptr() as *const c_void,
            growth,
            backoff,
            interval,
        )
    })
}
