//! Out of memory in training or validation as a typed error ([`OutOfMemory`]): the
//! phase and model stage that ran out, the input shape, the device, and what to
//! change in the config. [`OomSite::classify`] turns a libtorch allocation failure
//! (from the model, the loss or the backward pass) into it; other errors pass.

use tch::{Device, TchError};

use crate::config::Config;
use crate::model::{device_name, first_line, is_out_of_memory, ModelError};

use super::TrainError;

/// Where in a step the allocation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OomPhase {
    /// The training forward pass (and the loss).
    Forward,
    /// The backward pass (including the recomputation of checkpointed parts).
    Backward,
    /// The optimizer update (gradient norm, clipping, AdamW).
    Optimizer,
    /// A validation forward pass (no grad).
    Validation,
}

impl OomPhase {
    /// `training forward`, `training backward`, `validation`.
    pub fn name(self) -> &'static str {
        match self {
            OomPhase::Forward => "training forward",
            OomPhase::Backward => "training backward",
            OomPhase::Optimizer => "the optimizer update",
            OomPhase::Validation => "validation",
        }
    }
}

/// An out-of-memory that ends the rank: deterministic for a config, so a restart
/// would only hit it again.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfMemory {
    /// Where it happened.
    pub phase: OomPhase,
    /// The training step being run (1-based), or the step validated after.
    pub step: Option<u64>,
    /// The model part, when the model ran out (`stage 3, TMSA group 1, block 0, attention`).
    pub stage: Option<String>,
    /// The input (B, T, C, H, W) of the failed pass.
    pub shape: Vec<i64>,
    /// The device.
    pub device: String,
    /// libtorch's message (its first line).
    pub detail: String,
    /// What to change in the config.
    pub remedy: String,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out of memory in {}", self.phase.name())?;
        if let Some(step) = self.step {
            write!(f, " at step {step}")?;
        }
        if let Some(stage) = &self.stage {
            write!(f, " ({stage})")?;
        }
        write!(f, " on {}", self.device)?;
        if !self.shape.is_empty() {
            write!(f, ", input (B, T, C, H, W) = {:?}", self.shape)?;
        }
        write!(f, ": {}. To fit: {}", self.detail, self.remedy)
    }
}

/// What a failed pass was running, to describe an out-of-memory.
#[derive(Debug, Clone)]
pub struct OomSite {
    phase: OomPhase,
    step: Option<u64>,
    shape: Vec<i64>,
    device: Device,
    remedy: String,
}

