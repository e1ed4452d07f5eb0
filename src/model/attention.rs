//! VRT's temporal mutual self attention: window attention (self attention with a 3-D
//! relative position bias, plus mutual attention between the two frames of a window),
//! the TMSA block, the TMSA group (alternating cyclic shifts) and stage 8's RTMSA.
//! Attention goes through [`super::sdp::f_sdpa`] so GPUs get fused kernels.
//! Each block's attention and MLP can be activation-checkpointed ([`Checkpointing`]).

use std::sync::Arc;

use tch::{nn, TchError, Tensor};

use super::checkpoint::{checkpoint_one, Checkpointing};
use super::layers::{f_drop_path, trunc_normal, LayerNorm, Linear, MlpGeglu};
use super::sdp::f_sdpa;
use super::window::{
    effective_window, relative_position_index, sine_position_encoding, window_partition,
    window_reverse, MaskCache,
};
use super::{AtStage, ModelError};

/// Queries, keys and values, each (B_, nH, N, hd).
type Heads = (Tensor, Tensor, Tensor);

/// Window attention: self attention with relative position bias and, when `mutual`,
/// mutual attention between the first and second half (frame) of each window.
#[derive(Debug)]
pub struct WindowAttention {
    heads: i64,
    window: [i64; 3],
    bias_table: Tensor,
    position_index: Tensor,
    qkv_self: Linear,
    qkv_mut: Option<(Linear, Tensor)>,
    proj: Linear,
}

impl WindowAttention {
    /// Parameters `relative_position_bias_table`, `qkv_self`, `proj` and, with mutual
    /// attention, `qkv_mut`; buffers `relative_position_index` and `position_bias`.
    pub fn new(
        p: &nn::Path,
        dim: i64,
        window: [i64; 3],
        heads: i64,
        qkv_bias: bool,
        mutual: bool,
    ) -> Self {
        let table = (2 * window[0] - 1) * (2 * window[1] - 1) * (2 * window[2] - 1);
        let bias_table = trunc_normal(p, "relative_position_bias_table", &[table, heads], 0.02);
        let index = relative_position_index(window).to_device(p.device());
        let position_index = p.add("relative_position_index", index, false);
        let qkv_self = Linear::new(&(p / "qkv_self"), dim, 3 * dim, qkv_bias);
        let qkv_mut = mutual.then(|| {
            let pe = sine_position_encoding([window[1], window[2]], dim / 2).to_device(p.device());
            let pe = p.add("position_bias", pe, false);
            (Linear::new(&(p / "qkv_mut"), dim, 3 * dim, qkv_bias), pe)
        });
        let proj_in = if mutual { 2 * dim } else { dim };
        let proj = Linear::new(&(p / "proj"), proj_in, dim, true);
        WindowAttention {
            heads,
            window,
            bias_table,
            position_index,
            qkv_self,
            qkv_mut,
            proj,
        }
    }

    /// The same attention sharing its parameters and buffers (for closures that own them).
    pub fn shallow_clone(&self) -> WindowAttention {
        WindowAttention {
            heads: self.heads,
            window: self.window,
            bias_table: self.bias_table.shallow_clone(),
            position_index: self.position_index.shallow_clone(),
            qkv_self: self.qkv_self.shallow_clone(),
            qkv_mut: self
                .qkv_mut
                .as_ref()
                .map(|(linear, pe)| (linear.shallow_clone(), pe.shallow_clone())),
            proj: self.proj.shallow_clone(),
        }
    }

    /// Splits (B_, N, 3C) into q, k, v of (B_, nH, N, hd).
    fn split_heads(&self, qkv: &Tensor, b: i64, n: i64, c: i64) -> Result<Heads, TchError> {
        let qkv = qkv
            .f_reshape([b, n, 3, self.heads, c / self.heads])?
            .f_permute([2, 0, 3, 1, 4])?;
        Ok((qkv.f_get(0)?, qkv.f_get(1)?, qkv.f_get(2)?))
    }

