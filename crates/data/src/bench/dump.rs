//! `bench loader --dump-samples DIR`: every sample a loader rank hands out, written
//! as it came, so another reader of the same data (the `vrtspike` Python package's
//! Dataset) can be held to it bit for bit. Per sample one file
//! `e<epoch>-r<rank>-p<position>.f32` (blur, sharp and voxel, each `f32`
//! little-endian in (L, C, h, w) order, one after the other) and one JSON line in
//! `rank<rank>.jsonl` naming it with the sample's place, shapes, sequence, frames,
//! crop and augmentation.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::pipeline::loader::Batch;
use crate::pipeline::sample::Sample;

/// One line of `rank<rank>.jsonl`.
#[derive(Debug, Serialize)]
struct DumpLine<'a> {
    epoch: u64,
    rank: usize,
    position: usize,
    /// The file of the sample's values, in the dump folder.
    file: String,
    rgb_shape: [usize; 4],
    voxel_shape: [usize; 4],
    sequence: &'a str,
    frames: &'a [String],
    /// `[y, x, h, w]` of the crop in the original frame.
    crop: [u32; 4],
    /// `[transpose, vflip, hflip]` of the augmentation.
    transform: [bool; 3],
}

/// Writes one rank's samples into a folder.
pub struct SampleDump {
    dir: PathBuf,
    rank: usize,
    lines: std::fs::File,
}

/// A dump that could not be written: the file and the error.
#[derive(Debug, thiserror::Error)]
#[error("sample dump {}: {source}", path.display())]
pub struct DumpError {
    /// The file.
    pub path: PathBuf,
    /// What writing it said.
    pub source: std::io::Error,
}

impl SampleDump {
    /// Starts rank `rank`'s dump in `dir` (made if missing; its `rank<rank>.jsonl`
    /// is started afresh).
    pub fn create(dir: &Path, rank: usize) -> Result<SampleDump, DumpError> {
        let fail = |path: &Path| {
            let path = path.to_path_buf();
            move |source| DumpError { path, source }
        };
        std::fs::create_dir_all(dir).map_err(fail(dir))?;
        let path = dir.join(format!("rank{rank}.jsonl"));
        let lines = std::fs::File::create(&path).map_err(fail(&path))?;
        Ok(SampleDump {
            dir: dir.to_path_buf(),
            rank,
            lines,
        })
    }

    /// Writes the samples of `batch`.
    pub fn batch(&mut self, batch: &Batch) -> Result<(), DumpError> {
        let first = batch.end_position - batch.samples.len();
        for (i, sample) in batch.samples.iter().enumerate() {
            self.sample(batch.epoch, first + i, sample)?;
        }
        Ok(())
    }

    fn sample(&mut self, epoch: u64, position: usize, s: &Sample) -> Result<(), DumpError> {
        let file = format!("e{epoch}-r{}-p{position}.f32", self.rank);
        let path = self.dir.join(&file);
        let mut bytes = Vec::with_capacity(4 * (s.blur.len() + s.sharp.len() + s.voxel.len()));
        for v in s.blur.iter().chain(&s.sharp).chain(&s.voxel) {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        std::fs::write(&path, bytes).map_err(|source| DumpError {
            path: path.clone(),
            source,
        })?;
        let line = DumpLine {
            epoch,
            rank: self.rank,
            position,
            file,
            rgb_shape: s.rgb_shape(),
            voxel_shape: s.voxel_shape(),
            sequence: &s.sequence,
            frames: &s.frames,
            crop: [s.crop.y, s.crop.x, s.crop.h, s.crop.w],
            transform: [s.transform.transpose, s.transform.vflip, s.transform.hflip],
        };
        let text = serde_json::to_string(&line).map_err(|e| DumpError {
            path: path.clone(),
            source: e.into(),
        })?;
        let lines_path = self.dir.join(format!("rank{}.jsonl", self.rank));
        writeln!(self.lines, "{text}").map_err(|source| DumpError {
            path: lines_path,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::record::Rect;
    use crate::pipeline::transform::Dihedral;

    #[test]
    fn each_sample_is_one_file_and_one_line_naming_its_place() {
        let dir = tempfile::tempdir().unwrap();
        let sample = Sample {
            clip_len: 1,
            height: 1,
            width: 2,
            bins: 1,
            spike_height: 1,
            spike_width: 1,
            blur: vec![0.5; 6],
            sharp: vec![0.25; 6],
            voxel: vec![-1.0],
            sequence: "s".into(),
            frames: vec!["f0".into()],
            crop: Rect {
                y: 2,
                x: 4,
                h: 1,
                w: 2,
            },
            transform: Dihedral::default(),
        };
        let batch = Batch {
            epoch: 3,
            end_position: 7,
            samples: vec![sample.clone(), sample],
        };
        let mut dump = SampleDump::create(dir.path(), 1).unwrap();
        dump.batch(&batch).unwrap();
        let lines = std::fs::read_to_string(dir.path().join("rank1.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = lines
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["position"], 5);
        assert_eq!(lines[1]["file"], "e3-r1-p6.f32");
        assert_eq!(lines[1]["crop"], serde_json::json!([2, 4, 1, 2]));
        let bytes = std::fs::read(dir.path().join("e3-r1-p6.f32")).unwrap();
        assert_eq!(bytes.len(), 4 * 13);
        assert_eq!(bytes[..4], 0.5f32.to_le_bytes());
        assert_eq!(bytes[24..28], 0.25f32.to_le_bytes());
        assert_eq!(bytes[48..], (-1.0f32).to_le_bytes());
    }
}
