//! Evaluation, shared by validation during training and by `vrtspike infer`:
//! overlapping spatial tiles ([`tiles`]), PSNR/SSIM by the VRT protocol
//! ([`quality`]), and the clip protocol with the dataset inference driver
//! ([`infer`]). It imports `dataset`, `pipeline` and `model`, never `train`.

pub mod infer;
pub mod quality;
pub mod tiles;

pub use infer::{infer_dataset, InferError, InferOptions, InferReport, SequenceQuality};
pub use quality::QualitySums;
