//! VRT fidelity and behaviour: the published GoPro config has the reference's exact
//! parameter and state_dict counts; a tiny VRT-Spike runs forward and backward with a
//! gradient for every parameter, and under bf16 autocast keeps the gradients that
//! steer its sampling positions; weights round-trip through safetensors strictly.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use tch::{nn, Device, Kind, Tensor};
use vrtspike::config::{ChunkShape, Config, ModelConfig};
use vrtspike::model::precision::{cpu_autocast, AutocastDtype};
use vrtspike::model::{self, load_safetensors, save_safetensors, summarize, Restorer, Vrt};

fn config(path: &str) -> ModelConfig {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Config::load(&root.join(path)).unwrap().model
}

fn tiny(spike: bool) -> ModelConfig {
    let mut cfg = config("configs/tiny/vrt_spike_tiny.yaml");
    cfg.spike.enabled = spike;
    cfg
}

fn inputs(frames: i64, side: i64) -> (Tensor, Tensor) {
    let blur = Tensor::rand([1, frames, 3, side, side], (Kind::Float, Device::Cpu));
    let voxels = Tensor::rand(
        [1, frames, 4, side / 2, side / 2],
        (Kind::Float, Device::Cpu),
    );
    (blur, voxels)
}

/// One test of this file at a time: they seed libtorch's one global generator
/// (`tch::manual_seed`) and draw their weights from it, so two running at once
/// take each other's numbers and a test's weights change from run to run. The
/// bf16 test's bound holds for its own seed's weights (about 1% off); with weights
/// raced by another test it once read 14% on a clean clone.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn gopro_config_has_the_reference_counts() {
    let _serial = serial();
    let cfg = config("configs/deblur/vrt_gopro_deblur.yaml");
    let vs = nn::VarStore::new(Device::Cpu);
    let net = Vrt::new(&vs.root(), &cfg).unwrap();
    let summary = summarize(&vs, "vrt_spike", &net.parts());
    assert_eq!(summary.total_params, 18_320_007);
    assert_eq!(summary.entries, 1_526);
    assert_eq!(summary.buffers, 116);
    let spynet = summary.parts.iter().find(|p| p.prefix == "spynet").unwrap();
    assert_eq!(spynet.params, 1_440_300);
    assert!(summary.parts.iter().all(|p| p.label != "other"));
    // Spot checks of reference keys and shapes.
    let vars = vs.variables();
    let shape = |k: &str| vars.get(k).unwrap_or_else(|| panic!("missing {k}")).size();
    assert_eq!(shape("conv_first.weight"), vec![96, 27, 1, 3, 3]);
    assert_eq!(shape("spynet.mean"), vec![1, 3, 1, 1]);
    assert_eq!(
        shape("spynet.basic_module.5.basic_module.8.weight"),
        vec![2, 16, 7, 7]
    );
    assert_eq!(shape("stage2.reshape.1.weight"), vec![384]);
    assert_eq!(shape("stage5.reshape.2.weight"), vec![96, 24]);
    assert_eq!(
        shape("stage1.residual_group1.blocks.5.attn.position_bias"),
        vec![1, 64, 96]
    );
    assert_eq!(
        shape("stage1.residual_group1.blocks.0.attn.relative_position_index"),
        vec![128, 128]
    );
    assert_eq!(
        shape("stage1.residual_group2.blocks.1.attn.relative_position_bias_table"),
        vec![2475, 6]
    );
    assert_eq!(
        shape("stage3.pa_deform.conv_offset.6.weight"),
        vec![432, 96, 3, 3]
    );
    assert_eq!(shape("stage3.pa_fuse.fc11.weight"), vec![288, 288]);
    assert_eq!(shape("stage8.0.2.weight"), vec![120, 96]);
    assert_eq!(
        shape("stage8.3.residual_group.blocks.3.attn.relative_position_bias_table"),
        vec![225, 6]
    );
    assert_eq!(
        shape("stage8.1.residual_group.blocks.0.attn.relative_position_bias_table"),
        vec![2475, 6]
    );
    assert_eq!(shape("conv_after_body.weight"), vec![96, 120]);
    assert_eq!(
        vars["stage1.residual_group1.blocks.0.attn.relative_position_index"].kind(),
        Kind::Int64
    );
}

#[test]
fn spike_off_is_plain_vrt_and_spike_on_only_adds_its_branch() {
    let _serial = serial();
    let plain = nn::VarStore::new(Device::Cpu);
    model::build(&plain.root(), &tiny(false)).unwrap();
    let spiky = nn::VarStore::new(Device::Cpu);
    model::build(&spiky.root(), &tiny(true)).unwrap();
    let plain_vars = plain.variables();
    let spiky_vars = spiky.variables();
    for (k, v) in &plain_vars {
        assert_eq!(spiky_vars[k].size(), v.size(), "{k}");
    }
    let extra: Vec<_> = spiky_vars
        .keys()
        .filter(|k| !plain_vars.contains_key(*k))
        .collect();
    assert!(!extra.is_empty());
    for k in extra {
        assert!(
            k.starts_with("spike_encoder.")
                || k.starts_with("spike_tsa.")
                || k.starts_with("fuse."),
            "{k}"
        );
    }
    assert!(!plain_vars
        .keys()
        .any(|k| k.contains("spike") || k.starts_with("fuse.")));
}