    /// Attention of (B_, nH, L, hd) queries with an optional (nW, L, S) mask and bias.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        bias: Option<&Tensor>,
    ) -> Result<Tensor, TchError> {
        let s = q.size();
        let (b_, nh, l, hd) = (s[0], s[1], s[2], s[3]);
        let combined = match (mask, bias) {
            (None, None) => None,
            (None, Some(bias)) => Some(bias.f_unsqueeze(0)?),
            (Some(mask), bias) => {
                let nw = mask.size()[0];
                let lm = mask.size()[1];
                let sm = mask.size()[2];
                let m = mask.f_unsqueeze(1)?; // (nW, 1, L, S)
                let m = match bias {
                    Some(bias) => m.f_add(&bias.f_unsqueeze(0)?)?,
                    None => m,
                };
                let heads = m.size()[1];
                let m = m
                    .f_unsqueeze(0)?
                    .f_expand([b_ / nw, nw, heads, lm, sm], false)?;
                Some(m.f_reshape([b_, heads, lm, sm])?)
            }
        };
        let out = f_sdpa(q, k, v, combined.as_ref())?;
        out.f_transpose(1, 2)?.f_reshape([b_, l, nh * hd])
    }

    /// Attention over windows `x` (B_, N, C) with an optional shift mask (nW, N', N');
    /// `window` is the window in use (smaller than the built one on small inputs).
    pub fn forward(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        window: [i64; 3],
    ) -> Result<Tensor, TchError> {
        let s = x.size();
        let (b_, n, c) = (s[0], s[1], s[2]);
        let (q, k, v) = self.split_heads(&self.qkv_self.f_forward(x)?, b_, n, c)?;
        let index = self
            .position_index
            .f_narrow(0, 0, n)?
            .f_narrow(1, 0, n)?
            .f_reshape([-1])?;
        let bias = self
            .bias_table
            .f_index_select(0, &index)?
            .f_reshape([n, n, -1])?
            .f_permute([2, 0, 1])?;
        let mask_n = mask
            .map(|m| m.f_narrow(1, 0, n)?.f_narrow(2, 0, n))
            .transpose()?;
        let mut out = self.attend(&q, &k, &v, mask_n.as_ref(), Some(&bias))?;

        if let Some((qkv_mut, position_bias)) = &self.qkv_mut {
            let half = n / 2;
            let pe = if window[1] == self.window[1] && window[2] == self.window[2] {
                position_bias.shallow_clone()
            } else {
                // The window shrank in H/W (small input): encode the grid actually used.
                // The reference cannot run this case; this keeps small inputs usable.
                sine_position_encoding([window[1], window[2]], c / 2).f_to_device(x.device())?
            };
            let pe = pe.f_to_kind(x.kind())?.f_repeat([1, 2, 1])?;
            let (q, k, v) = self.split_heads(&qkv_mut.f_forward(&x.f_add(&pe)?)?, b_, n, c)?;
            let halves = |t: &Tensor| -> Result<(Tensor, Tensor), TchError> {
                Ok((t.f_narrow(2, 0, half)?, t.f_narrow(2, half, half)?))
            };
            let ((q1, q2), (k1, k2), (v1, v2)) = (halves(&q)?, halves(&k)?, halves(&v)?);
            let mask_h = mask
                .map(|m| m.f_narrow(1, 0, half)?.f_narrow(2, 0, half))
                .transpose()?;
            let x1_aligned = self.attend(&q2, &k1, &v1, mask_h.as_ref(), None)?;
            let x2_aligned = self.attend(&q1, &k2, &v2, mask_h.as_ref(), None)?;
            out = Tensor::f_cat(&[Tensor::f_cat(&[x1_aligned, x2_aligned], 1)?, out], 2)?;
        }
        self.proj.f_forward(&out)
    }
}

