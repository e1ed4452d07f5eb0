//! Samples from generated data: shapes, values against the files, RGB/spike
//! alignment under augmentation, crop modes and their errors.

use std::path::Path;

use vrtspike::config::Augment;
use vrtspike::dataset::dat;
use vrtspike::dataset::image;
use vrtspike::dataset::voxel::bin_steps;
use vrtspike::dataset::{DatasetIndex, IndexOptions};
use vrtspike::pipeline::sample::{
    build_sample, ClipIndex, ClipRef, ClipWindows, CropMode, SampleSpec,
};
use vrtspike::pipeline::{DiskSource, PipelineError};
use vrtspike::synth::{self, SynthOptions};
use vrtspike::util::rng::SplitMix64;

fn tiny(dir: &Path) -> DatasetIndex {
    let options = SynthOptions {
        train_seqs: 2,
        test_seqs: 0,
        frames: 8,
        height: 64,
        width: 96,
        seed: 9,
    };
    synth::generate_folder(dir, &options, &|_| {}).unwrap();
    DatasetIndex::open_folder(dir, "train", IndexOptions::default()).unwrap()
}

fn spec(crop: CropMode, augment: bool) -> SampleSpec {
    SampleSpec {
        crop,
        augment: Augment::all(augment),
        bins: 8,
    }
}

#[test]
fn clip_windows() {
    let dir = tempfile::tempdir().unwrap();
    let index = tiny(dir.path());
    let train = ClipIndex::new(&index, ClipWindows::sliding(6));
    assert_eq!(train.clips.len(), 2 * 3);
    let val = ClipIndex::new(&index, ClipWindows::covering(6));
    let starts: Vec<(usize, usize)> = val.clips.iter().map(|c| (c.seq, c.start)).collect();
    assert_eq!(starts, vec![(0, 0), (0, 2), (1, 0), (1, 2)]);
    assert!(ClipIndex::new(&index, ClipWindows::sliding(9))
        .clips
        .is_empty());
}

#[test]
fn sample_values_match_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let index = tiny(dir.path());
    let clip = ClipRef { seq: 1, start: 2 };
    let mut rng = SplitMix64::new(4);
    let s = build_sample(
        &index,
        clip,
        3,
        &spec(CropMode::Random(32), false),
        &mut rng,
        &mut DiskSource::default(),
    )
    .unwrap();
    assert_eq!(s.rgb_shape(), [3, 3, 32, 32]);
    assert_eq!(s.voxel_shape(), [3, 8, 16, 16]);
    assert_eq!(s.crop.y % 2, 0);
    assert_eq!(s.crop.x % 2, 0);
    assert_eq!(s.frames, vec!["000003", "000004", "000005"]);
    let (hs, ws) = (32u32, 48u32);
    for j in 0..3 {
        let (blur, sharp, spike) = index.frame_paths(1, 2 + j);
        let blur = image::read_png_rgb(&blur).unwrap();
        let sharp = image::read_png_rgb(&sharp).unwrap();
        let stream = dat::read_dat(&spike, hs, ws, true).unwrap();
        for c in 0..3 {
            for y in 0..32 {
                for x in 0..32 {
                    let src = (((s.crop.y + y) * 96 + s.crop.x + x) * 3 + c) as usize;
                    let at = j * 3 * 1024 + c as usize * 1024 + (y * 32 + x) as usize;
                    assert_eq!(s.blur[at], blur.data[src] as f32 / 255.0);
                    assert_eq!(s.sharp[at], sharp.data[src] as f32 / 255.0);
                }
            }
        }
        let (sy, sx) = (s.crop.y / 2, s.crop.x / 2);
        for k in 0..8u32 {
            let steps = bin_steps(k, 8, stream.steps);
            for y in 0..16 {
                for x in 0..16 {
                    let count = steps
                        .clone()
                        .filter(|&t| stream.get(t, sy + y, sx + x))
                        .count();
                    let want = count as f32 / steps.len() as f32;
                    let at = j * 8 * 256 + (k * 256 + y * 16 + x) as usize;
                    assert_eq!(s.voxel[at], want, "frame {j} bin {k} ({y},{x})");
                }
            }
        }
    }
}

