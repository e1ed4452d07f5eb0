//! A step's figures while they stay on the device, and reading them back: each
//! micro-batch's loss and input loss become this rank's sums ([`LocalFigures`]),
//! summed over ranks on the device, joined by the update's gradient norm, skip flag
//! and loss scale into one small float64 tensor a step ([`PendingStep`]); at a log
//! step (or a checkpoint, or the end) every pending step is read back in one read
//! with the optimizer's step counts and the scaler's state ([`read_pending`]).

use tch::{Kind, TchError, Tensor};

use super::optim::StepCounts;
use super::report::SettledStep;
use crate::util::readback;

/// Positions in a step's figures.
const LOSS_SUM: usize = 0;
const BAD_RANKS: usize = 1;
const INPUT_LOSS_SUM: usize = 2;
const GRAD_NORM: usize = 3;
const SKIPPED: usize = 4;
const LOSS_SCALE: usize = 5;
/// The first micro-batch's non-finite flag (this rank's, one a micro-batch).
const MICRO_FLAGS: usize = 6;

/// This rank's part of a step on the device: float64 (3,) [sum of the finite
/// micro-batch losses (0 when one was not finite), 1 when one was not, sum of the
/// input losses], and each micro-batch's flag.
#[derive(Debug)]
pub struct LocalFigures {
    /// What the ranks sum.
    pub sums: Tensor,
    /// 1 for each micro-batch whose loss was inf/NaN, else 0 (float64).
    pub micro_nonfinite: Tensor,
}

impl LocalFigures {
    /// From the micro-batch losses and input losses (0-dim each, divided by the
    /// accumulation), nothing read back.
    pub fn new(losses: &[Tensor], input_losses: &[Tensor]) -> Result<LocalFigures, TchError> {
        let losses = Tensor::f_stack(losses, 0)?.f_to_kind(Kind::Double)?;
        let finite = losses.f_isfinite()?;
        let any_bad = finite.f_logical_not()?.f_any()?;
        let sum = losses
            .f_where_self(&finite, &losses.f_zeros_like()?)?
            .f_sum(Kind::Double)?;
        let sum = sum.f_where_self(&any_bad.f_logical_not()?, &sum.f_zeros_like()?)?;
        let input = Tensor::f_stack(input_losses, 0)?
            .f_to_kind(Kind::Double)?
            .f_sum(Kind::Double)?;
        Ok(LocalFigures {
            sums: Tensor::f_stack(&[sum, any_bad.f_to_kind(Kind::Double)?, input], 0)?,
            micro_nonfinite: finite.f_logical_not()?.f_to_kind(Kind::Double)?,
        })
    }

    /// This rank's flag of a non-finite loss (0-dim float64).
    pub fn nonfinite(&self) -> Result<Tensor, TchError> {
        self.sums.f_select(0, BAD_RANKS as i64)
    }
}

/// A finished step whose figures are still on the device.
#[derive(Debug)]
pub struct PendingStep {
    /// Its number (steps done, it included).
    pub step: u64,
    /// Float64 figures (see the positions above).
    figures: Tensor,
    /// The samples (`sequence/frame+frame`) of each of this rank's micro-batches.
    micro_samples: Vec<Vec<String>>,
}

/// What the update left on the device, for [`PendingStep::new`].
pub struct UpdateFigures<'a> {
    /// The gradient norm before clipping (0-dim).
    pub grad_norm: &'a Tensor,
    /// 1 when skipped (0-dim).
    pub skipped: &'a Tensor,
    /// The loss scale after the step ((1,) float64).
    pub loss_scale: &'a Tensor,
}

impl PendingStep {
    /// Step `step` from the sums over ranks `global` ((3,) float64, as
    /// [`LocalFigures::sums`]), this rank's `local` figures and the update.
    pub fn new(
        step: u64,
        global: &Tensor,
        local: &LocalFigures,
        update: UpdateFigures<'_>,
        micro_samples: Vec<Vec<String>>,
    ) -> Result<PendingStep, TchError> {
        let scalar = |t: &Tensor| t.f_to_kind(Kind::Double)?.f_view([1]);
        let figures = Tensor::f_cat(
            &[
                global.shallow_clone(),
                scalar(update.grad_norm)?,
                scalar(update.skipped)?,
                update.loss_scale.shallow_clone(),
                local.micro_nonfinite.shallow_clone(),
            ],
            0,
        )?;
        Ok(PendingStep {
            step,
            figures,
            micro_samples,
        })
    }
}

/// A settled step with the samples of this rank's micro-batches whose loss was not
/// finite.
#[derive(Debug, Clone, PartialEq)]
pub struct Settled {
    /// The step's figures.
    pub figures: SettledStep,
    /// Samples of this rank's non-finite micro-batches.
    pub bad_samples: Vec<String>,
}

/// Everything read back at a settle.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadBack {
    /// The pending steps, in order.
    pub steps: Vec<Settled>,
    /// The optimizer's step counts.
    pub counts: StepCounts,
    /// The loss scaler's [scale, good steps].
    pub scaler: [f64; 2],
}

