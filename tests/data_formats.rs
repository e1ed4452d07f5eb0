//! The HDF5 sessions and legacy `.npy` voxel inputs against the folder layout:
//! `synth --h5` gives the same records, voxel grids give the same samples, and
//! every bad file is an error naming the file and what is wrong.

use std::path::Path;

use vrtspike::config::Augment;
use vrtspike::dataset::dat;
use vrtspike::dataset::index::Storage;
use vrtspike::dataset::npy;
use vrtspike::dataset::voxel::{voxelize_region, SpikeRect, SpikeShape};
use vrtspike::dataset::{DatasetIndex, IndexOptions, SpikePayload};
use vrtspike::pipeline::sample::{build_sample, ClipRef, CropMode, SampleSpec};
use vrtspike::pipeline::DiskSource;
use vrtspike::synth::{self, SynthOptions};
use vrtspike::util::rng::SplitMix64;

fn options() -> SynthOptions {
    SynthOptions {
        train_seqs: 2,
        test_seqs: 0,
        frames: 4,
        height: 32,
        width: 48,
        seed: 4,
    }
}

/// The data of [`options`] as HDF5 sessions under `out`.
fn generate_h5(out: &Path) {
    let drawn = &synth::BlurLengths::Drawn;
    synth::generate(out, &options(), drawn, &|_| {}, synth::Layout::H5).unwrap();
}

fn records(index: &DatasetIndex) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (s, seq) in index.sequences.iter().enumerate() {
        for f in 0..seq.frames.len() {
            let mut record = vec![0u8; index.record_layout(s, f).byte_len()];
            index.encode_into(s, f, &mut record).unwrap();
            out.push(record);
        }
    }
    out
}

#[test]
fn h5_sessions_hold_the_same_records_as_the_folder_layout() {
    let dir = tempfile::tempdir().unwrap();
    let (folder, h5) = (dir.path().join("folder"), dir.path().join("h5"));
    synth::generate_folder(&folder, &options(), &|_| {}).unwrap();
    generate_h5(&h5);
    assert!(h5.join("train/SYN04_000.h5").is_file());
    let a = DatasetIndex::open(&folder, "train", IndexOptions::default()).unwrap();
    let b = DatasetIndex::open(&h5, "train", IndexOptions::default()).unwrap();
    assert!(matches!(a.sequences[0].storage, Storage::Folder));
    assert!(matches!(b.sequences[0].storage, Storage::Hdf5(_)));
    assert_eq!(
        a.sequences.iter().map(|s| &s.frames).collect::<Vec<_>>(),
        b.sequences.iter().map(|s| &s.frames).collect::<Vec<_>>()
    );
    assert_eq!(records(&a), records(&b));
    // Frames read out of order (only the asked frame) are the same too.
    let mut one = vec![0u8; b.record_layout(1, 3).byte_len()];
    b.encode_into(1, 3, &mut one).unwrap();
    assert_eq!(one, records(&a)[7]);
    // And without dataset.yaml the spike size comes from the file attributes.
    std::fs::remove_file(h5.join("dataset.yaml")).unwrap();
    let c = DatasetIndex::open(&h5, "train", IndexOptions::default()).unwrap();
    assert_eq!((c.meta.spike_height, c.meta.spike_width), (16, 24));
    assert_eq!(records(&c), records(&a));
}

#[test]
fn a_session_locked_by_another_descriptor_still_opens() {
    // libhdf5 opens files without O_CLOEXEC, so a child spawned while a writer had a
    // session open keeps the writer's exclusive lock; a cluster file system may not
    // lock at all. Readers take no lock, so neither refuses them.
    let dir = tempfile::tempdir().unwrap();
    generate_h5(dir.path());
    let path = dir.path().join("train/SYN04_000.h5");
    let held = std::fs::File::open(&path).unwrap();
    // SAFETY: flock on a descriptor this test owns for the call's duration.
    let locked = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&held),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    assert_eq!(locked, 0, "the test could not take the lock itself");
    let index = DatasetIndex::open(dir.path(), "train", IndexOptions::default()).unwrap();
    assert!(matches!(index.sequences[0].storage, Storage::Hdf5(_)));
    assert_eq!(records(&index).len(), 8);
    drop(held);
}

