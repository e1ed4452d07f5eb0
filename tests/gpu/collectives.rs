//! NCCL with one rank (NCCL refuses two ranks on one GPU) and DDP on CUDA (the flat
//! buckets after backward, and PyTorch DDP's Reducer in backward) against the same
//! step on the CPU through Gloo.

use std::time::{Duration, Instant};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use vrtspike::ddp::{
    Backend, Ddp, DdpOptions, GradReducer, GradSync, GroupOptions, ProcessGroup, ReduceOp,
    ReducerOptions,
};

use super::{cuda, free_port, max_abs_diff, strict_fp32};

fn group(backend: Backend, prefix: &str) -> ProcessGroup {
    let options = GroupOptions {
        backend,
        master_addr: "127.0.0.1".into(),
        master_port: free_port(),
        rank: 0,
        world_size: 1,
        timeout: Duration::from_secs(60),
        prefix: prefix.into(),
        device_index: 0,
    };
    ProcessGroup::new(&options)
        .unwrap_or_else(|e| panic!("{} group of world 1: {e}", backend.name()))
}

#[test]
fn nccl_world_one_all_reduce_broadcast_barrier() {
    let device = cuda();
    assert!(vrtspike::ddp::nccl_available(), "this build has no NCCL");
    let mut g = group(Backend::Nccl, "nccl-world-1");
    let values = [1.5f32, -2.0, 3.25, 0.0];
    let mut t = Tensor::from_slice(&values).to_device(device);
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        g.all_reduce(&mut t, op).expect("all_reduce");
        assert_eq!(
            Vec::<f32>::try_from(t.to_device(Device::Cpu)).expect("values"),
            values
        );
    }
    g.broadcast(&mut t, 0).expect("broadcast");
    assert_eq!(
        Vec::<f32>::try_from(t.to_device(Device::Cpu)).expect("values"),
        values
    );
    g.barrier().expect("barrier");

    // The all-reduce of a VRT-Spike baseline's gradients (18.4 M float32 = 73.7 MB),
    // timed: at world 1 NCCL copies nothing, so this is its fixed cost.
    let mut grads = Tensor::ones([18_412_647], (Kind::Float, device));
    g.all_reduce(&mut grads, ReduceOp::Avg).expect("warm-up");
    tch::Cuda::synchronize(0);
    let start = Instant::now();
    for _ in 0..10 {
        g.all_reduce(&mut grads, ReduceOp::Avg).expect("all_reduce");
    }
    tch::Cuda::synchronize(0);
    eprintln!(
        "NCCL world 1: all-reduce of 73.7 MB (the baseline's gradients): {:.3} ms",
        start.elapsed().as_secs_f64() * 1e3 / 10.0
    );
    assert_eq!(grads.mean(Kind::Float).double_value(&[]), 1.0);
}

#[test]
fn the_nccl_backend_refuses_a_device_it_does_not_have() {
    let _ = cuda();
    let options = GroupOptions {
        backend: Backend::Nccl,
        master_addr: "127.0.0.1".into(),
        master_port: free_port(),
        rank: 0,
        world_size: 1,
        timeout: Duration::from_secs(30),
        prefix: "nccl-bad-device".into(),
        device_index: 4096,
    };
    let err = ProcessGroup::new(&options)
        .err()
        .expect("device 4096 does not exist");
    assert!(err.to_string().contains("4096"), "{err}");
}

/// A small conv net whose initial weights follow the seed, on `device`.
fn net(vs: &nn::VarStore) -> nn::Sequential {
    tch::manual_seed(7);
    let root = vs.root();
    let cfg = nn::ConvConfig {
        padding: 1,
        ..Default::default()
    };
    nn::seq()
        .add(nn::conv2d(&root / "c1", 3, 16, 3, cfg))
        .add_fn(|x| x.relu())
        .add(nn::conv2d(&root / "c2", 16, 3, 3, cfg))
}

