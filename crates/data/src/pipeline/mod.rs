//! The input pipeline of a rank: clips and their samples (crop aligned between RGB
//! and spike resolution, voxels, dihedral augmentation), the distributed sampler, and
//! the loader whose worker threads build batches from a [`RecordSource`]: the node
//! cache ([`CacheSource`]) or the disk ([`DiskSource`]), telling the cache its coming
//! reads ([`read_order`], for the planned policy) and filling them ahead of use
//! ([`prefetch`]). A batch holds `f32`
//! samples; making tensors of them is the trainer's (`vrtspike::pipeline::tensors`).
//! It imports `config`, `dataset`, `cache` and `util`, never libtorch.

pub mod announce;
pub mod draw;
pub mod error;
pub mod loader;
pub mod node_workers;
pub mod prefetch;
pub mod read_order;
pub mod sample;
pub mod sampler;
pub mod source;
pub mod transform;

pub use error::PipelineError;
pub use loader::{Batch, Loader, LoaderOptions};
pub use source::{CacheSource, DiskSource, RecordSource};
