//! The findings of a diagnosis, in the order of the user's symptom table (GPU
//! idle, slow forward, cache, data wait, communication, validation), then memory
//! (headroom, a leak), restarts and skipped steps: each with what was measured,
//! the limit it crossed and the change to try.

use super::report::{Area, Diagnosis, Finding, Thresholds};

/// A share as a percentage: `42%`.
pub fn pct(v: f64) -> String {
    format!("{:.0}%", 100.0 * v)
}

/// The findings, in the order of the symptom table, then memory, restarts, stability.
pub fn findings(d: &Diagnosis, limits: &Thresholds) -> Vec<Finding> {
    let mut out = Vec::new();
    let loader_change = "raise DATALOADER.TOTAL_WORKERS and DATALOADER.TRAIN_PREFETCH_FACTOR; \
                         keep DATA.USE_RAM_CACHE on so repeats come from the cache";
    if let Some(util) = d.gpu_util_pct.filter(|u| *u < limits.gpu_util_pct) {
        out.push(Finding {
            area: Area::Loader,
            symptom: "GPU mostly idle".into(),
            measured: format!("{util:.0}% utilisation"),
            limit: format!("< {:.0}%", limits.gpu_util_pct),
            change: loader_change.into(),
        });
    }
    if let Some(fwd) = d.forward_ms.filter(|f| *f > limits.forward_ms) {
        out.push(Finding {
            area: Area::Model,
            symptom: "slow forward pass".into(),
            measured: format!("{fwd:.0} ms forward"),
            limit: format!("> {:.0} ms", limits.forward_ms),
            change: "enable TRAIN.AMP_ENABLED (bf16), use a smaller preset (MODEL.VRT_DEPTHS, \
                     WINDOW_SIZE) or a smaller DATA.CROP_SIZE / DATA.CLIP_LEN; activation \
                     checkpointing trades compute for memory, not speed"
                .into(),
        });
    }
    cache_findings(d, limits, &mut out);
    if let Some(data) = d.time.data_ms.filter(|t| *t > limits.data_time_ms) {
        let share = d
            .time
            .step_ms
            .map(|s| format!(" ({} of the step)", pct(data / s)));
        out.push(Finding {
            area: Area::Loader,
            symptom: "waiting for data".into(),
            measured: format!("{data:.1} ms per step{}", share.unwrap_or_default()),
            limit: format!("> {:.0} ms", limits.data_time_ms),
            change: loader_change.into(),
        });
    }
    if let (Some(comm), Some(step)) = (d.time.comm_ms, d.time.step_ms) {
        if step > 0.0 && comm / step > 0.25 {
            out.push(Finding {
                area: Area::Communication,
                symptom: "gradient synchronisation dominates".into(),
                measured: format!("{comm:.0} ms of {step:.0} ms per step"),
                limit: "> 25% of the step".into(),
                change: "raise TRAIN.GRADIENT_ACCUMULATION_STEPS (fewer syncs per sample) or \
                         use DIST.BACKEND nccl on GPUs"
                    .into(),
            });
        }
    }
    if let Some(share) = d.time.validation_share.filter(|s| *s > limits.val_share) {
        out.push(Finding {
            area: Area::Validation,
            symptom: "validation takes much of the run".into(),
            measured: format!("{} of the time ({:.0} s)", pct(share), d.time.validation_s),
            limit: format!("> {}", pct(limits.val_share)),
            change: "raise LOG.VAL_EVERY_STEPS, or validate on fewer/shorter clips; a larger \
                     DATA.VAL_TILE runs fewer tiles when memory allows"
                .into(),
        });
    }
    memory_findings(d, limits, &mut out);
    run_findings(d, &mut out);
    out
}

fn cache_findings(d: &Diagnosis, limits: &Thresholds, out: &mut Vec<Finding>) {
    let Some(rate) = d.cache_hit_rate.filter(|r| *r < limits.hit_rate) else {
        return;
    };
    let evicting = d.cache_evictions.is_some_and(|e| e > 0);
    out.push(Finding {
        area: Area::Cache,
        symptom: if evicting {
            "cache too small: records evicted before reuse".into()
        } else {
            "low cache hit rate".into()
        },
        measured: format!(
            "{} hit rate, {} evictions",
            pct(rate),
            d.cache_evictions.map_or("?".into(), |e| e.to_string())
        ),
        limit: format!("< {}", pct(limits.hit_rate)),
        change: if evicting {
            "raise DATA.CACHE_SIZE_GB to hold the training set (or lower DATA.CLIP_LEN)".into()
        } else {
            "check DATA.USE_RAM_CACHE is on; a first epoch only fills the cache, so judge \
             the hit rate after it"
                .into()
        },
    });
}

