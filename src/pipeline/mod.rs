//! The input pipeline of a rank: clips and their samples (crop aligned between RGB
//! and spike resolution, voxels, dihedral augmentation), the distributed sampler,
//! and the loader whose worker threads build batches from a [`RecordSource`]: the
//! node cache ([`CacheSource`]) or the disk ([`DiskSource`]), telling the cache its
//! coming reads ([`plan`]: the planned policy and its prefetch). It imports `config`,
//! `dataset`, `cache` and `util`, never the model or the trainer.

pub mod error;
pub mod loader;
pub mod plan;
pub mod sample;
pub mod sampler;
pub mod source;
pub mod tensors;
pub mod transform;

pub use error::PipelineError;
pub use loader::{Batch, Loader, LoaderOptions};
pub use source::{CacheSource, DiskSource, RecordSource};