/// Reads `pending` (then emptied), the optimizer's `counts` ((2,) float64) and the
/// scaler's `scaler` state ((2,) float64) back in one read; `world` ranks.
pub fn read_pending(
    pending: &mut Vec<PendingStep>,
    counts: &Tensor,
    scaler: &Tensor,
    world: usize,
) -> Result<ReadBack, TchError> {
    let mut parts: Vec<Tensor> = pending.iter().map(|p| p.figures.shallow_clone()).collect();
    parts.push(counts.shallow_clone());
    parts.push(scaler.shallow_clone());
    let lengths: Vec<usize> = parts.iter().map(|p| p.numel()).collect();
    let device = counts.device();
    let parts = parts
        .iter()
        .map(|p| p.f_to_device(device))
        .collect::<Result<Vec<_>, _>>()?;
    let values = readback::values::<f64>(&Tensor::f_cat(&parts, 0)?)?;
    let mut at = 0;
    let mut slices = lengths.iter().map(|n| {
        let slice = &values[at..at + n];
        at += n;
        slice
    });
    let mut steps = Vec::with_capacity(pending.len());
    for p in pending.drain(..) {
        let v = slices.next().unwrap_or(&[]);
        steps.push(settle_one(&p, v, world));
    }
    let counts = slices.next().unwrap_or(&[]);
    let scaler = slices.next().unwrap_or(&[]);
    let get = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(f64::NAN);
    Ok(ReadBack {
        steps,
        counts: StepCounts {
            main: get(counts, 0).round() as u64,
            fixed: get(counts, 1).round() as u64,
        },
        scaler: [get(scaler, 0), get(scaler, 1)],
    })
}

/// One step's figures from its values `v`.
fn settle_one(p: &PendingStep, v: &[f64], world: usize) -> Settled {
    let get = |i: usize| v.get(i).copied().unwrap_or(f64::NAN);
    let bad_ranks = get(BAD_RANKS);
    let good_ranks = world as f64 - bad_ranks;
    let skipped = get(SKIPPED) != 0.0;
    let bad_samples = p
        .micro_samples
        .iter()
        .enumerate()
        .filter(|(i, _)| get(MICRO_FLAGS + i) != 0.0)
        .flat_map(|(_, samples)| samples.iter().cloned())
        .collect();
    Settled {
        figures: SettledStep {
            step: p.step,
            mean_loss: if good_ranks > 0.0 {
                get(LOSS_SUM) / good_ranks
            } else {
                f64::NAN
            },
            input_loss: get(INPUT_LOSS_SUM) / world as f64,
            grad_norm: if skipped { f64::NAN } else { get(GRAD_NORM) },
            skipped,
            nonfinite_loss: bad_ranks > 0.0,
            loss_scale: get(LOSS_SCALE),
        },
        bad_samples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: f32) -> Tensor {
        Tensor::from(v)
    }

    #[test]
    fn pending_steps_read_back_in_one_read() {
        // Two micro-batches, the second non-finite: the rank's loss counts 0.
        let bad = LocalFigures::new(&[t(0.25), t(f32::NAN)], &[t(0.5), t(0.25)]).unwrap();
        let good = LocalFigures::new(&[t(0.125), t(0.25)], &[t(0.5), t(0.5)]).unwrap();
        assert_eq!(
            readback::values::<f64>(&bad.sums).unwrap(),
            vec![0.0, 1.0, 0.75]
        );
        assert_eq!(
            readback::values::<f64>(&good.sums).unwrap(),
            vec![0.375, 0.0, 1.0]
        );
        // Two ranks: their sums, as the all-reduce gives them.
        let global = &bad.sums + &good.sums;
        let scale = Tensor::from_slice(&[1024.0f64]);
        let samples = |n: &str| vec![vec![format!("{n}/a")], vec![format!("{n}/b")]];
        let update = |norm: f32, skipped: f32| {
            let (norm, skipped) = (t(norm), t(skipped));
            (norm, skipped)
        };
        let (n1, s1) = update(2.0, 1.0);
        let (n2, s2) = update(3.0, 0.0);
        let mut pending = vec![
            PendingStep::new(
                7,
                &global,
                &bad,
                UpdateFigures {
                    grad_norm: &n1,
                    skipped: &s1,
                    loss_scale: &scale,
                },
                samples("x"),
            )
            .unwrap(),
            PendingStep::new(
                8,
                &(&good.sums * 2.0),
                &good,
                UpdateFigures {
                    grad_norm: &n2,
                    skipped: &s2,
                    loss_scale: &scale,
                },
                samples("y"),
            )
            .unwrap(),
        ];
        let before = readback::count();
        let read = read_pending(
            &mut pending,
            &Tensor::from_slice(&[5.0f64, 2.0]),
            &Tensor::from_slice(&[1024.0f64, 3.0]),
            2,
        )
        .unwrap();
        assert!(readback::count() > before);
        assert!(pending.is_empty());
        assert_eq!(read.counts, StepCounts { main: 5, fixed: 2 });
        assert_eq!(read.scaler, [1024.0, 3.0]);
        let (a, b) = (&read.steps[0], &read.steps[1]);
        assert_eq!(a.figures.step, 7);
        assert_eq!(
            a.figures.mean_loss, 0.375,
            "the finite rank's loss over one rank"
        );
        assert!(a.figures.skipped && a.figures.nonfinite_loss && a.figures.grad_norm.is_nan());
        assert_eq!(a.figures.input_loss, 1.75 / 2.0);
        assert_eq!(a.bad_samples, vec!["x/b".to_string()]);
        assert_eq!(b.figures.mean_loss, 0.375);
        assert_eq!((b.figures.grad_norm, b.figures.skipped), (3.0, false));
        assert_eq!(b.figures.loss_scale, 1024.0);
        assert!(b.bad_samples.is_empty());
    }
}
