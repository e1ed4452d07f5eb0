//! vrtspike: a trainer for spike-guided video deblurring (VRT-Spike on GoPro+Spike)
//! on libtorch, whose data path is one shared-memory cache per node.
//!
//! What runs without libtorch is the `vrtspike-data` crate (`crates/data/`):
//! [`config`] -> [`dataset`] (formats, index, records) -> [`synth`] (synthetic
//! writers) -> [`cache`] (the node's shared-memory store) -> [`pipeline`] (samples,
//! sampler, loader over a record source), with [`testkit`] and [`bench`](mod@bench);
//! they are re-exported here under their own names. This crate adds the layers that
//! run a model and never import a layer above them: [`pipeline`]'s batch as tensors
//! -> [`model`] -> [`eval`] (tiles, PSNR/SSIM, the clip protocol) -> [`monitor`],
//! [`plan`] -> [`train`] -> [`ddp`]; [`util`] sits under all of them. The `vrtspike`
//! binary (`src/cli/`, a file per subcommand) and `vrtspike-launch` use the library.
//! `docs/layout.md` describes each folder and what it may import.

pub use vrtspike_data::{bench, cache, config, dataset, synth, testkit};

pub mod ddp;
pub mod eval;
pub mod model;
pub mod monitor;
pub mod pipeline;
pub mod plan;
pub mod train;
pub mod util;