fn memory_findings(d: &Diagnosis, limits: &Thresholds, out: &mut Vec<Finding>) {
    let m = &d.memory;
    if let (Some(growth), Some(peak)) = (m.pss_growth_mb, m.peak_pss_mb) {
        if peak > 0.0 && growth > limits.leak_growth * peak && growth > 64.0 {
            out.push(Finding {
                area: Area::Leak,
                symptom: "process memory grows with steps".into(),
                measured: format!(
                    "Pss +{:.1} MiB per 1,000 steps ({growth:.0} MiB over the run, peak {peak:.0} MiB)",
                    m.pss_slope_mb_per_1k_steps.unwrap_or(0.0)
                ),
                limit: format!("growth > {} of the peak", pct(limits.leak_growth)),
                change: "look for tensors kept across steps (losses stored with their graph, \
                         growing lists); if it stops at the cache size it is the cache filling"
                    .into(),
            });
        }
    }
    let pairs = [
        (m.system_used_gb, m.system_total_gb, "host", "lower DATA.CACHE_SIZE_GB, DATALOADER.TOTAL_WORKERS or TRAIN_PREFETCH_FACTOR"),
        (m.gpu_used_gb, m.gpu_total_gb, "GPU", "lower TRAIN.BATCH_SIZE (raise GRADIENT_ACCUMULATION_STEPS to keep the effective batch), DATA.CROP_SIZE, or enable TRAIN.AMP_ENABLED; set DATA.VAL_TILE for validation"),
    ];
    for (used, total, what, change) in pairs {
        if let (Some(used), Some(total)) = (used, total) {
            if total > 0.0 && used >= limits.memory_used * total {
                out.push(Finding {
                    area: Area::Memory,
                    symptom: format!("little {what} memory headroom"),
                    measured: format!("{used:.1} of {total:.1} GiB used"),
                    limit: format!(">= {}", pct(limits.memory_used)),
                    change: change.into(),
                });
            }
        }
    }
}

fn run_findings(d: &Diagnosis, out: &mut Vec<Finding>) {
    if !d.restarts.is_empty() || !d.restart_causes.is_empty() {
        let oom = d.restart_causes.iter().any(|c| c.contains("out of memory"));
        let killed = d
            .restart_causes
            .iter()
            .any(|c| c.contains("SIGKILL") || c.contains("Killed"));
        out.push(Finding {
            area: Area::Restarts,
            symptom: "the job restarted".into(),
            measured: format!(
                "{} restart(s) at step(s) {}; causes: {}",
                d.restarts.len(),
                d.restarts.iter().map(|r| format!("{:.0}", r.step)).collect::<Vec<_>>().join(", "),
                if d.restart_causes.is_empty() { "not recorded".into() } else { d.restart_causes.join("; ") }
            ),
            limit: "0".into(),
            change: if oom {
                "GPU out of memory: lower TRAIN.BATCH_SIZE or DATA.CROP_SIZE, enable TRAIN.AMP_ENABLED".into()
            } else if killed {
                "killed (often the host OOM killer): lower DATA.CACHE_SIZE_GB or DATALOADER.TOTAL_WORKERS".into()
            } else {
                "read the failing rank's log (logs/rank<N>.log); lower LOG.CKPT_EVERY_STEPS to lose less work per restart".into()
            },
        });
    }
    if d.skipped_steps > 0 {
        out.push(Finding {
            area: Area::Stability,
            symptom: "steps skipped for inf/NaN".into(),
            measured: format!("{} skipped step(s)", d.skipped_steps),
            limit: "0".into(),
            change:
                "lower TRAIN.LR or raise TRAIN.WARMUP_STEPS, set TRAIN.MAX_GRAD_NORM; with fp16 \
                     AMP prefer TRAIN.AMP_DTYPE bf16"
                    .into(),
        });
    }
}
