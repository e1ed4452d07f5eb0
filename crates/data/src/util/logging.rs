//! Logging through `tracing` to stderr; `RUST_LOG` overrides the default `info`.
//! Colours only on a terminal, so rank logs written to files stay plain text.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the subscriber once; later calls do nothing.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
