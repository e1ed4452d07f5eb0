//! Window attention with a learned bias on CUDA: at stage 8's shape of the GoPro VRT
//! (6 heads of 20 channels over 6x8x8 windows) under bf16 autocast, SDPA takes the
//! memory-efficient kernel once the head dimension is padded, and its output and
//! gradients (the bias's included) match a float64 reference.

use tch::{Device, Kind, Tensor};
use vrtspike::model::precision::{cuda_autocast, AutocastDtype};
use vrtspike::model::sdp::{f_sdpa, fused_kernel_mask, CUDA_HEAD_DIM_ALIGN};

use super::cuda;

/// SDPA's number for the memory-efficient kernel (`at::SDPBackend`).
const SDP_EFFICIENT: i64 = 2;

fn reference(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Tensor {
    let scale = (q.size()[3] as f64).powf(-0.5);
    ((q * scale).matmul(&k.transpose(-2, -1)) + mask)
        .softmax(-1, Kind::Double)
        .matmul(v)
}

fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_device(Device::Cpu).to_kind(Kind::Double);
    let b = b.to_device(Device::Cpu).to_kind(Kind::Double);
    (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

#[test]
fn a_learned_bias_gets_the_memory_efficient_kernel_and_right_gradients() {
    let device = cuda();
    let (windows, heads, tokens, head_dim) = (8, 6, 384, 20);
    tch::manual_seed(5);
    let leaf = |shape: &[i64], scale: f64| {
        (Tensor::randn(shape, (Kind::Double, Device::Cpu)) * scale).set_requires_grad(true)
    };
    let q = leaf(&[windows, heads, tokens, head_dim], 1.0);
    let k = leaf(&[windows, heads, tokens, head_dim], 1.0);
    let v = leaf(&[windows, heads, tokens, head_dim], 1.0);
    let bias = leaf(&[1, heads, tokens, tokens], 0.5);
    let shift =
        Tensor::randint(2, [windows, 1, tokens, tokens], (Kind::Double, Device::Cpu)) * -100.0;

    let on_gpu = |t: &Tensor| {
        t.detach()
            .to_kind(Kind::Float)
            .to_device(device)
            .set_requires_grad(true)
    };
    let (gq, gk, gv, gbias) = (on_gpu(&q), on_gpu(&k), on_gpu(&v), on_gpu(&bias));
    let gshift = shift.to_kind(Kind::Float).to_device(device);
    let out = cuda_autocast(AutocastDtype::Bf16, || {
        let mask = &gbias + &gshift;
        f_sdpa(&gq, &gk, &gv, Some(&mask)).expect("attention")
    });
    let expected = reference(&q, &k, &v, &(&bias + &shift));
    assert!(
        relative(&out, &expected) < 2e-2,
        "output off by {}",
        relative(&out, &expected)
    );

    let weights = Tensor::randn(expected.size(), (Kind::Double, Device::Cpu));
    (&out.to_kind(Kind::Float) * weights.to_kind(Kind::Float).to_device(device))
        .sum(Kind::Float)
        .backward();
    (&expected * &weights).sum(Kind::Double).backward();
    for (name, got, want) in [
        ("q", &gq, &q),
        ("k", &gk, &k),
        ("v", &gv, &v),
        ("bias", &gbias, &bias),
    ] {
        let (got, want) = (got.grad(), want.grad());
        assert_eq!(
            got.isfinite().all().int64_value(&[]),
            1,
            "{name}: NaN/inf gradient"
        );
        let err = relative(&got, &want);
        assert!(err < 5e-2, "{name}: gradient off by {err} (relative)");
    }

    // The kernel SDPA chooses for the padded bf16 inputs (cuDNN's is off by now).
    let padded = |t: &Tensor, grad: bool| {
        t.detach()
            .to_kind(Kind::BFloat16)
            .to_device(device)
            .constant_pad_nd([0, CUDA_HEAD_DIM_ALIGN - head_dim % CUDA_HEAD_DIM_ALIGN])
            .set_requires_grad(grad)
    };
    let mask = (&bias + &shift)
        .detach()
        .to_kind(Kind::BFloat16)
        .to_device(device)
        .set_requires_grad(true);
    let choice = Tensor::internal_fused_sdp_choice(
        &padded(&q, true),
        &padded(&k, true),
        &padded(&v, true),
        Some(&mask),
        0.0,
        false,
        (head_dim as f64).powf(-0.5),
        false,
    );
    assert_eq!(
        choice, SDP_EFFICIENT,
        "SDPA chose kernel {choice}, not the memory-efficient one"
    );
    let raw = |t: &Tensor| {
        t.detach()
            .to_kind(Kind::BFloat16)
            .to_device(device)
            .set_requires_grad(true)
    };
    let unpadded = Tensor::internal_fused_sdp_choice(
        &raw(&q),
        &raw(&k),
        &raw(&v),
        Some(&mask),
        0.0,
        false,
        None,
        false,
    );
    eprintln!("SDPA's choice at head dim {head_dim}: {unpadded}; padded to a multiple of {CUDA_HEAD_DIM_ALIGN}: {choice} (0 math, 2 memory-efficient)");
}

/// The spike branch's per-pixel attention runs 65,536 sequences at once; the fused
/// kernels' grid takes at most 65,535 (the baseline VRT-Spike failed its first
/// forward with "CUDA error: invalid argument" from flash attention). Over the
/// limit, attention goes in slices and still matches the CPU.
#[test]
fn more_sequences_than_one_launch_takes_match_the_cpu() {
    let device = cuda();
    let (batch, heads, tokens, head_dim) = (70_000, 4, 6, 16);
    tch::manual_seed(9);
    let make = || Tensor::randn([batch, heads, tokens, head_dim], (Kind::Float, Device::Cpu));
    let (q, k, v) = (make(), make(), make());
    let on_cpu = f_sdpa(&q, &k, &v, None).expect("CPU attention");
    let on_gpu = f_sdpa(
        &q.to_device(device),
        &k.to_device(device),
        &v.to_device(device),
        None,
    )
    .expect("CUDA attention over 65,535 sequences");
    tch::Cuda::synchronize(0);
    let err = relative(&on_gpu, &on_cpu);
    assert!(err < 1e-3, "CUDA attention off by {err} (relative)");
}

/// VRT's relative position bias is a permuted view (last stride = heads); as SDPA's
/// mask it sent every window attention of the GoPro VRT to the math kernel on an
/// H100. The mask f_sdpa hands the kernels gets the memory-efficient one.
#[test]
fn a_permuted_bias_gets_the_memory_efficient_kernel() {
    let device = cuda();
    let (windows, heads, tokens, head_dim) = (16, 6, 128, 16);
    let opts = (Kind::BFloat16, device);
    let input = || Tensor::randn([windows, heads, tokens, head_dim], opts);
    let bias = Tensor::randn([tokens, tokens, heads], opts)
        .permute([2, 0, 1])
        .unsqueeze(0)
        .set_requires_grad(true);
    let choice = |mask: &Tensor| {
        Tensor::internal_fused_sdp_choice(
            &input().set_requires_grad(true),
            &input().set_requires_grad(true),
            &input().set_requires_grad(true),
            Some(mask),
            0.0,
            false,
            None,
            false,
        )
    };
    let raw = choice(&bias);
    let fused = choice(&fused_kernel_mask(&bias).expect("mask"));
    eprintln!("SDPA's choice for a permuted bias: {raw}; made contiguous: {fused}");
    assert_eq!(fused, SDP_EFFICIENT, "not the memory-efficient kernel");
}
