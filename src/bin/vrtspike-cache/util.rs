//! The util modules that the cache, the config and the command line use (and the
//! cache's unit tests, which clippy checks here too), from the library's
//! `src/util/`.

#[path = "../../util/bytes.rs"]
pub mod bytes;
#[path = "../../util/logging.rs"]
pub mod logging;
#[path = "../../util/meminfo.rs"]
pub mod meminfo;
#[path = "../../util/rng.rs"]
pub mod rng;
