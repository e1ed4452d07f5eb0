//! The sample at one place of a rank's epoch: its crop and augmentation are drawn
//! from the seed, the epoch, the rank and the sampler position, so whoever builds
//! it (a loader worker thread, or a Python DataLoader worker of the `vrtspike`
//! package) gets the same bytes. Under `DATA.SKIP_BAD_FRAMES` a clip whose data is
//! bad is replaced by the next one, each try drawn afresh.

use crate::dataset::index::DatasetIndex;
use crate::util::rng::SplitMix64;

use super::error::{PipelineError, Result};
use super::sample::{build_sample, ClipIndex, Sample, SampleSpec};
use super::source::RecordSource;

/// Most clips tried for one sample under `DATA.SKIP_BAD_FRAMES` (the bad one and
/// those after it).
pub const MAX_TRIES: usize = 16;

/// Where a sample sits: what its random draws come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplePlace {
    /// The epoch.
    pub epoch: u64,
    /// The rank whose share it is.
    pub rank: usize,
    /// Its position in that rank's epoch (the sampler's).
    pub position: usize,
    /// The clip the sampler gave for it (an index into the [`ClipIndex`]).
    pub clip: usize,
}

/// How samples are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrawRules {
    /// Crop, augmentation and voxel bins.
    pub spec: SampleSpec,
    /// The run's seed (`TRAIN.SEED`).
    pub seed: u64,
    /// Replace a clip whose data is bad by the next one (`DATA.SKIP_BAD_FRAMES`).
    pub skip_bad: bool,
}

/// A drawn sample, and how many clips were replaced before it.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    /// The sample.
    pub sample: Sample,
    /// Clips replaced under `DATA.SKIP_BAD_FRAMES` (0 almost always).
    pub replaced: usize,
}

/// Fails naming the split when `clips` holds no clip.
pub(super) fn has_clips(index: &DatasetIndex, clips: &ClipIndex) -> Result<()> {
    match clips.clips.is_empty() {
        true => Err(PipelineError::Request(format!(
            "no clip of {} frames in {}",
            clips.len,
            index.root.join(&index.split).display()
        ))),
        false => Ok(()),
    }
}

/// The sample at `place`, its records read through `source`. A cache failure is
/// never skipped; a data error is, under `rules.skip_bad`, for up to [`MAX_TRIES`]
/// clips (logged once each).
pub fn draw_sample<S: RecordSource>(
    index: &DatasetIndex,
    clips: &ClipIndex,
    rules: &DrawRules,
    place: SamplePlace,
    source: &mut S,
) -> Result<Drawn> {
    has_clips(index, clips)?;
    if place.clip >= clips.clips.len() {
        return Err(PipelineError::Request(format!(
            "clip {} asked for, but {} has {} clips of {} frames",
            place.clip,
            index.root.join(&index.split).display(),
            clips.clips.len(),
            clips.len
        )));
    }
    let tries = clips.clips.len().min(MAX_TRIES);
    let mut attempt = 0;
    loop {
        let pick = (place.clip + attempt) % clips.clips.len();
        let mut rng = SplitMix64::from_parts(&[
            rules.seed,
            place.epoch,
            place.rank as u64,
            place.position as u64,
            attempt as u64,
        ]);
        match build_sample(
            index,
            clips.clips[pick],
            clips.len,
            &rules.spec,
            &mut rng,
            source,
        ) {
            Ok(sample) => {
                return Ok(Drawn {
                    sample,
                    replaced: attempt,
                })
            }
            Err(err @ PipelineError::Cache(_)) => return Err(err),
            Err(err) if rules.skip_bad && err.judges_the_data() && attempt + 1 < tries => {
                tracing::warn!(error = %err, "DATA.SKIP_BAD_FRAMES: clip replaced by the next one");
                attempt += 1;
            }
            Err(err) => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Augment;
    use crate::dataset::IndexOptions;
    use crate::pipeline::sample::{ClipWindows, CropMode};
    use crate::pipeline::DiskSource;
    use crate::synth::{self, SynthOptions};

    fn tiny(dir: &std::path::Path) -> (DatasetIndex, ClipIndex) {
        let options = SynthOptions {
            train_seqs: 2,
            test_seqs: 0,
            frames: 6,
            height: 32,
            width: 48,
            seed: 3,
        };
        synth::generate_folder(dir, &options, &|_| {}).unwrap();
        let index = DatasetIndex::open_folder(dir, "train", IndexOptions::default()).unwrap();
        let clips = ClipIndex::new(&index, ClipWindows::sliding(3));
        (index, clips)
    }

    fn rules(skip_bad: bool) -> DrawRules {
        DrawRules {
            spec: SampleSpec {
                crop: CropMode::Random(16),
                augment: Augment::all(true),
                bins: 4,
            },
            seed: 5,
            skip_bad,
        }
    }

    fn place(position: usize, clip: usize) -> SamplePlace {
        SamplePlace {
            epoch: 2,
            rank: 1,
            position,
            clip,
        }
    }

    #[test]
    fn a_place_gives_the_same_sample_and_each_part_of_it_matters() {
        let dir = tempfile::tempdir().unwrap();
        let (index, clips) = tiny(dir.path());
        let mut disk = DiskSource::default();
        let draw = |p: SamplePlace, disk: &mut DiskSource| {
            draw_sample(&index, &clips, &rules(false), p, disk).unwrap()
        };
        let first = draw(place(3, 4), &mut disk);
        assert_eq!(first.replaced, 0);
        assert_eq!(
            first,
            draw(place(3, 4), &mut disk),
            "same place, same bytes"
        );
        let others = [
            SamplePlace {
                epoch: 3,
                ..place(3, 4)
            },
            SamplePlace {
                rank: 0,
                ..place(3, 4)
            },
            place(2, 4),
        ];
        for other in others {
            let drawn = draw(other, &mut disk).sample;
            assert_eq!(
                drawn.frames, first.sample.frames,
                "{other:?}: the same clip"
            );
            assert_ne!(
                drawn.blur, first.sample.blur,
                "{other:?} draws another crop or augmentation"
            );
        }
        let err = draw_sample(&index, &clips, &rules(false), place(0, 99), &mut disk)
            .unwrap_err()
            .to_string();
        assert!(err.contains("clip 99 asked for"), "{err}");
    }

    #[test]
    fn a_bad_clip_is_replaced_by_the_next_only_under_skip_bad() {
        let dir = tempfile::tempdir().unwrap();
        let (index, clips) = tiny(dir.path());
        // Clip 0 is frames 0..3 of the first sequence: break its first frame.
        let (blur, _, _) = index.frame_paths(0, 0);
        std::fs::write(&blur, b"not a png").unwrap();
        let mut disk = DiskSource::default();
        let err = draw_sample(&index, &clips, &rules(false), place(0, 0), &mut disk)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&blur.display().to_string()), "{err}");
        let drawn = draw_sample(&index, &clips, &rules(true), place(0, 0), &mut disk).unwrap();
        assert_eq!(drawn.replaced, 1);
        assert_eq!(
            drawn.sample.frames,
            index.sequences[0].frames[1..4]
                .iter()
                .map(|f| f.name.clone())
                .collect::<Vec<_>>()
        );
    }
}
