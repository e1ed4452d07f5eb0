//! Scaled dot-product attention for every attention of the model, with the kernel
//! choice made for a learned bias on CUDA.
//!
//! VRT's window attention adds a learned relative position bias (and the shift
//! mask) to the scores, so the additive mask needs a gradient. Of libtorch's fused
//! CUDA kernels, flash attention takes no mask, cuDNN's attention is reported to
//! return NaN gradients with a mask at some sequence lengths in PyTorch 2.11
//! (pytorch/pytorch#196678), and the memory-efficient kernel (xFormers' cutlass
//! kernel, Rabe & Staats 2021, "Self-attention does not need O(n^2) memory") gives
//! the bias its gradient without keeping the attention matrix. So on CUDA:
//! - cuDNN's attention is switched off for the process (once, at the first CUDA
//!   attention), so SDPA chooses the memory-efficient kernel where it can;
//! - the head dimension is zero-padded to a multiple of 8 when it is not one (stage 8
//!   of the GoPro VRT has 120 channels over 6 heads: 20), since the memory-efficient
//!   kernel needs a multiple of 8 in half precision on sm80+; zero columns add
//!   nothing to `q k^T`, the padded output columns are dropped, and the scale stays
//!   that of the true head dimension;
//! - the mask is made contiguous when its last dimension is not (VRT's bias is the
//!   table's rows permuted to (heads, L, S)): every fused CUDA kernel needs the
//!   mask's last stride to be 1 (`check_last_dim_stride_equals_1_dense` in
//!   libtorch's `sdp_utils_cpp.h`), and SDPA otherwise takes its math kernel;
//! - more than [`CUDA_MAX_BATCH`] sequences go to the kernels in slices: flash and
//!   memory-efficient attention put the batch on a CUDA grid dimension of at most
//!   65,535 blocks, and a larger batch fails the launch with "invalid argument"
//!   (the spike branch's per-pixel attention runs `MAX_BATCH_TOKENS` = 65,536
//!   sequences at once);
//! - where SDPA would still fall back to its math kernel (which keeps the attention
//!   matrix), a warning says so once per input shape.
//!
//! On CPU, attention goes to SDPA unchanged.

use std::collections::HashSet;
use std::ffi::c_int;
use std::sync::{Mutex, Once};

use tch::{Kind, TchError, Tensor};

use super::precision::{current_autocast, AutocastDevice};

/// The head dimension the memory-efficient kernel needs a multiple of (8 for
/// float16/bfloat16 on sm80+, 4 for float32: 8 serves both).
pub const CUDA_HEAD_DIM_ALIGN: i64 = 8;

/// The most sequences (batch x windows) one fused CUDA attention launch takes: the
/// flash and memory-efficient kernels put the batch on grid dimension y or z, whose
/// limit is 65,535 blocks.
pub const CUDA_MAX_BATCH: i64 = 65_535;

/// SDPA's kernel numbers (`at::SDPBackend`), as `_fused_sdp_choice` returns them.
const SDP_MATH: i64 = 0;

extern "C" {
    fn vs_sdp_use_cudnn(on: c_int) -> c_int;
}

/// Attention (B, nH, L, hd) x (B, nH, S, hd) with an optional additive mask that
/// broadcasts to (B, nH, L, S); scale hd^-0.5.
pub fn f_sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Tensor, TchError> {
    let mask = mask.map(|m| m.f_to_kind(q.kind())).transpose()?;
    if q.device().is_cuda() {
        prefer_memory_efficient_kernel();
        let mask = mask.as_ref().map(fused_kernel_mask).transpose()?;
        return f_sdpa_in_batches(q, k, v, mask.as_ref(), CUDA_MAX_BATCH, |q, k, v, m| {
            f_sdpa_aligned(q, k, v, m, CUDA_HEAD_DIM_ALIGN)
        });
    }
    Tensor::f_scaled_dot_product_attention(q, k, v, mask.as_ref(), 0.0, false, None, false)
}