/// One TMSA block: pre-norm window attention (shifted on odd blocks) and a GEGLU MLP,
/// both residual with stochastic depth, each optionally checkpointed.
#[derive(Debug)]
pub struct Tmsa {
    part1: AttentionPart,
    part2: FeedForwardPart,
    checkpointing: Checkpointing,
}

/// The attention half of a TMSA block (the reference's `forward_part1`): norm1, padding
/// and cyclic shift, window attention, drop path.
#[derive(Debug)]
struct AttentionPart {
    window: [i64; 3],
    shift: [i64; 3],
    drop_path: f64,
    norm1: LayerNorm,
    attn: WindowAttention,
    masks: Arc<MaskCache>,
}

/// The MLP half of a TMSA block (the reference's `forward_part2`): norm2, GEGLU MLP,
/// drop path.
#[derive(Debug)]
struct FeedForwardPart {
    drop_path: f64,
    norm2: LayerNorm,
    mlp: MlpGeglu,
}

/// Settings shared by the blocks of a TMSA group.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    /// Channels.
    pub dim: i64,
    /// Blocks.
    pub depth: i64,
    /// Heads.
    pub heads: i64,
    /// Window (frames, height, width).
    pub window: [i64; 3],
    /// Mutual + self attention (`false`: self only).
    pub mutual: bool,
    /// MLP hidden width over `dim`.
    pub mlp_ratio: f64,
    /// Bias in q/k/v.
    pub qkv_bias: bool,
    /// Drop path rate of each block (indexed by block; missing entries are 0).
    pub drop_path: Vec<f64>,
    /// Which parts of each block recompute their activations in the backward pass.
    pub checkpointing: Checkpointing,
}

impl Tmsa {
    fn new(
        p: &nn::Path,
        spec: &GroupSpec,
        shift: [i64; 3],
        drop_path: f64,
        masks: Arc<MaskCache>,
    ) -> Tmsa {
        let part1 = AttentionPart {
            window: spec.window,
            shift,
            drop_path,
            norm1: LayerNorm::new(&(p / "norm1"), spec.dim),
            attn: WindowAttention::new(
                &(p / "attn"),
                spec.dim,
                spec.window,
                spec.heads,
                spec.qkv_bias,
                spec.mutual,
            ),
            masks,
        };
        let part2 = FeedForwardPart {
            drop_path,
            norm2: LayerNorm::new(&(p / "norm2"), spec.dim),
            mlp: MlpGeglu::new(
                &(p / "mlp"),
                spec.dim,
                (spec.dim as f64 * spec.mlp_ratio) as i64,
                spec.dim,
            ),
        };
        Tmsa {
            part1,
            part2,
            checkpointing: spec.checkpointing,
        }
    }

    /// (B, D, H, W, C) to the same shape.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, ModelError> {
        const ATTN: &str = "attention";
        const MLP: &str = "MLP";
        let attn = if self.checkpointing.attn {
            let part = self.part1.shallow_clone();
            checkpoint_one(&[x], move |t| part.forward(&t[0], train).at_stage(ATTN))?
        } else {
            self.part1.forward(x, train).at_stage(ATTN)?
        };
        let x = x.f_add(&attn).at_stage(ATTN)?;
        let mlp = if self.checkpointing.ffn {
            let part = self.part2.shallow_clone();
            checkpoint_one(&[&x], move |t| part.forward(&t[0], train).at_stage(MLP))?
        } else {
            self.part2.forward(&x, train).at_stage(MLP)?
        };
        x.f_add(&mlp).at_stage(MLP)
    }
}

impl AttentionPart {
    /// The same part sharing its parameters (for a checkpointed closure).
    fn shallow_clone(&self) -> AttentionPart {
        AttentionPart {
            window: self.window,
            shift: self.shift,
            drop_path: self.drop_path,
            norm1: self.norm1.shallow_clone(),
            attn: self.attn.shallow_clone(),
            masks: self.masks.clone(),
        }
    }