#[test]
fn tiny_vrt_spike_forward_backward_reaches_every_parameter() {
    let _serial = serial();
    tch::manual_seed(1);
    let vs = nn::VarStore::new(Device::Cpu);
    // No stochastic depth: with one sample a dropped block would get no gradient.
    let mut cfg = tiny(true);
    cfg.drop_path_rate = 0.0;
    let net = model::build(&vs.root(), &cfg).unwrap();
    assert!(net.uses_voxels());
    let (blur, voxels) = inputs(3, 32);
    let start = std::time::Instant::now();
    let out = net.forward(&blur, Some(&voxels), true).unwrap();
    let forward = start.elapsed();
    assert_eq!(out.size(), vec![1, 3, 3, 32, 32]);
    (out - &blur).square().mean(Kind::Float).backward();
    eprintln!("tiny VRT-Spike forward (train) on 1x3x3x32x32: {forward:?}");
    let mut zero = Vec::new();
    for (name, t) in vs.variables() {
        if !t.requires_grad() {
            continue;
        }
        let grad = t.grad();
        assert!(grad.defined(), "{name} got no gradient");
        assert!(grad.isfinite().all().int64_value(&[]) == 1, "{name}");
        if grad.abs().sum(Kind::Float).double_value(&[]) == 0.0 {
            zero.push(name);
        }
    }
    // Only the offset convs before the zero-initialised last one have a zero gradient
    // at initialisation (as in the reference); everything else learns from step one.
    for name in &zero {
        let ok = name.contains("pa_deform.conv_offset.0")
            || name.contains("pa_deform.conv_offset.2")
            || name.contains("pa_deform.conv_offset.4");
        assert!(ok, "{name} has an all-zero gradient");
    }
}

#[test]
fn chunk_size_changes_memory_not_the_result() {
    let _serial = serial();
    tch::manual_seed(2);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut net = Vrt::new(&vs.root(), &tiny(true)).unwrap();
    let (blur, voxels) = inputs(2, 32);
    let run = |net: &Vrt| tch::no_grad(|| net.forward(&blur, Some(&voxels), false).unwrap());
    let mut chunks = tiny(true).fuse;
    chunks.adaptive_chunk = false;
    chunks.chunk_size = 1024; // one chunk per map
    net.set_chunks(chunks.clone());
    let whole = run(&net);
    chunks.chunk_size = 3; // ragged 3 x 3 tiles
    net.set_chunks(chunks.clone());
    let tiles = run(&net);
    chunks.chunk_shape = ChunkShape::Row;
    chunks.chunk_size = 5;
    net.set_chunks(chunks.clone());
    let rows = run(&net);
    chunks.adaptive_chunk = true;
    chunks.max_batch_tokens = 7;
    net.set_chunks(chunks);
    let adaptive = run(&net);
    for other in [&tiles, &rows, &adaptive] {
        let diff = (other - &whole).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "chunked output differs by {diff}");
    }
}

#[test]
fn weights_round_trip_and_strict_checks_name_the_key() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("w.safetensors");
    tch::manual_seed(3);
    let a = nn::VarStore::new(Device::Cpu);
    let net_a = model::build(&a.root(), &tiny(false)).unwrap();
    let saved = save_safetensors(&a, &file).unwrap();
    assert_eq!(saved, a.variables().len());
    tch::manual_seed(4);
    let b = nn::VarStore::new(Device::Cpu);
    let net_b = model::build(&b.root(), &tiny(false)).unwrap();
    let (blur, _) = inputs(2, 32);
    let out_a = tch::no_grad(|| net_a.forward(&blur, None, false).unwrap());
    let before = tch::no_grad(|| net_b.forward(&blur, None, false).unwrap());
    assert!(!before.allclose(&out_a, 1e-6, 1e-6, false));
    load_safetensors(&b, &file).unwrap();
    let after = tch::no_grad(|| net_b.forward(&blur, None, false).unwrap());
    assert!(after.equal(&out_a));

    // A wrong shape names its key.
    let mut named: Vec<(String, Tensor)> = Tensor::read_safetensors(&file).unwrap();
    let bad = "stage2.linear1.weight";
    for (k, t) in named.iter_mut() {
        if k == bad {
            *t = Tensor::zeros([3, 3], (Kind::Float, Device::Cpu));
        }
    }
    let bad_file = dir.path().join("bad.safetensors");
    Tensor::write_safetensors(&named, &bad_file).unwrap();
    let err = load_safetensors(&b, &bad_file).unwrap_err().to_string();
    assert!(
        err.contains(bad) && err.contains("[3, 3]") && err.contains("bad.safetensors"),
        "{err}"
    );
    // A missing key names its key.
    named.retain(|(k, _)| k != "conv_last.bias");
    let missing = dir.path().join("missing.safetensors");
    Tensor::write_safetensors(&named, &missing).unwrap();
    let err = load_safetensors(&b, &missing).unwrap_err().to_string();
    assert!(
        err.contains("conv_last.bias") && err.contains("missing"),
        "{err}"
    );
    // An extra key is an error too (strict).
    let spiky = nn::VarStore::new(Device::Cpu);
    model::build(&spiky.root(), &tiny(true)).unwrap();
    let spiky_file = dir.path().join("spiky.safetensors");
    save_safetensors(&spiky, &spiky_file).unwrap();
    let err = load_safetensors(&b, &spiky_file).unwrap_err().to_string();
    assert!(err.contains("not in the model"), "{err}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let _serial = serial();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model::build(&vs.root(), &tiny(true)).unwrap();
    let (blur, voxels) = inputs(2, 32);
    let err = net.forward(&blur, None, false).unwrap_err().to_string();
    assert!(err.contains("voxels"), "{err}");
    let odd = Tensor::rand([1, 2, 3, 30, 32], (Kind::Float, Device::Cpu));
    assert!(net.forward(&odd, Some(&voxels), false).is_err());
    let one_frame = Tensor::rand([1, 1, 3, 32, 32], (Kind::Float, Device::Cpu));
    assert!(net.forward(&one_frame, Some(&voxels), false).is_err());
    let wrong_bins = Tensor::rand([1, 2, 5, 16, 16], (Kind::Float, Device::Cpu));
    assert!(net
        .forward(&blur, Some(&wrong_bins), false)
        .unwrap_err()
        .to_string()
        .contains("K=4"));
}

