//! The dataset layer: GoPro-Spike on disk and one frame as a compact record.
//! `dataset.yaml` metadata, PNG frames, Vidar `.dat` spike streams, HDF5 sessions
//! (reading, each file checked first in a probe child), `.npy` voxel grids, the
//! dataset index over a split, the compact record layout the cache stores, and the
//! crop-only voxelizer. Pure file formats: it may
//! import `config` and `util`, never the cache, the pipeline or libtorch.

pub mod dat;
pub mod error;
pub mod h5;
pub mod h5_probe;
pub mod image;
pub mod index;
pub mod meta;
pub mod npy;
pub mod record;
pub mod voxel;

pub use error::DataError;
pub use index::{DatasetIndex, IndexOptions, SpikeSource};
pub use meta::DatasetMeta;
pub use record::{RecordLayout, RecordView, Rect, SpikePayload};

/// File stem of frame `i` of a sequence (GoPro-style six digits from 000001): the
/// names the synthetic writers use and HDF5 sessions without `frame_names` get.
pub fn frame_name(i: u32) -> String {
    format!("{:06}", i + 1)
}
