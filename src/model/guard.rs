//! A narrow net for model parts that still call tch's panicking API (the spike
//! branch's encoder and fusion): [`guarded`] runs such a part
//! and turns a libtorch panic inside it into [`ModelError::Op`] naming the part, so
//! a CUDA out-of-memory there is an error like anywhere else, not a panicking rank.
//! Only a panic whose text is a libtorch error (`TchError`) is turned into an error;
//! any other panic is a bug and unwinds on. The panic hook stays quiet for a caught
//! libtorch panic (no message, no backtrace on stderr).

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Once;

use tch::TchError;

use super::ModelError;

thread_local! {
    /// How many [`guarded`] calls are running on this thread.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// The prefix of tch's panics (it unwraps a `Result<_, TchError>`).
const UNWRAP_PREFIX: &str = "called `Result::unwrap()` on an `Err` value: ";

/// Runs `part` and returns its result; a libtorch panic inside it becomes
/// [`ModelError::Op`] with stage `stage`.
pub fn guarded<T>(
    stage: &str,
    part: impl FnOnce() -> Result<T, ModelError>,
) -> Result<T, ModelError> {
    install_quiet_hook();
    DEPTH.with(|d| d.set(d.get() + 1));
    let outcome = catch_unwind(AssertUnwindSafe(part));
    DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    match outcome {
        Ok(result) => result,
        Err(payload) => match libtorch_message(payload.as_ref()) {
            Some(message) => Err(ModelError::Op {
                stage: stage.to_string(),
                source: TchError::Torch(message),
            }),
            None => resume_unwind(payload),
        },
    }
}

/// The libtorch error a panic payload carries, if it is one.
fn libtorch_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    let text = if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else {
        payload.downcast_ref::<String>()?.clone()
    };
    let error = text.strip_prefix(UNWRAP_PREFIX)?;
    // The Debug form of `TchError::Torch("...")` (escaped); keep it readable.
    let inner = error
        .strip_prefix("Torch(\"")
        .and_then(|rest| rest.strip_suffix("\")"))
        .map(|s| s.replace("\\n", "\n").replace("\\\"", "\""))
        .unwrap_or_else(|| error.to_string());
    Some(inner)
}

/// Installs, once per process, a panic hook that stays silent inside [`guarded`]
/// (the panic becomes an error there) and calls the previous hook elsewhere.
fn install_quiet_hook() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if DEPTH.with(Cell::get) == 0 {
                previous(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_libtorch_panic_becomes_an_op_error_naming_the_stage() {
        let a = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([4, 5], (Kind::Float, Device::Cpu));
        let result = guarded("stage 9 (test)", || Ok(a.matmul(&b)));
        let err = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.starts_with("stage 9 (test): "), "{err}");
        assert!(err.contains("mat1 and mat2 shapes"), "{err}");
        assert!(!err.contains("Result::unwrap"), "{err}");
        // The thread still works, and results pass through.
        let ok = guarded("stage 9", || Ok(a.sum(Kind::Float).double_value(&[])));
        assert_eq!(ok.ok(), Some(0.0));
    }

    #[test]
    fn other_panics_unwind_on() {
        let caught = catch_unwind(|| guarded::<()>("stage", || panic!("a bug")));
        assert!(caught.is_err());
    }
}
