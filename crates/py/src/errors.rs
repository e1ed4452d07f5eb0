//! The package's exceptions and the one way into them: every failure of the
//! library becomes a Python exception whose message names the file, key, address
//! or request at fault (the library's own messages), and a panic inside a call is
//! caught at the call's edge and raised as `VrtspikeError` instead of unwinding into
//! the interpreter.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

create_exception!(
    _native,
    VrtspikeError,
    PyException,
    "Base of every error of the vrtspike package."
);
create_exception!(
    _native,
    ConfigError,
    VrtspikeError,
    "A config file, key or override that cannot be used; the message names the file, \
     the override and the key path (DATA.CROP_SIZE)."
);
create_exception!(
    _native,
    DataError,
    VrtspikeError,
    "A dataset file that cannot be read or decoded; the message names the file."
);
create_exception!(
    _native,
    CacheError,
    VrtspikeError,
    "The node's cache server failed in a way a read cannot go around; the message \
     names the address and the request."
);

/// What a call of the extension can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// A config (file, key, override) that cannot be used.
    #[error(transparent)]
    Config(#[from] vrtspike_data::config::ConfigError),
    /// A config key whose value this package cannot use (named in the message).
    #[error("{0}")]
    ConfigKey(String),
    /// A dataset file.
    #[error(transparent)]
    Data(#[from] vrtspike_data::dataset::DataError),
    /// The cache.
    #[error(transparent)]
    Cache(#[from] vrtspike_data::cache::CacheError),
    /// Building a sample (a record source's failure, or a request the data cannot
    /// serve).
    #[error(transparent)]
    Pipeline(#[from] vrtspike_data::pipeline::PipelineError),
    /// A request of the caller that makes no sense (named in the message).
    #[error("{0}")]
    Request(String),
}

impl From<Failure> for PyErr {
    fn from(failure: Failure) -> PyErr {
        use vrtspike_data::pipeline::PipelineError;
        let text = failure.to_string();
        match failure {
            Failure::Config(_) | Failure::ConfigKey(_) => ConfigError::new_err(text),
            Failure::Data(_) | Failure::Pipeline(PipelineError::Data(_)) => {
                DataError::new_err(text)
            }
            Failure::Cache(_) | Failure::Pipeline(PipelineError::Cache(_)) => {
                CacheError::new_err(text)
            }
            Failure::Pipeline(PipelineError::Request(_)) | Failure::Request(_) => {
                VrtspikeError::new_err(text)
            }
        }
    }
}

/// Runs `call` (named `what` in errors) and turns its failure into the matching
/// exception; a panic inside it becomes a `VrtspikeError` naming `what`, after
/// `on_panic` has reset whatever the call may have left half done.
pub fn guarded<T>(
    what: &str,
    on_panic: impl FnOnce(),
    call: impl FnOnce() -> Result<T, Failure>,
) -> Result<T, PyErr> {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(result) => result.map_err(PyErr::from),
        Err(payload) => {
            on_panic();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".to_string());
            Err(VrtspikeError::new_err(format!(
                "{what}: internal error of the vrtspike extension (please report it): {message}"
            )))
        }
    }
}