#[test]
fn augmentation_keeps_rgb_and_spikes_aligned() {
    let dir = tempfile::tempdir().unwrap();
    let index = tiny(dir.path());
    let clip = ClipRef { seq: 0, start: 0 };
    let mut seen = std::collections::HashSet::new();
    for seed in 0..24 {
        let plain = build_sample(
            &index,
            clip,
            2,
            &spec(CropMode::Random(16), false),
            &mut SplitMix64::new(seed),
            &mut DiskSource::default(),
        )
        .unwrap();
        let aug = build_sample(
            &index,
            clip,
            2,
            &spec(CropMode::Random(16), true),
            &mut SplitMix64::new(seed),
            &mut DiskSource::default(),
        )
        .unwrap();
        assert_eq!(
            plain.crop, aug.crop,
            "the crop does not depend on augmentation"
        );
        let mut blur = plain.blur.clone();
        let mut voxel = plain.voxel.clone();
        aug.transform
            .apply_planes(&mut blur, 16, 16, &mut Vec::new());
        aug.transform
            .apply_planes(&mut voxel, 8, 8, &mut Vec::new());
        assert_eq!(blur, aug.blur);
        assert_eq!(voxel, aug.voxel);
        seen.insert(format!("{:?}", aug.transform));
    }
    assert!(seen.len() >= 4, "augmentation varies: {seen:?}");
}

#[test]
fn validation_crops_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let index = tiny(dir.path());
    let clip = ClipRef { seq: 0, start: 1 };
    let mut src = DiskSource::default();
    let mut rng = SplitMix64::new(0);
    let centre = build_sample(
        &index,
        clip,
        2,
        &spec(CropMode::Center(32), false),
        &mut rng,
        &mut src,
    )
    .unwrap();
    assert_eq!((centre.crop.y, centre.crop.x), (16, 32));
    let full = build_sample(
        &index,
        clip,
        2,
        &spec(CropMode::Full, false),
        &mut rng,
        &mut src,
    )
    .unwrap();
    assert_eq!(full.rgb_shape(), [2, 3, 64, 96]);
    assert_eq!(full.voxel_shape(), [2, 8, 32, 48]);
    // The centre crop is the middle of the full frame.
    assert_eq!(centre.blur[0], full.blur[16 * 96 + 32]);
    let err = build_sample(
        &index,
        clip,
        2,
        &spec(CropMode::Random(33), false),
        &mut rng,
        &mut src,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("DATA.CROP_SIZE") && err.contains("multiple of 2"),
        "{err}"
    );
    let err = build_sample(
        &index,
        clip,
        2,
        &spec(CropMode::Center(128), false),
        &mut rng,
        &mut src,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("DATA.VAL_CROP_SIZE"), "{err}");
    let err = build_sample(
        &index,
        ClipRef { seq: 0, start: 7 },
        2,
        &spec(CropMode::Full, false),
        &mut rng,
        &mut src,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("runs past"), "{err}");
}

#[test]
fn a_source_error_reaches_the_caller_wrapped_with_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let index = tiny(dir.path());
    let (blur, _, _) = index.frame_paths(0, 1);
    std::fs::remove_file(&blur).unwrap();
    let err = build_sample(
        &index,
        ClipRef { seq: 0, start: 0 },
        3,
        &spec(CropMode::Full, false),
        &mut SplitMix64::new(1),
        &mut DiskSource::default(),
    )
    .unwrap_err();
    assert!(matches!(err, PipelineError::Data(_)), "{err:?}");
    assert!(
        err.to_string().contains(&blur.display().to_string()),
        "{err}"
    );
}
