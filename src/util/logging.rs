//! Logging through `tracing` to stderr; `RUST_LOG` overrides the default `info`.

use tracing_subscriber::EnvFilter;

/// Installs the subscriber once; later calls do nothing.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
