//! Every read of a tensor's values back to the host, in one place and counted. On a
//! GPU such a read waits for every kernel queued before it (the host stops running
//! ahead of the device), so the training step makes none on a step that does not
//! log: losses, norms and flags stay on the device and are read together at log
//! steps (`train::run`'s settle). [`count`] is the number of reads this process has
//! made; `metrics.jsonl`'s `train` lines carry the reads of each window
//! (`host_reads`), and a test of this module keeps the training, evaluation,
//! model and gradient-averaging code from reading past this helper.

use std::sync::atomic::{AtomicU64, Ordering};

use tch::{kind::Element, TchError, Tensor};

static READS: AtomicU64 = AtomicU64::new(0);

/// Reads of tensor values made by this process so far.
pub fn count() -> u64 {
    READS.load(Ordering::Relaxed)
}

/// The values of `t` (any shape, kind and device) as a flat `Vec<T>`: one read.
pub fn values<T: Element + Copy>(t: &Tensor) -> Result<Vec<T>, TchError> {
    READS.fetch_add(1, Ordering::Relaxed);
    let flat = t.f_to_kind(T::KIND)?.f_contiguous()?.f_view([-1])?;
    Vec::<T>::try_from(&flat)
}

/// The one value of a one-element tensor as `f64`: one read.
pub fn scalar(t: &Tensor) -> Result<f64, TchError> {
    let numel = t.numel();
    if numel != 1 {
        return Err(TchError::Shape(format!(
            "a scalar read of a tensor of {numel} elements ({:?})",
            t.size()
        )));
    }
    Ok(values::<f64>(t)?[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn reads_are_counted_and_return_the_values() {
        let before = count();
        let t = Tensor::from_slice(&[1.5f32, -2.0, 4.0]).view([3, 1]);
        assert_eq!(values::<f64>(&t).unwrap(), vec![1.5, -2.0, 4.0]);
        assert_eq!(values::<i64>(&t.transpose(0, 1)).unwrap(), vec![1, -2, 4]);
        assert_eq!(scalar(&Tensor::from(2.5f64)).unwrap(), 2.5);
        let err = scalar(&t).unwrap_err().to_string();
        assert!(err.contains("3 elements"), "{err}");
        // Other tests of this process read too: at least these three.
        assert!(count() >= before + 3);
    }

    /// Calls that copy tensor values to the host without this helper.
    const DIRECT_READS: [&str; 10] = [
        "double_value(",
        "int64_value(",
        ">::try_from(",
        "Vec::try_from(",
        "f64::try_from(",
        "f32::try_from(",
        "i64::try_from(&",
        ".copy_data(",
        ".is_nonzero(",
        ".equal(",
    ];

    /// The library code (test modules left out: from `#[cfg(test)]` on) of the layers
    /// that run on the device reads tensor values through [`values`] only.
    #[test]
    fn device_code_reads_through_this_helper_only() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut offenders = Vec::new();
        for layer in ["train", "eval", "model", "ddp", "monitor"] {
            let mut files = Vec::new();
            rust_files(&root.join(layer), &mut files);
            assert!(!files.is_empty(), "no sources under src/{layer}");
            for file in files {
                let text = std::fs::read_to_string(&file).unwrap();
                let code = text.split("#[cfg(test)]").next().unwrap_or("");
                for (n, line) in code.lines().enumerate() {
                    let tensor_read = DIRECT_READS.iter().any(|call| line.contains(call))
                        && !line.trim_start().starts_with("//");
                    if tensor_read {
                        offenders.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                    }
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "tensor values read past util::readback:\n{}",
            offenders.join("\n")
        );
    }

    fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
}
