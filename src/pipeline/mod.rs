//! The input pipeline of a rank: everything of `vrtspike-data`'s pipeline (clips
//! and their samples, the distributed sampler, the loader over a record source),
//! and a batch as tensors for the model ([`tensors`], the one part that uses
//! libtorch).

pub use vrtspike_data::pipeline::*;

pub mod tensors;

pub use tensors::BatchTensors;
