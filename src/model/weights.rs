//! Model weights as safetensors, keyed by the reference's state_dict names: strict
//! loading (every key present, no extra key, equal shapes; the error names the first
//! key at fault) and saving of every variable and buffer, sorted by name.

use std::collections::HashMap;
use std::path::Path;

use tch::{nn, Tensor};

use super::ModelError;

fn weights_error(path: &Path, key: &str, message: impl Into<String>) -> ModelError {
    ModelError::Weights {
        path: path.to_path_buf(),
        key: key.to_string(),
        message: message.into(),
    }
}

/// Loads `path` into `vs` strictly: the file must hold exactly the store's keys with
/// the same shapes. Values are converted to each variable's dtype and device. Nothing
/// is written unless every key checks out.
pub fn load_safetensors(vs: &nn::VarStore, path: &Path) -> Result<usize, ModelError> {
    let tensors = Tensor::read_safetensors(path).map_err(|source| ModelError::Torch {
        path: path.to_path_buf(),
        source,
    })?;
    let file: HashMap<String, Tensor> = tensors.into_iter().collect();
    let variables = vs.variables();
    let mut names: Vec<&String> = variables.keys().collect();
    names.sort();
    for name in &names {
        let Some(stored) = file.get(*name) else {
            return Err(weights_error(path, name, "missing from the file"));
        };
        let expected = variables[*name].size();
        if stored.size() != expected {
            return Err(weights_error(
                path,
                name,
                format!(
                    "shape {:?} in the file, the model expects {expected:?}",
                    stored.size()
                ),
            ));
        }
    }
    let mut extra: Vec<&String> = file
        .keys()
        .filter(|k| !variables.contains_key(*k))
        .collect();
    extra.sort();
    if let Some(key) = extra.first() {
        return Err(weights_error(
            path,
            key,
            format!(
                "in the file but not in the model ({} unexpected keys)",
                extra.len()
            ),
        ));
    }
    tch::no_grad(|| {
        for name in &names {
            let mut dst = variables[*name].shallow_clone();
            let src = file[*name].to_kind(dst.kind()).to_device(dst.device());
            dst.copy_(&src);
        }
    });
    Ok(names.len())
}

/// Saves every variable and buffer of `vs` to `path` (on the CPU, contiguous).
pub fn save_safetensors(vs: &nn::VarStore, path: &Path) -> Result<usize, ModelError> {
    let variables = vs.variables();
    let mut named: Vec<(String, Tensor)> = variables
        .into_iter()
        .map(|(name, t)| (name, t.detach().to_device(tch::Device::Cpu).contiguous()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&named, path).map_err(|source| ModelError::Torch {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(named.len())
}
