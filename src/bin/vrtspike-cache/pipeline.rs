//! The library's pipeline without `tensors.rs` (the one part that makes tensors).

pub use error::PipelineError;
pub use loader::{Batch, Loader, LoaderOptions};
pub use source::{CacheSource, DiskSource, RecordSource};

#[path = "../../pipeline/error.rs"]
pub mod error;
#[path = "../../pipeline/loader.rs"]
pub mod loader;
#[path = "../../pipeline/plan.rs"]
pub mod plan;
#[path = "../../pipeline/sample.rs"]
pub mod sample;
#[path = "../../pipeline/sampler.rs"]
pub mod sampler;
#[path = "../../pipeline/source.rs"]
pub mod source;
#[path = "../../pipeline/transform.rs"]
pub mod transform;