/// Writes a one-frame session with `edit` applied, and returns the index error.
fn bad_session(dir: &Path, edit: &dyn Fn(&hdf5::File)) -> String {
    let root = dir.join("bad");
    let split = root.join("train");
    std::fs::create_dir_all(&split).unwrap();
    let path = split.join("S.h5");
    let file = hdf5::File::create(&path).unwrap();
    edit(&file);
    drop(file);
    let err = DatasetIndex::open(&root, "train", IndexOptions::default())
        .unwrap_err()
        .to_string();
    std::fs::remove_dir_all(&root).unwrap();
    assert!(err.contains("S.h5"), "{err}");
    err
}

fn attrs(file: &hdf5::File, hs: i64, ws: i64) {
    for (name, v) in [("spike_height", hs), ("spike_width", ws)] {
        let attr = file.new_attr::<i64>().create(name).unwrap();
        attr.write_scalar(&v).unwrap();
    }
}

fn u8_ds(file: &hdf5::File, name: &str, shape: &[usize]) {
    file.new_dataset::<u8>()
        .shape(shape.to_vec())
        .create(name)
        .unwrap();
}

#[test]
fn bad_h5_sessions_name_file_and_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = |f: &hdf5::File| {
        attrs(f, 4, 8);
        u8_ds(f, "blur", &[1, 8, 16, 3]);
        u8_ds(f, "sharp", &[1, 8, 16, 3]);
    };
    let err = bad_session(d, &|f| good(f));
    assert!(err.contains("'spike'") && err.contains("missing"), "{err}");
    let err = bad_session(d, &|f| {
        good(f);
        u8_ds(f, "spike", &[1, 5, 4, 1]);
        f.unlink("sharp").unwrap();
        u8_ds(f, "sharp", &[1, 8, 16, 3]);
        f.unlink("blur").unwrap();
        f.new_dataset::<u16>()
            .shape([1, 8, 16, 3])
            .create("blur")
            .unwrap();
    });
    assert!(
        err.contains("'blur'") && err.contains("expected u8"),
        "{err}"
    );
    let err = bad_session(d, &|f| {
        good(f);
        u8_ds(f, "spike", &[1, 5, 4, 2]);
    });
    assert!(
        err.contains("'spike'") && err.contains("[1, 5, 4, 2]"),
        "{err}"
    );
    let err = bad_session(d, &|f| {
        good(f);
        u8_ds(f, "spike", &[1, 5, 4]);
    });
    assert!(
        err.contains("'spike'") && err.contains("4 dimensions"),
        "{err}"
    );
    let err = bad_session(d, &|f| {
        u8_ds(f, "blur", &[1, 8, 16, 3]);
        u8_ds(f, "sharp", &[1, 8, 16, 3]);
        u8_ds(f, "spike", &[1, 5, 4, 1]);
    });
    assert!(
        err.contains("'spike_height'") && err.contains("missing"),
        "{err}"
    );
    let err = bad_session(d, &|f| {
        good(f);
        u8_ds(f, "spike", &[1, 5, 4, 1]);
        f.unlink("sharp").unwrap();
        u8_ds(f, "sharp", &[1, 8, 12, 3]);
    });
    assert!(err.contains("'sharp'") && err.contains("'blur'"), "{err}");
    // Not HDF5 at all.
    let root = d.join("junk");
    std::fs::create_dir_all(root.join("train")).unwrap();
    std::fs::write(root.join("train/S.h5"), b"not hdf5").unwrap();
    let err = DatasetIndex::open(&root, "train", IndexOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("S.h5") && err.contains("HDF5"), "{err}");
    // Skipping bad files is counted, and a good session beside it is still used.
    generate_h5(&root);
    let skip = IndexOptions {
        skip_bad: true,
        ..IndexOptions::default()
    };
    let index = DatasetIndex::open(&root, "train", skip).unwrap();
    assert_eq!(index.sequences.len(), 2);
    assert_eq!(index.skipped.len(), 1);
    assert!(index.skipped[0].path.ends_with("S.h5"));
}