/// Loss and every trainable gradient (sorted by name) of one forward/backward pass
/// of the tiny VRT-Spike, under CPU bf16 autocast or not.
fn tiny_gradients(
    vs: &nn::VarStore,
    net: &dyn model::Restorer,
    bf16: bool,
) -> Vec<(String, Tensor)> {
    tch::manual_seed(3);
    let blur = Tensor::rand([1, 3, 3, 64, 64], (Kind::Float, Device::Cpu));
    let voxels = Tensor::rand([1, 3, 4, 32, 32], (Kind::Float, Device::Cpu));
    for t in vs.trainable_variables() {
        let mut g = t.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let forward = || net.forward(&blur, Some(&voxels), true);
    let out = match bf16 {
        true => cpu_autocast(AutocastDtype::Bf16, forward),
        false => forward(),
    }
    .unwrap();
    (out.to_kind(Kind::Float) - &blur)
        .abs()
        .mean(Kind::Float)
        .backward();
    let mut grads: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(name, t)| (name, t.grad().copy()))
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    grads
}

/// The GPU suite's bf16-vs-fp32 test flipped on an H100 on stage 7's last offset
/// convolution (59% off). The cause, reproduced here under the CPU's bf16 autocast:
/// the flow warp's and the deformable convolution's sampling positions were
/// computed in the flow's and offsets' dtype, bfloat16 under autocast, which keeps
/// 8 significant bits (a position of 40.3 pixels moved by up to 1/8 pixel), so the
/// gradient reaching the offsets and SpyNet through the sampling came from the wrong
/// place. Before the fix (positions in bfloat16): the sampling-position gradients
/// together 77% off, stage 7's `conv_offset.6` 71-75%; after (float32 positions):
/// about 1% together and at most 7% for any of those tensors.
#[test]
fn bf16_autocast_keeps_the_sampling_position_gradients() {
    let _serial = serial();
    tch::manual_seed(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut cfg = tiny(true);
    cfg.drop_path_rate = 0.0;
    let net = model::build(&vs.root(), &cfg).unwrap();
    let (g32, g16) = (
        tiny_gradients(&vs, net.as_ref(), false),
        tiny_gradients(&vs, net.as_ref(), true),
    );
    let steers = |name: &str| name.starts_with("spynet.") || name.contains(".conv_offset.");
    let (mut a, mut b, mut worst) = (Vec::new(), Vec::new(), (0.0f64, String::new()));
    for ((name, x), (other, y)) in g32.iter().zip(&g16) {
        assert_eq!(name, other);
        if !steers(name) {
            continue;
        }
        a.push(x.flatten(0, -1));
        b.push(y.flatten(0, -1));
        let norm = x.norm().double_value(&[]);
        if norm > 1e-6 {
            let error = (y - x).norm().double_value(&[]) / norm;
            if error > worst.0 {
                worst = (error, name.clone());
            }
        }
    }
    assert!(a.len() > 60, "{} sampling-position gradients", a.len());
    let (a, b) = (Tensor::cat(&a, 0), Tensor::cat(&b, 0));
    let together = (&b - &a).norm().double_value(&[]) / a.norm().double_value(&[]);
    assert!(
        together < 0.1,
        "the sampling-position gradients are off by {together:.3} under bf16"
    );
    assert!(
        worst.0 < 0.25,
        "{}: bf16 gradient off by {:.3} (relative)",
        worst.1,
        worst.0
    );
}