    /// The attention update of (B, D, H, W, C), same shape.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let masks = &self.masks;
        let s = x.size();
        let (b, d, h, w, c) = (s[0], s[1], s[2], s[3], s[4]);
        let (window, shift) = effective_window([d, h, w], self.window, self.shift);
        let x = self.norm1.f_forward(x)?;
        let pad = |len: i64, win: i64| (win - len % win) % win;
        let (pd, ph, pw) = (pad(d, window[0]), pad(h, window[1]), pad(w, window[2]));
        let x = if pd + ph + pw > 0 {
            x.f_constant_pad_nd([0, 0, 0, pw, 0, ph, 0, pd])?
        } else {
            x
        };
        let (dp, hp, wp) = (d + pd, h + ph, w + pw);
        let shifted = shift.iter().any(|&v| v > 0);
        let (x, mask) = if shifted {
            let mask = masks.get([dp, hp, wp], window, shift, x.device())?;
            (
                x.f_roll([-shift[0], -shift[1], -shift[2]], [1, 2, 3])?,
                Some(mask),
            )
        } else {
            (x, None)
        };
        let windows = window_partition(&x, window)?;
        let attended = self.attn.forward(&windows, mask.as_ref(), window)?;
        let x = window_reverse(
            &attended.f_view([-1, window[0], window[1], window[2], c])?,
            window,
            b,
            dp,
            hp,
            wp,
        )?;
        let x = if shifted {
            x.f_roll([shift[0], shift[1], shift[2]], [1, 2, 3])?
        } else {
            x
        };
        let x = if pd + ph + pw > 0 {
            x.f_narrow(1, 0, d)?.f_narrow(2, 0, h)?.f_narrow(3, 0, w)?
        } else {
            x
        };
        f_drop_path(&x, self.drop_path, train)
    }
}

impl FeedForwardPart {
    /// The same part sharing its parameters (for a checkpointed closure).
    fn shallow_clone(&self) -> FeedForwardPart {
        FeedForwardPart {
            drop_path: self.drop_path,
            norm2: self.norm2.shallow_clone(),
            mlp: self.mlp.shallow_clone(),
        }
    }

    /// The MLP update of (B, D, H, W, C), same shape.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let mlp = self.mlp.f_forward(&self.norm2.f_forward(x)?)?;
        f_drop_path(&mlp, self.drop_path, train)
    }
}

/// A group of TMSA blocks, cyclic shift by half a window on odd blocks (`blocks.{i}`).
#[derive(Debug)]
pub struct Tmsag {
    blocks: Vec<Tmsa>,
}

impl Tmsag {
    /// Blocks `blocks.0` .. `blocks.{depth-1}`.
    pub fn new(p: &nn::Path, spec: &GroupSpec, masks: Arc<MaskCache>) -> Tmsag {
        let half = spec.window.map(|v| v / 2);
        let blocks = (0..spec.depth)
            .map(|i| {
                let shift = if i % 2 == 0 { [0, 0, 0] } else { half };
                let rate = spec.drop_path.get(i as usize).copied().unwrap_or(0.0);
                Tmsa::new(&(p / "blocks" / i), spec, shift, rate, masks.clone())
            })
            .collect();
        Tmsag { blocks }
    }

    /// Channel-last (B, D, H, W, C) to the same shape.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, ModelError> {
        let mut x = x.shallow_clone();
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, train).at_stage(&format!("block {i}"))?;
        }
        Ok(x)
    }
}

/// Residual TMSA group of stage 8: `x + linear(residual_group(x))`.
#[derive(Debug)]
pub struct Rtmsa {
    residual_group: Tmsag,
    linear: Linear,
}

impl Rtmsa {
    /// `residual_group` (self attention only) and `linear`.
    pub fn new(p: &nn::Path, spec: &GroupSpec, masks: Arc<MaskCache>) -> Rtmsa {
        Rtmsa {
            residual_group: Tmsag::new(&(p / "residual_group"), spec, masks),
            linear: Linear::new(&(p / "linear"), spec.dim, spec.dim, true),
        }
    }

