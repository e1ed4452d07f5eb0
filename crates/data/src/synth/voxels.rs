//! Precomputed voxel grids beside a folder-layout dataset (format page, section 6):
//! every `<split>/<SEQ>/spike/<FRAME>.dat` voxelized over the whole frame into
//! `spike_vox/<FRAME>.npy` (f32, `bins` x H_s x W_s), as older pipelines wrote them,
//! so `DATA.USE_PRECOMPUTED_VOXELS: true` has something to read.

use std::path::Path;

use crate::dataset::error::{DataError, Result};
use crate::dataset::meta::DatasetMeta;
use crate::dataset::voxel::{voxelize_region, SpikeRect, SpikeShape};
use crate::dataset::{dat, npy};

/// Writes `spike_vox/*.npy` with `bins` planes for every `.dat` of every sequence of
/// every split folder under `root`. Returns the number of files written.
pub fn write_precomputed_voxels(root: &Path, bins: u32) -> Result<usize> {
    if bins == 0 {
        return Err(DataError::Request("voxel grids need at least 1 bin".into()));
    }
    let meta = DatasetMeta::load(root)?;
    let mut written = 0;
    for split in sorted_entries(root, Path::is_dir)? {
        for seq in sorted_entries(&split, Path::is_dir)? {
            let spike = seq.join("spike");
            if spike.is_dir() {
                written += voxelize_folder(&spike, &seq.join("spike_vox"), &meta, bins)?;
            }
        }
    }
    Ok(written)
}

/// The entries of `dir` that `keep` accepts (directories, files), sorted.
fn sorted_entries(dir: &Path, keep: fn(&Path) -> bool) -> Result<Vec<std::path::PathBuf>> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| DataError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| keep(p))
        .collect();
    out.sort();
    Ok(out)
}

fn voxelize_folder(spike: &Path, out: &Path, meta: &DatasetMeta, bins: u32) -> Result<usize> {
    std::fs::create_dir_all(out).map_err(|e| DataError::io(out, e))?;
    let (hs, ws) = (meta.spike_height, meta.spike_width);
    let mut written = 0;
    for path in sorted_entries(spike, Path::is_file)? {
        let Some(stem) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".dat"))
        else {
            continue;
        };
        let stream = dat::read_dat(&path, hs, ws, meta.spike_flipped)?;
        let shape = SpikeShape {
            height: hs,
            width: ws,
            steps: stream.steps,
        };
        let full = SpikeRect {
            y: 0,
            x: 0,
            h: hs,
            w: ws,
        };
        let mut grid = vec![0f32; bins as usize * hs as usize * ws as usize];
        voxelize_region(&stream.bits, shape, bins, full, &mut grid)?;
        let dims = [bins as usize, hs as usize, ws as usize];
        npy::write_f32(&out.join(format!("{stem}.npy")), &dims, &grid)?;
        written += 1;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{DatasetIndex, IndexOptions, SpikeSource};
    use crate::synth::{generate_folder, SynthOptions};

    fn options(spike_source: SpikeSource) -> IndexOptions {
        IndexOptions {
            spike_source,
            ..IndexOptions::default()
        }
    }

    #[test]
    fn precomputed_voxels_are_read_when_asked_and_missing_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let synth = SynthOptions {
            train_seqs: 1,
            test_seqs: 0,
            frames: 3,
            height: 32,
            width: 48,
            seed: 2,
        };
        generate_folder(root, &synth, &|_| {}).unwrap();
        // Without spike_vox, asking for it names the folder and the key.
        let err = DatasetIndex::open(root, "train", options(SpikeSource::Voxels))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spike_vox") && err.contains("DATA.USE_PRECOMPUTED_VOXELS"),
            "{err}"
        );
        assert_eq!(write_precomputed_voxels(root, 4).unwrap(), 3);
        // Auto and Raw keep reading .dat; Voxels reads the grids.
        for source in [SpikeSource::Auto, SpikeSource::Raw] {
            let index = DatasetIndex::open(root, "train", options(source)).unwrap();
            let (_, _, spike) = index.frame_paths(0, 0);
            assert!(spike.ends_with("spike/000001.dat"), "{}", spike.display());
        }
        let index = DatasetIndex::open(root, "train", options(SpikeSource::Voxels)).unwrap();
        let (_, _, spike) = index.frame_paths(0, 1);
        assert!(
            spike.ends_with("spike_vox/000002.npy"),
            "{}",
            spike.display()
        );
        assert_eq!(index.frame_count(), 3);
        // One grid missing: an error naming that file.
        let seq = &index.sequences[0].dir;
        let gone = seq.join("spike_vox/000002.npy");
        std::fs::remove_file(&gone).unwrap();
        let err = DatasetIndex::open(root, "train", options(SpikeSource::Voxels))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&gone.display().to_string()), "{err}");
    }
}