/// The net, an SGD optimizer over it, an input and a target, all on `device`.
struct Setup {
    vs: nn::VarStore,
    model: nn::Sequential,
    opt: nn::Optimizer,
    x: Tensor,
    y: Tensor,
}

fn setup(device: Device) -> Setup {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = net(&vs);
    let mut vs = vs;
    vs.set_device(device);
    let opt = nn::sgd(0.9, 0.0, 0.0, false).build(&vs, 0.1).expect("sgd");
    tch::manual_seed(11);
    let x = Tensor::randn([4, 3, 24, 24], (Kind::Float, Device::Cpu)).to_device(device);
    let y = Tensor::randn([4, 3, 24, 24], (Kind::Float, Device::Cpu)).to_device(device);
    Setup {
        vs,
        model,
        opt,
        x,
        y,
    }
}

/// The parameters of `vs`, on the CPU, sorted by name.
fn parameters_on_cpu(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.to_device(Device::Cpu)))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// One DDP step (SGD) on `device` through `group`; the parameters after it, on the CPU.
fn ddp_step(device: Device, group: &mut ProcessGroup) -> Vec<(String, Tensor)> {
    let Setup {
        vs,
        model,
        mut opt,
        x,
        y,
    } = setup(device);
    let mut ddp = Ddp::new(group, vs.trainable_variables(), DdpOptions::default()).expect("ddp");
    opt.zero_grad();
    model
        .forward(&x)
        .mse_loss(&y, tch::Reduction::Mean)
        .backward();
    ddp.sync_gradients(group).expect("sync");
    opt.step();
    parameters_on_cpu(&vs)
}

/// Runs `steps` on the CPU through Gloo and on CUDA through NCCL (world 1 each) and
/// asserts the parameters agree to 1e-5.
fn cuda_matches_cpu(what: &str, steps: fn(Device, &mut ProcessGroup) -> Vec<(String, Tensor)>) {
    let device = cuda();
    strict_fp32();
    let mut cpu_group = group(Backend::Gloo, &format!("{what}-cpu"));
    let mut gpu_group = group(Backend::Nccl, &format!("{what}-gpu"));
    let on_cpu = steps(Device::Cpu, &mut cpu_group);
    let on_gpu = steps(device, &mut gpu_group);
    assert_eq!(on_cpu.len(), on_gpu.len());
    for ((name, a), (other, b)) in on_cpu.iter().zip(&on_gpu) {
        assert_eq!(name, other);
        let diff = max_abs_diff(a, b);
        assert!(diff < 1e-5, "{what}, {name}: CUDA and CPU differ by {diff}");
    }
}

#[test]
fn a_ddp_step_on_cuda_equals_the_same_step_on_the_cpu() {
    cuda_matches_cpu("ddp", ddp_step);
}

/// Two SGD steps on `device` with PyTorch DDP's Reducer averaging in backward
/// through `group`; the parameters after them, on the CPU.
fn reducer_steps(device: Device, group: &mut ProcessGroup) -> Vec<(String, Tensor)> {
    let Setup {
        vs,
        model,
        mut opt,
        x,
        y,
    } = setup(device);
    let mut reducer = GradReducer::new(group, vs.trainable_variables(), ReducerOptions::default())
        .expect("reducer");
    for _ in 0..2 {
        for var in vs.trainable_variables() {
            let mut grad = var.grad();
            if grad.defined() {
                let _ = grad.zero_();
            }
        }
        reducer
            .before_forward(GradSync::Reduce)
            .expect("before forward");
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        reducer
            .backward(group, &loss, GradSync::Reduce)
            .expect("reducing backward");
        opt.step();
    }
    parameters_on_cpu(&vs)
}

#[test]
fn a_reducer_step_on_cuda_equals_the_same_step_on_the_cpu() {
    cuda_matches_cpu("reducer", reducer_steps);
}