/// The mask as the fused CUDA kernels take it: its last dimension contiguous. A
/// mask already so (or broadcast along that dimension) is returned as it is.
pub fn fused_kernel_mask(mask: &Tensor) -> Result<Tensor, TchError> {
    let last_is_unit = mask.stride().last().is_none_or(|&s| s == 1);
    let last_is_single = mask.size().last().is_none_or(|&n| n <= 1);
    if last_is_unit || last_is_single {
        Ok(mask.shallow_clone())
    } else {
        mask.f_contiguous()
    }
}

/// `attend` over at most `max_batch` sequences at a time, the results joined along
/// the batch: the same attention as one call. A 4-D mask with the full batch is
/// sliced with the inputs; one that broadcasts over the batch goes whole to each slice.
pub fn f_sdpa_in_batches(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    max_batch: i64,
    attend: impl Fn(&Tensor, &Tensor, &Tensor, Option<&Tensor>) -> Result<Tensor, TchError>,
) -> Result<Tensor, TchError> {
    let batch = q.size().first().copied().unwrap_or(1);
    if batch <= max_batch {
        return attend(q, k, v, mask);
    }
    let mask_has_batch = mask.is_some_and(|m| m.dim() == 4 && m.size()[0] == batch);
    let mut outs = Vec::new();
    let mut start = 0;
    while start < batch {
        let len = max_batch.min(batch - start);
        let slice = |t: &Tensor| t.f_narrow(0, start, len);
        let m = match mask {
            Some(m) if mask_has_batch => Some(slice(m)?),
            Some(m) => Some(m.shallow_clone()),
            None => None,
        };
        outs.push(attend(&slice(q)?, &slice(k)?, &slice(v)?, m.as_ref())?);
        start += len;
    }
    Tensor::f_cat(&outs, 0)
}

/// SDPA with the head dimension zero-padded to a multiple of `align` (the scale
/// stays that of the true head dimension) and the output cut back to it; on CUDA
/// it reports once per shape when SDPA would fall back to its math kernel.
pub fn f_sdpa_aligned(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    align: i64,
) -> Result<Tensor, TchError> {
    let head_dim = *q.size().last().unwrap_or(&1);
    let scale = (head_dim.max(1) as f64).powf(-0.5);
    let pad = (align - head_dim % align) % align;
    let padded = |t: &Tensor| -> Result<Tensor, TchError> {
        if pad == 0 {
            Ok(t.shallow_clone())
        } else {
            t.f_constant_pad_nd([0, pad])
        }
    };
    let (q, k, v) = (padded(q)?, padded(k)?, padded(v)?);
    if q.device().is_cuda() {
        report_math_fallback(&q, &k, &v, mask, scale)?;
    }
    let out = Tensor::f_scaled_dot_product_attention(&q, &k, &v, mask, 0.0, false, scale, false)?;
    if pad == 0 {
        Ok(out)
    } else {
        out.f_narrow(-1, 0, head_dim)
    }
}

/// Switches cuDNN's attention kernel off for the process, once.
fn prefer_memory_efficient_kernel() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a plain int argument; the shim catches every C++ exception.
        let was = unsafe { vs_sdp_use_cudnn(0) };
        if was < 0 {
            tracing::warn!("attention: libtorch refused to switch cuDNN's attention kernel off");
        } else {
            tracing::debug!(
                "attention: cuDNN's kernel off; SDPA prefers the memory-efficient kernel"
            );
        }
    });
}

/// The dtype SDPA computes in on this thread: the CUDA autocast dtype when autocast
/// is on (SDPA is on its lower-precision list), else the inputs' own.
fn compute_kind(input: Kind) -> Kind {
    current_autocast(AutocastDevice::Cuda).map_or(input, |dtype| dtype.kind())
}

