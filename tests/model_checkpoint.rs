//! Activation checkpointing (`MODEL.USE_CHECKPOINT_ATTN` / `USE_CHECKPOINT_FFN`): the
//! gradients of the inputs and of every parameter equal those without checkpointing
//! (drop path on, seeded) for a TMSA group, the spike branch's TSA and FUSE and a tiny
//! VRT-Spike; a closure that fails or panics, in the forward or in the backward pass,
//! is an error and the process goes on.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tch::{nn, Device, Kind, Tensor};
use vrtspike::config::{Config, ModelConfig};
use vrtspike::model::attention::{GroupSpec, Tmsag};
use vrtspike::model::checkpoint::{checkpoint, checkpoint_one, Checkpointing};
use vrtspike::model::spike::SpikeBranch;
use vrtspike::model::window::MaskCache;
use vrtspike::model::{ModelError, Restorer, Vrt};

/// The global RNG is shared by the test threads: seeded runs take turns.
static RNG: Mutex<()> = Mutex::new(());

const BOTH: Checkpointing = Checkpointing {
    attn: true,
    ffn: true,
};

fn tiny() -> ModelConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny/vrt_spike_tiny.yaml");
    Config::load(&path).unwrap().model
}

fn with_flags(mut cfg: ModelConfig, flags: Checkpointing) -> ModelConfig {
    cfg.use_checkpoint_attn = flags.attn;
    cfg.use_checkpoint_ffn = flags.ffn;
    cfg
}

/// A deterministic loss weight for `out` (no RNG, so both runs draw alike).
fn loss_of(out: &Tensor) -> Tensor {
    let weights = Tensor::arange(out.numel() as i64, (out.kind(), Device::Cpu))
        .sin()
        .reshape(out.size());
    (out * weights).sum(Kind::Float)
}

/// Gradients, by name, of every variable of `vs` and of `inputs` after one seeded
/// forward (`forward`) and backward pass.
fn gradients<M>(
    vs: &nn::VarStore,
    model: &M,
    inputs: &[Tensor],
    forward: &dyn Fn(&M, &[Tensor]) -> Tensor,
) -> BTreeMap<String, Tensor> {
    let inputs: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.detach().copy().set_requires_grad(true))
        .collect();
    tch::manual_seed(11);
    loss_of(&forward(model, &inputs)).backward();
    let mut out: BTreeMap<String, Tensor> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(name, t)| (name, grad_of(&t)))
        .collect();
    for (i, t) in inputs.iter().enumerate() {
        out.insert(format!("input {i}"), grad_of(t));
    }
    out
}

/// A copy of the gradient of `t` (undefined when it has none).
fn grad_of(t: &Tensor) -> Tensor {
    let g = t.grad();
    if g.defined() {
        g.copy()
    } else {
        g
    }
}

/// Builds the model twice (without and with `flags`, same weights, both of `kind`),
/// runs both and asserts equal gradients within 1e-5 of each gradient's largest
/// magnitude.
fn assert_same_gradients<M>(
    build: &dyn Fn(&nn::Path, Checkpointing) -> M,
    flags: Checkpointing,
    kind: Kind,
    inputs: &[Tensor],
    forward: &dyn Fn(&M, &[Tensor]) -> Tensor,
) {
    let _turn = RNG.lock().unwrap_or_else(|p| p.into_inner());
    let mut vs_off = nn::VarStore::new(Device::Cpu);
    let off = build(&vs_off.root(), Checkpointing::default());
    let mut vs_on = nn::VarStore::new(Device::Cpu);
    let on = build(&vs_on.root(), flags);
    if kind == Kind::Double {
        vs_off.double();
        vs_on.double();
    }
    vs_on.copy(&vs_off).unwrap();
    let inputs: Vec<Tensor> = inputs.iter().map(|t| t.to_kind(kind)).collect();
    let inputs = inputs.as_slice();
    let want = gradients(&vs_off, &off, inputs, forward);
    let got = gradients(&vs_on, &on, inputs, forward);
    assert_eq!(want.len(), got.len());
    let mut nonzero = 0;
    for (name, w) in &want {
        let g = &got[name];
        assert_eq!(
            g.defined(),
            w.defined(),
            "{name}: gradient defined in one run only"
        );
        if !w.defined() {
            continue;
        }
        let scale = w.abs().max().double_value(&[]);
        let diff = (g - w).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-5 * scale.max(1e-20),
            "{name}: max difference {diff:e} over max gradient {scale:e}"
        );
        nonzero += usize::from(scale > 0.0);
    }
    // Every input and most parameters get a gradient (a test that cannot pass vacuously).
    assert!(
        nonzero * 10 >= want.len() * 9,
        "{nonzero} of {}",
        want.len()
    );
    for i in 0..inputs.len() {
        let g = &want[&format!("input {i}")];
        assert!(
            g.defined() && g.abs().max().double_value(&[]) > 0.0,
            "input {i}"
        );
    }
}

fn group_spec(flags: Checkpointing) -> GroupSpec {
    GroupSpec {
        dim: 16,
        depth: 2,
        heads: 2,
        window: [2, 4, 4],
        mutual: true,
        mlp_ratio: 2.0,
        qkv_bias: true,
        drop_path: vec![0.3, 0.3],
        checkpointing: flags,
    }
}

