//! `unet_spike` through the common `Restorer` interface: shapes, voxels at another
//! resolution, gradients for every parameter, and the RGB-only variant.

use std::path::Path;

use tch::{nn, Device, Kind, Tensor};
use vrtspike::config::Config;
use vrtspike::model;

fn cfg() -> vrtspike::config::ModelConfig {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Config::load(&root.join("configs/tiny/unet_spike_tiny.yaml"))
        .unwrap()
        .model
}

#[test]
fn unet_spike_restores_clips_and_trains_every_parameter() {
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model::build(&vs.root(), &cfg()).unwrap();
    assert_eq!(net.arch(), "unet_spike");
    assert!(net.uses_voxels());
    let blur = Tensor::rand([2, 3, 3, 32, 48], (Kind::Float, Device::Cpu));
    let voxels = Tensor::rand([2, 3, 8, 16, 24], (Kind::Float, Device::Cpu));
    let out = net.forward(&blur, Some(&voxels), true).unwrap();
    assert_eq!(out.size(), blur.size());
    // The output depends on the voxels.
    let other = net.forward(&blur, Some(&(&voxels * 0.0)), false).unwrap();
    assert!(!other.allclose(&out, 1e-6, 1e-6, false));
    (out - &blur).square().mean(Kind::Float).backward();
    for (name, t) in vs.variables() {
        let g = t.grad();
        assert!(g.defined(), "{name}");
        assert!(
            g.abs().sum(Kind::Float).double_value(&[]) > 0.0,
            "{name} has a zero gradient"
        );
    }
    assert!(net.forward(&blur, None, false).is_err());
    let odd = Tensor::rand([1, 3, 3, 30, 32], (Kind::Float, Device::Cpu));
    assert!(net.forward(&odd, Some(&voxels), false).is_err());
}

#[test]
fn unet_without_spikes_takes_rgb_only() {
    let mut cfg = cfg();
    cfg.spike.enabled = false;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model::build(&vs.root(), &cfg).unwrap();
    assert!(!net.uses_voxels());
    let blur = Tensor::rand([1, 2, 3, 32, 32], (Kind::Float, Device::Cpu));
    let out = tch::no_grad(|| net.forward(&blur, None, false)).unwrap();
    assert_eq!(out.size(), blur.size());
    assert_eq!(vs.variables()["head.weight"].size(), vec![16, 3, 1, 3, 3]);
}