/// Warns once per input shape when SDPA would choose its math kernel for these
/// inputs. The choice is asked of libtorch on one-sample views cast to the compute
/// dtype, with the inputs' `requires_grad`, so it costs a few small copies the first
/// time a shape is seen.
fn report_math_fallback(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<(), TchError> {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let kind = compute_kind(q.kind());
    let key = format!(
        "{:?} {:?} {:?} {kind:?} mask {:?} grad {}",
        q.size(),
        k.size(),
        v.size(),
        mask.map(Tensor::size),
        q.requires_grad() || mask.is_some_and(Tensor::requires_grad)
    );
    {
        let mut seen = SEEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !seen.get_or_insert_with(HashSet::new).insert(key.clone()) {
            return Ok(());
        }
    }
    let probe = |t: &Tensor| -> Result<Tensor, TchError> {
        let one = t.f_narrow(0, 0, 1)?.f_to_kind(kind)?.f_detach()?;
        one.f_set_requires_grad(t.requires_grad())
    };
    let mask_probe = match mask {
        Some(m) if m.size().first().is_some_and(|&n| n > 1) => Some(probe(m)?),
        Some(m) => Some(
            m.f_to_kind(kind)?
                .f_detach()?
                .f_set_requires_grad(m.requires_grad())?,
        ),
        None => None,
    };
    let choice = Tensor::f_internal_fused_sdp_choice(
        &probe(q)?,
        &probe(k)?,
        &probe(v)?,
        mask_probe.as_ref(),
        0.0,
        false,
        scale,
        false,
    )?;
    if choice == SDP_MATH {
        tracing::warn!(
            "attention {key}: no fused CUDA kernel takes these inputs; SDPA falls back to \
             its math kernel, which keeps the attention matrix (said once per shape)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn manual_attention(q: &Tensor, k: &Tensor, v: &Tensor, add: Option<&Tensor>) -> Tensor {
        let scale = (q.size()[3] as f64).powf(-0.5);
        let mut attn = (q * scale).matmul(&k.transpose(-2, -1));
        if let Some(add) = add {
            attn += add;
        }
        attn.softmax(-1, q.kind()).matmul(v)
    }

    #[test]
    fn sdpa_matches_explicit_softmax_with_masks() {
        let opts = (Kind::Float, Device::Cpu);
        let (q, k, v) = (
            Tensor::randn([6, 2, 8, 4], opts),
            Tensor::randn([6, 2, 8, 4], opts),
            Tensor::randn([6, 2, 8, 4], opts),
        );
        let mask = Tensor::randn([3, 1, 8, 8], opts).repeat([2, 2, 1, 1]);
        let got = f_sdpa(&q, &k, &v, Some(&mask)).unwrap();
        assert!(got.allclose(
            &manual_attention(&q, &k, &v, Some(&mask)),
            1e-5,
            1e-5,
            false
        ));
    }

    /// VRT's relative position bias is the table's rows permuted to (heads, L, S): its
    /// last stride is the head count, which sends every CUDA attention to the math
    /// kernel (seen on an H100). The mask the fused kernels get is contiguous there.
    #[test]
    fn a_permuted_bias_reaches_the_fused_kernels_with_a_unit_last_stride() {
        let (heads, n) = (6, 16);
        let bias = Tensor::randn([n, n, heads], (Kind::Float, Device::Cpu)).permute([2, 0, 1]);
        assert_ne!(bias.stride().last(), Some(&1), "the case under test");
        let fused = fused_kernel_mask(&bias.unsqueeze(0)).unwrap();
        assert_eq!(fused.stride().last(), Some(&1));
        assert!(fused.equal(&bias.unsqueeze(0)));
        // A mask already right, or broadcast along its last dimension, is not copied.
        let expanded = Tensor::randn([1, heads, n, 1], (Kind::Float, Device::Cpu))
            .expand([2, heads, n, 1], false);
        let same = fused_kernel_mask(&expanded).unwrap();
        assert_eq!(same.data_ptr(), expanded.data_ptr());
        let contiguous = bias.contiguous();
        assert_eq!(
            fused_kernel_mask(&contiguous).unwrap().data_ptr(),
            contiguous.data_ptr()
        );
    }

    /// More sequences than one kernel launch takes (the spike branch's 65,536 on a
    /// GPU, whose grid stops at 65,535) go in slices that compute the same attention,
    /// with a per-sequence mask, a broadcast mask and none.
    #[test]
    fn attention_in_batch_slices_equals_one_call() {
        let opts = (Kind::Double, Device::Cpu);
        let (q, k, v) = (
            Tensor::randn([7, 2, 5, 4], opts),
            Tensor::randn([7, 2, 6, 4], opts),
            Tensor::randn([7, 2, 6, 4], opts),
        );
        let per_sequence = Tensor::randn([7, 2, 5, 6], opts);
        let broadcast = Tensor::randn([1, 2, 5, 6], opts);
        let calls = std::cell::Cell::new(0);
        let attend = |q: &Tensor, k: &Tensor, v: &Tensor, m: Option<&Tensor>| {
            calls.set(calls.get() + 1);
            assert!(q.size()[0] <= 3, "a slice over the limit");
            Tensor::f_scaled_dot_product_attention(q, k, v, m, 0.0, false, None, false)
        };
        for mask in [Some(&per_sequence), Some(&broadcast), None] {
            calls.set(0);
            let whole =
                Tensor::f_scaled_dot_product_attention(&q, &k, &v, mask, 0.0, false, None, false)
                    .unwrap();
            let sliced = f_sdpa_in_batches(&q, &k, &v, mask, 3, attend).unwrap();
            assert_eq!(calls.get(), 3, "7 sequences in slices of 3");
            assert!(sliced.allclose(&whole, 1e-12, 1e-12, false));
        }
    }

    /// The padded path (what CUDA runs for stage 8's 20-channel heads) computes the
    /// same attention and the same gradients, the learned bias's included.
    #[test]
    fn padding_the_head_dimension_changes_nothing_but_the_kernel() {
        let opts = (Kind::Double, Device::Cpu);
        let leaf = |shape: [i64; 4]| Tensor::randn(shape, opts).set_requires_grad(true);
        let (q, k, v) = (
            leaf([4, 3, 16, 20]),
            leaf([4, 3, 16, 20]),
            leaf([4, 3, 16, 20]),
        );
        let bias = leaf([1, 3, 16, 16]);
        let grads = |out: Tensor| -> Vec<Tensor> {
            let weights = Tensor::linspace(-1.0, 1.0, out.numel() as i64, opts).view_as(&out);
            let loss = (out * weights).sum(Kind::Double);
            Tensor::run_backward(&[loss], &[&q, &k, &v, &bias], false, false)
        };
        let plain = f_sdpa_aligned(&q, &k, &v, Some(&bias), 1).unwrap();
        let padded = f_sdpa_aligned(&q, &k, &v, Some(&bias), CUDA_HEAD_DIM_ALIGN).unwrap();
        assert_eq!(padded.size(), vec![4, 3, 16, 20]);
        assert!(padded.allclose(&plain, 1e-12, 1e-12, false));
        assert!(plain.allclose(
            &manual_attention(&q, &k, &v, Some(&bias)),
            1e-10,
            1e-10,
            false
        ));
        let (g_plain, g_padded) = (grads(plain), grads(padded));
        for (name, (a, b)) in ["q", "k", "v", "bias"]
            .iter()
            .zip(g_plain.iter().zip(&g_padded))
        {
            assert!(
                a.allclose(b, 1e-12, 1e-12, false),
                "gradient of {name} differs"
            );
            assert!(
                a.abs().sum(Kind::Double).double_value(&[]) > 0.0,
                "{name} got no gradient"
            );
        }
    }
}
