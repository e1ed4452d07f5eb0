//! The restoration models: VRT (faithful to the reference, loading its weights) with an
//! optional spike branch (`MODEL.ARCH: vrt_spike`), and a compact spike-fused U-Net
//! (`unet_spike`) for CPU runs and tests, both behind the [`Restorer`] trait; their
//! parameter summary and stage profiler; the model of a run config file with its
//! weights ([`LoadedModel`]). It imports `config` only (never the data layers, `eval`
//! or `train`).

pub mod attention;
pub mod checkpoint;
pub mod deform;
pub mod flow;
pub mod layers;
pub mod load;
pub mod precision;
pub mod profile;
pub mod sdp;
pub mod spike;
pub mod summary;
pub mod unet;
pub mod vrt;
pub mod weights;
pub mod window;

use std::path::PathBuf;

use tch::{nn, Tensor};

use crate::config::{Arch, ModelConfig};

pub use load::{LoadError, LoadedModel};
pub use summary::{summarize, PartCount, Summary};
pub use unet::UnetSpike;
pub use vrt::Vrt;
pub use weights::{load_safetensors, save_safetensors};

/// The tiny VRT-Spike config (`configs/tiny/vrt_spike_tiny.yaml`) that unit tests of
/// the model and the training step run.
#[cfg(test)]
pub(crate) fn tiny_vrt_spike() -> crate::config::Config {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = root.join("configs/tiny/vrt_spike_tiny.yaml");
    crate::config::Config::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

/// Why a model could not be built, run, loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The `MODEL` config cannot describe a model.
    #[error("MODEL config: {0}")]
    Config(String),
    /// An input tensor has the wrong shape.
    #[error("model input: {0}")]
    Shape(String),
    /// A weights file does not match the model.
    #[error("weights {path}: {key}: {message}")]
    Weights {
        /// The weights file.
        path: PathBuf,
        /// The first key at fault.
        key: String,
        /// What was wrong.
        message: String,
    },
    /// An activation-checkpointed part failed (libtorch, or the recomputation in the
    /// backward pass).
    #[error("activation checkpoint: {0}")]
    Checkpoint(String),
    /// A libtorch operation of the forward pass failed (out of memory above all).
    #[error("{stage}: {source}")]
    Op {
        /// The model part that ran it, outermost first: `stage 3, TMSA group 1, block 0 attention`.
        stage: String,
        /// What libtorch said.
        source: tch::TchError,
    },
    /// libtorch failed reading or writing a weights file.
    #[error("weights {path}: {source}")]
    Torch {
        /// The file involved.
        path: PathBuf,
        /// What libtorch said.
        source: tch::TchError,
    },
}

impl ModelError {
    /// This error inside the part `outer` (an [`ModelError::Op`]'s stage gets `outer`
    /// in front; other errors are returned as they are).
    pub fn within(self, outer: &str) -> ModelError {
        match self {
            ModelError::Op { stage, source } => ModelError::Op {
                stage: format!("{outer}, {stage}"),
                source,
            },
            other => other,
        }
    }

    /// Whether the allocator ran out of memory (CUDA or CPU), also through a
    /// checkpointed part's recomputation.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            ModelError::Op { source, .. } | ModelError::Torch { source, .. } => {
                is_out_of_memory(source)
            }
            ModelError::Checkpoint(message) => message_is_out_of_memory(message),
            _ => false,
        }
    }

    /// libtorch's own message, first line (its C++ backtrace follows on the next
    /// lines), without the stage; other errors' text.
    pub fn libtorch_message(&self) -> String {
        let text = match self {
            ModelError::Op { source, .. } | ModelError::Torch { source, .. } => source.to_string(),
            other => other.to_string(),
        };
        first_line(&text)
    }

    /// The model part that failed, for an [`ModelError::Op`].
    pub fn stage(&self) -> Option<&str> {
        match self {
            ModelError::Op { stage, .. } => Some(stage),
            _ => None,
        }
    }
}

