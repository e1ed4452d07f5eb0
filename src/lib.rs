//! vrtspike: a trainer for spike-guided video deblurring (VRT-Spike on GoPro+Spike)
//! on libtorch, whose data path is one shared-memory cache per node.
//!
//! The library layers follow the data and never import a layer above them:
//! [`config`] -> [`dataset`] (formats, index, records) -> [`synth`] (synthetic
//! writers) -> [`cache`] (the node's shared-memory store) -> [`pipeline`] (samples,
//! sampler, loader over a record source) -> [`model`] -> [`eval`] (tiles, PSNR/SSIM,
//! the clip protocol) -> [`train`] -> [`ddp`]; [`util`] sits under all of them.
//! [`testkit`] and [`bench`](mod@bench) serve tests and benchmarks and sit on top; the
//! `vrtspike` binary (`src/cli/`, a file per subcommand) and `vrtspike-launch` use
//! the library. `docs/layout.md` describes each folder and what it may import.

pub mod bench;
pub mod cache;
pub mod config;
pub mod dataset;
pub mod ddp;
pub mod eval;
pub mod model;
pub mod monitor;
pub mod pipeline;
pub mod plan;
pub mod synth;
pub mod testkit;
pub mod train;
pub mod util;
