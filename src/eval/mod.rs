//! Evaluation, shared by validation during training and by `vrtspike infer`:
//! overlapping spatial tiles ([`tiles`]), PSNR/SSIM by the VRT protocol
//! ([`quality`]), the clip protocol with the dataset inference driver
//! ([`infer`]), and which weights a checkpoint path names ([`checkpoint`]). It imports
//! `dataset`, `pipeline`, `model` and the run-dir contract, never `train`.

pub mod checkpoint;
pub mod infer;
pub mod quality;
pub mod tiles;

pub use checkpoint::{resolve_weights, ResolveError, MODEL_FILE};
pub use infer::{infer_dataset, InferError, InferOptions, InferReport, SequenceQuality};
pub use quality::QualitySums;
