//! `vrtspike._native`, the extension module of the `vrtspike` Python package: a
//! GoPro-Spike split read as vrtspike's loader reads it (the same samples for the
//! same config keys), through the node's shared-memory cache server, for PyTorch
//! trainers (`vrtspike/data.py` makes a `torch.utils.data.Dataset` of it). It is
//! built on `vrtspike-data` alone, so it maps no libtorch: the torch a trainer
//! imports is the only one in its processes.
//!
//! In parts: the exceptions and the guard every call goes through (`errors`), the
//! split from the run config (`settings`), the server chosen and held by the process
//! that makes a Dataset (`server`), what only the process that made it may use or
//! drop (`fork`), each process's reader and its read order (`reader`), the sampler
//! (`sampler`) and the Dataset class (`dataset`).

use pyo3::prelude::*;

mod dataset;
mod errors;
mod fork;
mod reader;
mod sampler;
mod server;
mod settings;

/// Logs of the library (a lost cache server, a read order the cache refused) go to
/// stderr, warnings and above unless `RUST_LOG` says otherwise.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    let py = m.py();
    m.add_class::<dataset::NativeDataset>()?;
    m.add_class::<sampler::NativeSampler>()?;
    m.add("VrtspikeError", py.get_type::<errors::VrtspikeError>())?;
    m.add("ConfigError", py.get_type::<errors::ConfigError>())?;
    m.add("DataError", py.get_type::<errors::DataError>())?;
    m.add("CacheError", py.get_type::<errors::CacheError>())?;
    m.add("BUILD_ID", vrtspike_data::cli::cache::BUILD_ID)?;
    m.add("SERVER_ENV", vrtspike_data::cli::cache::SERVER_ENV)?;
    Ok(())
}