#[test]
fn tmsa_blocks_give_the_same_gradients_with_drop_path() {
    let build = |p: &nn::Path, flags: Checkpointing| {
        Tmsag::new(
            &(p / "g"),
            &group_spec(flags),
            Arc::new(MaskCache::default()),
        )
    };
    let forward = |g: &Tmsag, x: &[Tensor]| g.forward(&x[0], true).unwrap();
    // Odd sizes: padding, and the shifted second block's masks.
    let x = Tensor::randn([4, 4, 6, 10, 16], (Kind::Float, Device::Cpu));
    for flags in [
        BOTH,
        Checkpointing {
            attn: true,
            ffn: false,
        },
        Checkpointing {
            attn: false,
            ffn: true,
        },
    ] {
        assert_same_gradients(
            &build,
            flags,
            Kind::Float,
            std::slice::from_ref(&x),
            &forward,
        );
    }
    // Drop path is really on: training differs from evaluation.
    let vs = nn::VarStore::new(Device::Cpu);
    let group = build(&vs.root(), BOTH);
    let _turn = RNG.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(11);
    let train = group.forward(&x, true).unwrap();
    let eval = tch::no_grad(|| group.forward(&x, false)).unwrap();
    assert!(!train.allclose(&eval, 1e-4, 1e-4, false));
}

#[test]
fn spike_tsa_and_fuse_give_the_same_gradients() {
    let build = |p: &nn::Path, flags: Checkpointing| {
        let mut cfg = with_flags(tiny(), flags);
        // Several chunks per map.
        cfg.fuse.max_batch_tokens = 24;
        SpikeBranch::new(p, &cfg).unwrap()
    };
    let rgb = [1, 3, 3, 16, 16];
    let forward = |branch: &SpikeBranch, t: &[Tensor]| {
        let feats = branch.encode(&t[0], &rgb, true).unwrap();
        let fused: Vec<Tensor> = feats
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let x = t[1].narrow(1, 0, f.size()[1]);
                let x = x.upsample_nearest3d(&f.size()[2..], None, None, None);
                branch.fuse(i, &x, f).unwrap().reshape([-1])
            })
            .collect();
        Tensor::cat(&fused, 0)
    };
    let opts = (Kind::Float, Device::Cpu);
    let voxels = Tensor::rand([1, 3, 4, 8, 8], opts);
    let x = Tensor::randn([1, 16, 3, 16, 16], opts);
    assert!(tiny().spike_tsa.enabled);
    assert_same_gradients(&build, BOTH, Kind::Float, &[voxels, x], &forward);
}

#[test]
fn tiny_vrt_spike_gives_the_same_gradients_with_drop_path() {
    let build = |p: &nn::Path, flags: Checkpointing| {
        let mut cfg = with_flags(tiny(), flags);
        cfg.drop_path_rate = 0.3;
        Vrt::new(p, &cfg).unwrap()
    };
    let forward = |net: &Vrt, t: &[Tensor]| net.forward(&t[0], Some(&t[1]), true).unwrap();
    let opts = (Kind::Float, Device::Cpu);
    let blur = Tensor::rand([2, 2, 3, 32, 32], opts);
    let voxels = Tensor::rand([2, 2, 4, 16, 16], opts);
    // In double precision: in single precision a few tiny gradients (1e-4 against
    // terms of order 1) differ by the summation order of their chunks, which
    // checkpointing changes.
    assert_same_gradients(&build, BOTH, Kind::Double, &[blur, voxels], &forward);
}

#[test]
fn a_failing_closure_is_an_error_in_the_forward_pass() {
    let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let err =
        checkpoint_one(&[&x], |_| Err(ModelError::Shape("bad block input".into()))).unwrap_err();
    // The closure's own error comes back typed.
    assert!(
        matches!(err, ModelError::Shape(ref m) if m == "bad block input"),
        "{err}"
    );
    let err = checkpoint(&[&x], |_| -> Result<Vec<Tensor>, ModelError> {
        panic!("closure bug")
    })
    .unwrap_err();
    assert!(matches!(err, ModelError::Checkpoint(_)), "{err}");
    assert!(err.to_string().contains("closure bug"), "{err}");
    let err = checkpoint(&[&x], |_| Ok(Vec::new())).unwrap_err();
    assert!(err.to_string().contains("no tensor"), "{err}");
}

#[test]
fn a_closure_failing_in_the_recomputation_fails_the_backward_call() {
    for panics in [false, true] {
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = checkpoint_one(&[&x], move |t| {
            if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                return Ok(&t[0] * 3.0);
            }
            if panics {
                panic!("recomputation bug");
            }
            Err(ModelError::Config("recomputation refused".into()))
        })
        .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
        let expected = if panics {
            "recomputation bug"
        } else {
            "recomputation refused"
        };
        assert!(err.contains(expected), "{err}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
    // The process and autograd still work.
    let z = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&z * 2.0).sum(Kind::Float).backward();
    assert_eq!(z.grad().sum(Kind::Float).double_value(&[]), 4.0);
}