    /// Channel-last (B, D, H, W, C) to the same shape.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, ModelError> {
        let group = self.residual_group.forward(x, train)?;
        let out = self.linear.f_forward(&group).and_then(|y| x.f_add(&y));
        out.at_stage("linear")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn window_attention_mask_broadcasts_per_window() {
        // B = 2 samples x nW = 3 windows; the mask of window w must apply to windows w of both samples.
        let vs = nn::VarStore::new(Device::Cpu);
        let attn = WindowAttention::new(&(vs.root() / "a"), 8, [1, 2, 2], 2, true, false);
        let x = Tensor::randn([6, 4, 8], (Kind::Float, Device::Cpu));
        let mask = Tensor::randn([3, 4, 4], (Kind::Float, Device::Cpu)) * 10.0;
        let batched = attn.forward(&x, Some(&mask), [1, 2, 2]).unwrap();
        for b in 0..2 {
            for w in 0..3 {
                let one = attn
                    .forward(
                        &x.narrow(0, b * 3 + w, 1),
                        Some(&mask.narrow(0, w, 1)),
                        [1, 2, 2],
                    )
                    .unwrap();
                assert!(batched
                    .narrow(0, b * 3 + w, 1)
                    .allclose(&one, 1e-5, 1e-5, false));
            }
        }
    }

    /// A TMSA group `g` of width 8, 2 heads, window [2, 4, 4], a block per
    /// `drop_path` rate.
    fn small_group(vs: &nn::VarStore, drop_path: Vec<f64>, mutual: bool) -> Tmsag {
        let spec = GroupSpec {
            dim: 8,
            depth: drop_path.len().max(1) as i64,
            heads: 2,
            window: [2, 4, 4],
            mutual,
            mlp_ratio: 2.0,
            qkv_bias: true,
            drop_path,
            checkpointing: Checkpointing::default(),
        };
        Tmsag::new(&(vs.root() / "g"), &spec, Arc::new(MaskCache::default()))
    }

    #[test]
    fn tmsa_group_keeps_shape_and_pads_odd_sizes() {
        let vs = nn::VarStore::new(Device::Cpu);
        let group = small_group(&vs, vec![0.0, 0.1], true);
        let x = Tensor::randn([1, 3, 6, 10, 8], (Kind::Float, Device::Cpu));
        let y = group.forward(&x, false).unwrap();
        assert_eq!(y.size(), x.size());
        assert!(!y.isnan().any().int64_value(&[]) != 0);
        let names = vs.variables();
        assert!(names.contains_key("g.blocks.1.attn.position_bias"));
        assert_eq!(
            names["g.blocks.0.attn.position_bias"].size(),
            vec![1, 16, 8]
        );
        assert_eq!(
            names["g.blocks.0.attn.relative_position_bias_table"].size(),
            vec![3 * 7 * 7, 2]
        );
        assert_eq!(names["g.blocks.0.attn.proj.weight"].size(), vec![8, 16]);
    }

    #[test]
    fn a_failed_allocation_names_the_block_and_part() {
        let vs = nn::VarStore::new(Device::Cpu);
        let group = small_group(&vs, Vec::new(), false);
        // A zero-stride view whose first materialisation (norm1) needs ~512 TiB,
        // more than any address space: the CPU allocator refuses it at once.
        let x = Tensor::zeros([1, 1, 1, 1, 8], (Kind::Float, Device::Cpu))
            .expand([1, 1 << 12, 1 << 16, 1 << 16, 8], false);
        let err = tch::no_grad(|| group.forward(&x, false)).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(err.stage(), Some("block 0, attention"));
        let text = err.within("stage 3, TMSA group 2").to_string();
        assert!(
            text.starts_with("stage 3, TMSA group 2, block 0, attention: "),
            "{text}"
        );
    }
}
