//! Parameter counts of a model, per top-level part (SpyNet, stages, spike branch) and
//! in total, split into trainable parameters and buffers.

use serde::Serialize;
use tch::nn;

/// Counts of one part of the model.
#[derive(Debug, Clone, Serialize)]
pub struct PartCount {
    /// Name prefix of the part's variables (`stage3`).
    pub prefix: String,
    /// Human label (`stage 3 (x1/4)`).
    pub label: String,
    /// Trainable scalars.
    pub params: i64,
    /// Trainable tensors.
    pub tensors: usize,
}

/// Counts of a whole model.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// `MODEL.ARCH`.
    pub arch: String,
    /// Per part, in model order.
    pub parts: Vec<PartCount>,
    /// All trainable scalars.
    pub total_params: i64,
    /// State-dict entries (parameters and buffers).
    pub entries: usize,
    /// Buffer entries (`mean`, `std`, `relative_position_index`, `position_bias`).
    pub buffers: usize,
}

/// Counts the variables of `vs` for the parts (prefix, label) given; variables outside
/// every part are counted under `other`.
pub fn summarize(vs: &nn::VarStore, arch: &str, parts: &[(String, String)]) -> Summary {
    let variables = vs.variables();
    let mut counts: Vec<PartCount> = parts
        .iter()
        .map(|(prefix, label)| PartCount {
            prefix: prefix.clone(),
            label: label.clone(),
            params: 0,
            tensors: 0,
        })
        .collect();
    let mut other = PartCount {
        prefix: String::new(),
        label: "other".into(),
        params: 0,
        tensors: 0,
    };
    let mut total = 0;
    let mut buffers = 0;
    for (name, t) in &variables {
        if !t.requires_grad() {
            buffers += 1;
            continue;
        }
        let n = t.numel() as i64;
        total += n;
        let part = counts.iter_mut().find(|p| {
            name.strip_prefix(p.prefix.as_str())
                .is_some_and(|rest| rest.starts_with('.'))
        });
        let part = part.unwrap_or(&mut other);
        part.params += n;
        part.tensors += 1;
    }
    if other.tensors > 0 {
        counts.push(other);
    }
    Summary {
        arch: arch.to_string(),
        parts: counts,
        total_params: total,
        entries: variables.len(),
        buffers,
    }
}
