//! The pipeline's error type: the failure of a record source (a dataset file, or
//! the node cache) wrapped as it came, or a request the data or loader cannot serve.

/// A sample, batch or sampler state that could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Reading or decoding a dataset file failed (the file named).
    #[error(transparent)]
    Data(#[from] crate::dataset::DataError),
    /// The node cache failed (connection, reservation, commit).
    #[error("cache: {0}")]
    Cache(#[from] crate::cache::CacheError),
    /// A request does not fit the data or the loader (crop out of bounds, a sampler
    /// state of another run, a batch of mixed shapes, ...).
    #[error("{0}")]
    Request(String),
}

impl PipelineError {
    /// Whether the error says something about the data, which
    /// `DATA.SKIP_BAD_FRAMES` may skip (see `DataError::judges_the_data`).
    pub fn judges_the_data(&self) -> bool {
        match self {
            PipelineError::Data(e) => e.judges_the_data(),
            PipelineError::Cache(_) | PipelineError::Request(_) => true,
        }
    }
}

/// Result of the pipeline.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;
