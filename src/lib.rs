//! vrtspike: a trainer for spike-guided video deblurring (VRT-Spike on GoPro+Spike)
//! on libtorch, whose data path is one shared-memory cache per node.
//!
//! The modules follow the data: [`config`] -> `data` -> [`cache`] -> loader ->
//! `model` -> `train` -> `dist`; the `vrtspike-launch` binary supervises processes.

pub mod bench;
pub mod cache;
pub mod config;
pub mod data;
pub mod dist;
pub mod model;
pub mod monitor;
pub mod train;
pub mod util;
