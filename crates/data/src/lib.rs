//! vrtspike-data: what of vrtspike runs without libtorch, so that the processes
//! that never run a model (the node's cache server, the benchmarks' processes, a
//! Python package's loader workers) do not map it: the run configs, the dataset
//! readers, the synthetic writers, the node's shared-memory cache (server and
//! client) and the input pipeline up to a batch of `f32` samples.
//!
//! The layers follow the data and never import a layer above them:
//! [`config`] -> [`dataset`] (formats, index, records) -> [`synth`] (synthetic
//! writers) -> [`cache`] (the node's shared-memory store) -> [`pipeline`] (samples,
//! sampler, loader over a record source); [`util`] sits under all of them.
//! [`testkit`] and [`bench`](mod@bench) serve tests and benchmarks, and [`cli`] is
//! the command line of `cache ...` and `bench ...` that the `vrtspike-cache` binary
//! (`src/bin/vrtspike-cache.rs`) and `vrtspike` share; those three sit on top. The
//! trainer crate (`vrtspike`, which links libtorch) builds on this one.
//! `docs/layout.md` describes each folder and what it may import.

pub mod bench;
pub mod cache;
pub mod cli;
pub mod config;
pub mod dataset;
pub mod pipeline;
pub mod synth;
pub mod testkit;
pub mod util;
