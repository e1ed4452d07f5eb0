//! The GoPro-Spike data path: on-disk formats (dataset.yaml, PNG, Vidar `.dat`),
//! the dataset index, the compact cache record, the crop-only voxelizer, samples,
//! the distributed sampler and the synthetic generator.

pub mod bench;
pub mod cli;
pub mod dat;
pub mod error;
pub mod h5;
pub mod image;
pub mod index;
pub mod loader;
pub mod meta;
pub mod npy;
pub mod record;
pub mod rng;
pub mod sample;
pub mod sampler;
pub mod synth;
pub mod transform;
pub mod voxel;

pub use error::DataError;
pub use index::{DatasetIndex, IndexOptions};
pub use meta::DatasetMeta;
pub use record::{RecordLayout, RecordView, Rect, SpikePayload};