/// A device as messages name it: `cpu`, `cuda:0`.
pub fn device_name(device: tch::Device) -> String {
    match device {
        tch::Device::Cpu => "cpu".into(),
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The first non-empty line of `text`, without a final period.
pub fn first_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
        .trim_end_matches('.')
        .to_string()
}

/// Whether libtorch's error is an allocation failure: CUDA's `OutOfMemoryError` /
/// "CUDA out of memory", or the CPU allocator's "can't allocate memory" / "not
/// enough memory".
pub fn is_out_of_memory(error: &tch::TchError) -> bool {
    message_is_out_of_memory(&error.to_string())
}

/// [`is_out_of_memory`] of an error's text.
pub fn message_is_out_of_memory(message: &str) -> bool {
    const MARKERS: [&str; 5] = [
        "CUDA out of memory",
        "OutOfMemoryError",
        "can't allocate memory",
        "not enough memory",
        "out of memory",
    ];
    MARKERS.iter().any(|m| message.contains(m))
}

/// Names the model part of a failed libtorch call: `.at_stage("stage 3")` turns a
/// `TchError` into [`ModelError::Op`]; on a `ModelError` it prefixes the stage.
pub trait AtStage<T> {
    /// The result with its error attributed to `stage`.
    fn at_stage(self, stage: &str) -> Result<T, ModelError>;
}

impl<T> AtStage<T> for Result<T, tch::TchError> {
    fn at_stage(self, stage: &str) -> Result<T, ModelError> {
        self.map_err(|source| ModelError::Op {
            stage: stage.to_string(),
            source,
        })
    }
}

impl<T> AtStage<T> for Result<T, ModelError> {
    fn at_stage(self, stage: &str) -> Result<T, ModelError> {
        self.map_err(|e| e.within(stage))
    }
}

/// A video restoration model: blurred clip (and spike voxels) in, restored clip out.
pub trait Restorer: Send {
    /// The `MODEL.ARCH` name.
    fn arch(&self) -> &'static str;
    /// Whether `forward` needs voxels.
    fn uses_voxels(&self) -> bool;
    /// Restores `blur` (N, D, 3, H, W) in [0, 1], given `voxels` (N, D, K, Hs, Ws) when
    /// [`Restorer::uses_voxels`]; returns (N, D, 3, H, W). `train` enables stochastic depth.
    fn forward(
        &self,
        blur: &Tensor,
        voxels: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor, ModelError>;
    /// Top-level parameter groups (name prefix, label), for summaries and profiles.
    fn parts(&self) -> Vec<(String, String)>;
    /// Frame (and tile) heights and widths must be multiples of this.
    fn size_multiple(&self) -> i64 {
        1
    }
    /// As [`Restorer::forward`], telling `marks` as each timed part ends (named like
    /// the prefixes of [`Restorer::parts`]); by default one part, `forward`.
    fn forward_marked(
        &self,
        blur: &Tensor,
        voxels: Option<&Tensor>,
        train: bool,
        marks: &mut dyn PartMarks,
    ) -> Result<Tensor, ModelError> {
        let out = self.forward(blur, voxels, train)?;
        marks.output("forward", out)
    }
}

/// Told by a forward pass as each of its parts ends (a profiler times and measures
/// the parts with it).
pub trait PartMarks {
    /// `part` has ended.
    fn part(&mut self, part: &str);
    /// `part` has ended with `out`, the tensor the pass goes on with; returns the
    /// tensor to go on with instead (the same values: a profiler hooks the backward
    /// pass there).
    fn output(&mut self, part: &str, out: Tensor) -> Result<Tensor, ModelError> {
        self.part(part);
        Ok(out)
    }
}

/// Marks that do nothing: a plain forward pass.
pub struct NoMarks;

impl PartMarks for NoMarks {
    fn part(&mut self, _: &str) {}
}

/// Builds the model `MODEL.ARCH` names under `vs` (use the VarStore's root so that
/// variable names equal the reference's state_dict keys).
pub fn build(vs: &nn::Path, cfg: &ModelConfig) -> Result<Box<dyn Restorer>, ModelError> {
    match cfg.arch {
        Arch::VrtSpike => Ok(Box::new(Vrt::new(vs, cfg)?)),
        Arch::UnetSpike => Ok(Box::new(UnetSpike::new(vs, cfg)?)),
    }
}
