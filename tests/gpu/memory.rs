//! The CUDA caching allocator's figures and empty-cache, pinned host copies through
//! the loader's batch path, and an allocation past the card as a clean error.

use tch::{Device, Kind, Tensor};
use vrtspike::dataset::record::Rect;
use vrtspike::ddp::{cuda_memory_stats, empty_cuda_cache, reset_cuda_peak};
use vrtspike::pipeline::loader::Batch;
use vrtspike::pipeline::sample::Sample;
use vrtspike::pipeline::transform::Dihedral;
use vrtspike::pipeline::BatchTensors;
use vrtspike::train::transfer::{batch_to_device, copy_async, empty_pinned};

use super::{cuda, max_abs_diff};

const MIB: u64 = 1 << 20;

#[test]
fn allocator_figures_follow_allocations_and_empty_cache_returns_blocks() {
    let device = cuda();
    empty_cuda_cache().expect("empty cache");
    reset_cuda_peak(0).expect("reset peak");
    let before = cuda_memory_stats(0)
        .expect("stats")
        .expect("a CUDA device has stats");
    let block = Tensor::ones([64 * MIB as i64], (Kind::Float, device)); // 256 MiB
    let held = cuda_memory_stats(0).expect("stats").expect("stats");
    assert!(held.allocated_current >= before.allocated_current + 256 * MIB);
    assert!(held.allocated_peak >= held.allocated_current);
    assert!(held.reserved_current >= held.allocated_current);
    drop(block);
    let freed = cuda_memory_stats(0).expect("stats").expect("stats");
    assert!(freed.allocated_current + 256 * MIB <= held.allocated_current);
    assert!(
        freed.allocated_peak >= before.allocated_current + 256 * MIB,
        "the peak stays"
    );
    assert!(
        freed.reserved_current >= 256 * MIB,
        "the cache keeps the block"
    );
    empty_cuda_cache().expect("empty cache");
    let emptied = cuda_memory_stats(0).expect("stats").expect("stats");
    assert!(
        emptied.reserved_current + 256 * MIB <= freed.reserved_current,
        "empty-cache returned nothing: {freed:?} -> {emptied:?}"
    );
    reset_cuda_peak(0).expect("reset peak");
    let reset = cuda_memory_stats(0).expect("stats").expect("stats");
    assert_eq!(reset.allocated_peak, reset.allocated_current);
}

#[test]
fn a_batch_reaches_the_gpu_through_pinned_memory_unchanged() {
    let device = cuda();
    let sample = |seed: usize| {
        let values = |n: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 31 + seed * 7 + salt) % 1000) as f32 / 1000.0)
                .collect()
        };
        Sample {
            clip_len: 2,
            height: 16,
            width: 16,
            bins: 4,
            spike_height: 8,
            spike_width: 8,
            blur: values(2 * 3 * 16 * 16, 1),
            sharp: values(2 * 3 * 16 * 16, 2),
            voxel: values(2 * 4 * 8 * 8, 3),
            sequence: format!("SEQ{seed}"),
            frames: vec!["000000".into(), "000001".into()],
            crop: Rect {
                y: 0,
                x: 0,
                h: 16,
                w: 16,
            },
            transform: Dihedral {
                transpose: false,
                vflip: false,
                hflip: false,
            },
        }
    };
    let batch = Batch {
        epoch: 0,
        end_position: 3,
        samples: vec![sample(0), sample(1), sample(2)],
    };
    let (cpu_blur, cpu_sharp, cpu_voxel) = batch.to_tensors(Device::Cpu).expect("on the CPU");
    // The trainer's way (page-locked host tensors, a side stream and an event) and
    // the plain one.
    let trainer = batch_to_device(&batch, device).expect("to CUDA on the side stream");
    let plain = batch.to_tensors(device).expect("to CUDA");
    for (blur, sharp, voxel) in [trainer, plain] {
        for (gpu, cpu) in [
            (&blur, &cpu_blur),
            (&sharp, &cpu_sharp),
            (&voxel, &cpu_voxel),
        ] {
            assert_eq!(gpu.device(), device);
            assert_eq!(gpu.size(), cpu.size());
            assert_eq!(max_abs_diff(gpu, cpu), 0.0);
        }
    }
    let pinned = empty_pinned(&[2, 3]).expect("page-locked");
    assert!(pinned.is_pinned(device), "allocated page-locked");
    assert_eq!((pinned.size(), pinned.kind()), (vec![2, 3], Kind::Float));
    // Many copies in flight, each read after its own: the event orders them.
    let host = Tensor::arange(1 << 20, (Kind::Float, Device::Cpu));
    let host = {
        let pinned = empty_pinned(&[1 << 20]).expect("page-locked");
        let mut p = pinned.shallow_clone();
        p.copy_(&host);
        pinned
    };
    for _ in 0..8 {
        let on_gpu = copy_async(&host, 0).expect("copy");
        let sum = on_gpu.sum(Kind::Double).double_value(&[]);
        assert_eq!(sum, ((1u64 << 20) * ((1 << 20) - 1) / 2) as f64);
    }
}

#[test]
fn an_allocation_past_the_card_is_a_named_error_and_the_process_goes_on() {
    let device = cuda();
    let total: i64 = vrtspike::ddp::torch_runtime()
        .devices
        .expect("devices")
        .first()
        .map(|d| d.total_memory as i64)
        .expect("device 0");
    // Twice the card, in float32 elements.
    let err =
        Tensor::f_empty([total / 2], (Kind::Float, device)).expect_err("bigger than the card");
    assert!(
        vrtspike::model::is_out_of_memory(&err),
        "not read as out of memory: {err}"
    );
    // The allocator is usable afterwards.
    let small = Tensor::ones([1024], (Kind::Float, device));
    assert_eq!(small.sum(Kind::Float).double_value(&[]), 1024.0);
}
