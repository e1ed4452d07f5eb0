//! Which weights file a `--checkpoint` path names: a `.safetensors` file, a
//! checkpoint directory (its `model.safetensors`), or a run directory (its newest
//! complete checkpoint, by the run-dir contract). Used by `vrtspike infer` and
//! anything else given a run; training writes its checkpoints with [`MODEL_FILE`].

use std::path::{Path, PathBuf};

use vrtspike_contract::rundir;

/// The model weights file of a checkpoint directory.
pub const MODEL_FILE: &str = "model.safetensors";

/// A path that names no weights.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ResolveError {
    /// The path given.
    pub path: PathBuf,
    /// Why it names no weights.
    pub message: String,
}

fn resolve_err(path: &Path, message: impl Into<String>) -> ResolveError {
    ResolveError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The weights file a `--checkpoint` names: a `.safetensors` file, a checkpoint
/// directory (`model.safetensors` inside), or a run directory (its newest checkpoint).
pub fn resolve_weights(path: &Path) -> Result<PathBuf, ResolveError> {
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(resolve_err(path, "no such checkpoint file or directory"));
    }
    if path.join(MODEL_FILE).is_file() {
        return Ok(path.join(MODEL_FILE));
    }
    match rundir::RunLayout::new(path).latest_checkpoint() {
        Some(checkpoint) if checkpoint.path.join(MODEL_FILE).is_file() => {
            Ok(checkpoint.path.join(MODEL_FILE))
        }
        _ => Err(resolve_err(
            path,
            format!(
                "neither a checkpoint directory (no {MODEL_FILE}) nor a run directory \
                 (no complete checkpoint under checkpoints/)"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_paths_resolve_to_weights() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        for step in [1u64, 20] {
            let ckpt = rundir::RunLayout::new(&run).step_dir(step);
            std::fs::create_dir_all(&ckpt).unwrap();
            std::fs::write(ckpt.join(MODEL_FILE), b"").unwrap();
            std::fs::write(ckpt.join(rundir::CHECKPOINT_STATE_FILE), b"{}").unwrap();
        }
        let newest = run.join("checkpoints/step_00000020").join(MODEL_FILE);
        assert_eq!(resolve_weights(&run).unwrap(), newest);
        let step1 = run.join("checkpoints/step_00000001");
        assert_eq!(resolve_weights(&step1).unwrap(), step1.join(MODEL_FILE));
        assert_eq!(
            resolve_weights(&step1.join(MODEL_FILE)).unwrap(),
            step1.join(MODEL_FILE)
        );
        let missing = dir.path().join("nope");
        let err = resolve_weights(&missing).unwrap_err().to_string();
        assert!(err.contains(&missing.display().to_string()), "{err}");
        let err = resolve_weights(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no complete checkpoint"), "{err}");
    }
}