#[test]
fn legacy_npy_voxels_give_the_same_samples_as_spikes() {
    let dir = tempfile::tempdir().unwrap();
    let (bits_root, vox_root) = (dir.path().join("bits"), dir.path().join("vox"));
    let opts = options();
    synth::generate_folder(&bits_root, &opts, &|_| {}).unwrap();
    synth::generate_folder(&vox_root, &opts, &|_| {}).unwrap();
    let bins = 8u32;
    let bits = DatasetIndex::open(&bits_root, "train", IndexOptions::default()).unwrap();
    // Replace spike/ with full-frame voxel grids made from the same spikes.
    for seq in &bits.sequences {
        let vox_seq = vox_root.join("train").join(&seq.name);
        std::fs::remove_dir_all(vox_seq.join("spike")).unwrap();
        std::fs::create_dir_all(vox_seq.join("spike_vox")).unwrap();
        for frame in &seq.frames {
            let stream = dat::read_dat(
                &seq.dir.join("spike").join(format!("{}.dat", frame.name)),
                16,
                24,
                true,
            )
            .unwrap();
            let shape = SpikeShape {
                height: 16,
                width: 24,
                steps: stream.steps,
            };
            let all = SpikeRect {
                y: 0,
                x: 0,
                h: 16,
                w: 24,
            };
            let mut grid = vec![0f32; (bins * 16 * 24) as usize];
            voxelize_region(&stream.bits, shape, bins, all, &mut grid).unwrap();
            let path = vox_seq
                .join("spike_vox")
                .join(format!("{}.npy", frame.name));
            npy::write_f32(&path, &[bins as usize, 16, 24], &grid).unwrap();
        }
    }
    let vox = DatasetIndex::open(&vox_root, "train", IndexOptions::default()).unwrap();
    assert!(matches!(
        vox.sequences[0].storage,
        Storage::FolderVoxels { bins: 8 }
    ));
    let layout = vox.record_layout(0, 0);
    assert_eq!(layout.payload, SpikePayload::VoxelF16 { bins });
    // f16 in the record: half the bytes of the f32 grid.
    assert_eq!(layout.spike_len(), (bins * 16 * 24 * 2) as usize);
    let spec = SampleSpec {
        crop: CropMode::Random(16),
        augment: Augment::all(true),
        bins,
    };
    for start in 0..2 {
        let clip = ClipRef { seq: 1, start };
        let mut rng_a = SplitMix64::new(start as u64);
        let mut rng_b = SplitMix64::new(start as u64);
        let a = build_sample(
            &bits,
            clip,
            3,
            &spec,
            &mut rng_a,
            &mut DiskSource::default(),
        );
        let b = build_sample(&vox, clip, 3, &spec, &mut rng_b, &mut DiskSource::default());
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(a.blur == b.blur && a.sharp == b.sharp, "RGB crops differ");
        assert_eq!(
            (a.voxel_shape(), a.crop, a.transform),
            (b.voxel_shape(), b.crop, b.transform)
        );
        // Same voxels up to f16 rounding (relative 2^-11).
        let worst = a
            .voxel
            .iter()
            .zip(&b.voxel)
            .map(|(x, y)| (x - y).abs() / x.abs().max(1e-3))
            .fold(0f32, f32::max);
        assert!(worst <= 1.0 / 2048.0, "worst relative voxel error {worst}");
        assert!(a.voxel.iter().any(|v| *v > 0.0));
    }
    // A grid of another shape in the sequence is an error naming that file.
    let odd = vox_root.join("train/SYN04_001/spike_vox/000002.npy");
    npy::write_f32(
        &odd,
        &[bins as usize, 16, 12],
        &vec![0.0; (bins * 16 * 12) as usize],
    )
    .unwrap();
    let err = DatasetIndex::open(&vox_root, "train", IndexOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("000002.npy") && err.contains("voxel grid"),
        "{err}"
    );
    // A bins mismatch with the config is a clear request error.
    let spec16 = SampleSpec { bins: 16, ..spec };
    let err = build_sample(
        &vox,
        ClipRef { seq: 0, start: 0 },
        1,
        &spec16,
        &mut SplitMix64::new(0),
        &mut DiskSource::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("8 bins") && err.contains("SPIKE_BINS"),
        "{err}"
    );
}