impl OomSite {
    /// Training step `step` (1-based) on input `shape`.
    pub fn training(config: &Config, step: u64, shape: Vec<i64>, device: Device) -> OomSite {
        let model = &config.model;
        let mut remedy = format!(
            "a smaller DATA.CROP_SIZE (now {}) or TRAIN.BATCH_SIZE (now {})",
            config.data.crop_size, config.train.batch_size
        );
        let off: Vec<&str> = [
            (!model.use_checkpoint_attn).then_some("MODEL.USE_CHECKPOINT_ATTN"),
            (!model.use_checkpoint_ffn).then_some("MODEL.USE_CHECKPOINT_FFN"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !off.is_empty() {
            remedy += &format!(", or activation checkpointing ({}: true)", off.join(", "));
        }
        OomSite {
            phase: OomPhase::Forward,
            step: Some(step),
            shape,
            device,
            remedy,
        }
    }

    /// A validation pass on input `shape`.
    pub fn validation(config: &Config, shape: Vec<i64>, device: Device) -> OomSite {
        let data = &config.data;
        let remedy = match data.val_tile {
            Some(tile) => format!(
                "a smaller DATA.VAL_TILE (now {tile}; tiles of {} with overlap {} were tried)",
                tile, data.val_tile_overlap
            ),
            None => "DATA.VAL_TILE (validate by tiles, e.g. 256) or a smaller \
                     DATA.VAL_CROP_SIZE"
                .to_string(),
        };
        OomSite {
            phase: OomPhase::Validation,
            step: None,
            shape,
            device,
            remedy,
        }
    }

    /// The same site with input `shape`.
    pub fn with_shape(&self, shape: Vec<i64>) -> OomSite {
        OomSite {
            shape,
            ..self.clone()
        }
    }

    /// The same site in another phase (the backward pass of a training step).
    pub fn in_phase(mut self, phase: OomPhase) -> OomSite {
        self.phase = phase;
        self
    }

    /// `error` as [`TrainError::OutOfMemory`] when it is an allocation failure.
    pub fn classify(&self, error: TrainError) -> TrainError {
        let (stage, detail) = match &error {
            TrainError::Model(e) if e.is_out_of_memory() => {
                (e.stage().map(str::to_string), e.libtorch_message())
            }
            TrainError::Torch(e) if is_out_of_memory(e) => (None, first_line(&e.to_string())),
            _ => return error,
        };
        TrainError::OutOfMemory(Box::new(OutOfMemory {
            phase: self.phase,
            step: self.step,
            stage,
            shape: self.shape.clone(),
            device: device_name(self.device),
            detail,
            remedy: self.remedy.clone(),
        }))
    }

    /// [`OomSite::classify`] of a libtorch error.
    pub fn torch(&self, error: TchError) -> TrainError {
        self.classify(TrainError::Torch(error))
    }

    /// [`OomSite::classify`] of a model error.
    pub fn model(&self, error: ModelError) -> TrainError {
        self.classify(TrainError::Model(error))
    }
}

/// The environment variable of the test hook [`test_hook`]: `forward`, `backward` or
/// `validation`.
pub const TEST_OOM_VAR: &str = "VRTSPIKE_TEST_OOM";

/// Floats no allocator can hold (2^62 bytes, beyond any address space).
const IMPOSSIBLE_ELEMENTS: i64 = 1 << 60;

/// TEST HOOK, for the launcher's tests of an out-of-memory rank: with
/// `VRTSPIKE_TEST_OOM=<phase>` set (`forward`, `backward`, `optimizer`,
/// `validation`), the rank
/// asks libtorch for 2^62 bytes on its device at that phase; the real allocator
/// failure then takes the same path as any out-of-memory there. Unset, it does nothing.
pub fn test_hook(phase: OomPhase, device: Device) -> Result<(), TchError> {
    static WANTED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let wanted = WANTED.get_or_init(|| std::env::var(TEST_OOM_VAR).ok());
    let name = match phase {
        OomPhase::Forward => "forward",
        OomPhase::Backward => "backward",
        OomPhase::Optimizer => "optimizer",
        OomPhase::Validation => "validation",
    };
    if wanted.as_deref() != Some(name) {
        return Ok(());
    }
    tracing::warn!("{TEST_OOM_VAR}={name}: injecting an out-of-memory (test hook)");
    let options = (tch::Kind::Float, device);
    tch::Tensor::f_empty([IMPOSSIBLE_ELEMENTS], options).map(|_| ())
}

/// `error` with validation step `step` when it is an out-of-memory without one.
pub fn at_step(error: TrainError, step: u64) -> TrainError {
    match error {
        TrainError::OutOfMemory(mut oom) => {
            oom.step = oom.step.or(Some(step));
            TrainError::OutOfMemory(oom)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    fn config() -> Config {
        crate::model::tiny_vrt_spike()
    }

    /// A real allocation failure of the CPU allocator.
    fn cpu_oom() -> TchError {
        Tensor::f_empty([IMPOSSIBLE_ELEMENTS], (Kind::Float, Device::Cpu)).unwrap_err()
    }

    #[test]
    fn a_training_oom_names_stage_shape_and_remedy() {
        let mut cfg = config();
        cfg.model.use_checkpoint_attn = false;
        cfg.model.use_checkpoint_ffn = true;
        let site = OomSite::training(&cfg, 7, vec![2, 6, 3, 64, 64], Device::Cpu);
        let error = ModelError::Op {
            stage: "block 0, attention".into(),
            source: cpu_oom(),
        }
        .within("stage 3, TMSA group 1");
        let err = site.model(error);
        let TrainError::OutOfMemory(oom) = &err else {
            panic!("not classified: {err}");
        };
        assert_eq!(
            oom.stage.as_deref(),
            Some("stage 3, TMSA group 1, block 0, attention")
        );
        let text = err.to_string();
        for part in [
            "out of memory in training forward at step 7 (stage 3, TMSA group 1, block 0, attention)",
            "on cpu, input (B, T, C, H, W) = [2, 6, 3, 64, 64]",
            "DefaultCPUAllocator",
            &format!("DATA.CROP_SIZE (now {})", cfg.data.crop_size),
            "TRAIN.BATCH_SIZE",
            "(MODEL.USE_CHECKPOINT_ATTN: true)",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        assert!(!text.contains("USE_CHECKPOINT_FFN"), "{text}");
        assert!(!text.contains("frame #"), "no C++ backtrace: {text}");
    }

    #[test]
    fn a_validation_oom_points_at_the_tile_and_others_pass() {
        let mut cfg = config();
        cfg.data.val_tile = Some(128);
        let site = OomSite::validation(&cfg, vec![1, 6, 3, 720, 1280], Device::Cuda(1));
        let text = site.torch(cpu_oom()).to_string();
        assert!(
            text.starts_with("out of memory in validation on cuda:1"),
            "{text}"
        );
        assert!(text.contains("a smaller DATA.VAL_TILE (now 128"), "{text}");
        cfg.data.val_tile = None;
        let site = OomSite::validation(&cfg, vec![1, 6, 3, 720, 1280], Device::Cpu);
        assert!(site
            .torch(cpu_oom())
            .to_string()
            .contains("DATA.VAL_TILE (validate by tiles"));
        let other = site.model(ModelError::Shape("odd".into()));
        assert!(matches!(other, TrainError::Model(ModelError::Shape(_))));
    }
}
