//! VRT (Video Restoration Transformer, Liang et al. 2022) for deblurring (upscale 1,
//! parallel warping of 2 frames), with parameter names and shapes of the reference
//! state_dict; plus the optional spike branch fused after stages 1-4 (VRT-Spike).

use std::sync::Arc;

use tch::{nn, TchError, Tensor};

use super::attention::{GroupSpec, Rtmsa, Tmsag};
use super::checkpoint::Checkpointing;
use super::deform::FlowGuidedDcn;
use super::flow::{flow_warp, SpyNet, WarpMode};
use super::layers::{Conv, LayerNorm, Linear, MlpGeglu};
use super::spike::SpikeBranch;
use super::window::MaskCache;
use super::{AtStage, ModelError, NoMarks, PartMarks, Restorer};
use crate::config::{Arch, ModelConfig};

/// The stage name of a stage's parallel warping (alignment and fusion).
const WARP: &str = "parallel warping";

/// How a stage changes resolution before its attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reshape {
    /// LayerNorm only.
    None,
    /// Pixel-unshuffle by 2, LayerNorm(4 in), Linear(4 in -> dim).
    Down,
    /// Pixel-shuffle by 2, LayerNorm(in / 4), Linear(in / 4 -> dim).
    Up,
}

/// One of stages 1-7: reshape, mutual+self TMSA group, self TMSA group, parallel warping.
#[derive(Debug)]
struct Stage {
    reshape: Reshape,
    norm: LayerNorm,
    reshape_linear: Option<Linear>,
    residual_group1: Tmsag,
    linear1: Linear,
    residual_group2: Tmsag,
    linear2: Linear,
    pa_deform: FlowGuidedDcn,
    pa_fuse: MlpGeglu,
}

/// Settings of one stage.
struct StageSpec {
    in_dim: i64,
    dim: i64,
    depth: i64,
    heads: i64,
    reshape: Reshape,
    max_residue: f64,
    drop_path: Vec<f64>,
}

impl Stage {
    fn new(p: &nn::Path, cfg: &ModelConfig, spec: &StageSpec, masks: &Arc<MaskCache>) -> Stage {
        let rp = p / "reshape";
        let (norm, reshape_linear) = match spec.reshape {
            Reshape::None => (LayerNorm::new(&(&rp / 1), spec.dim), None),
            Reshape::Down => (
                LayerNorm::new(&(&rp / 1), 4 * spec.in_dim),
                Some(Linear::new(&(&rp / 2), 4 * spec.in_dim, spec.dim, true)),
            ),
            Reshape::Up => (
                LayerNorm::new(&(&rp / 1), spec.in_dim / 4),
                Some(Linear::new(&(&rp / 2), spec.in_dim / 4, spec.dim, true)),
            ),
        };
        let mutual_depth = (spec.depth as f64 * cfg.mul_attn_ratio) as i64;
        let [_, wh, ww] = cfg.window_size;
        let group = |depth: i64, window: [i64; 3], mutual: bool| GroupSpec {
            dim: spec.dim,
            depth,
            heads: spec.heads,
            window,
            mutual,
            mlp_ratio: cfg.mlp_ratio,
            qkv_bias: cfg.qkv_bias,
            drop_path: spec.drop_path.clone(),
            checkpointing: Checkpointing::from_config(cfg),
        };
        let g1 = group(mutual_depth, [2, wh, ww], true);
        let g2 = group(spec.depth - mutual_depth, cfg.window_size, false);
        Stage {
            reshape: spec.reshape,
            norm,
            reshape_linear,
            residual_group1: Tmsag::new(&(p / "residual_group1"), &g1, masks.clone()),
            linear1: Linear::new(&(p / "linear1"), spec.dim, spec.dim, true),
            residual_group2: Tmsag::new(&(p / "residual_group2"), &g2, masks.clone()),
            linear2: Linear::new(&(p / "linear2"), spec.dim, spec.dim, true),
            pa_deform: FlowGuidedDcn::new(
                &(p / "pa_deform"),
                spec.dim,
                cfg.deformable_groups,
                spec.max_residue,
            ),
            pa_fuse: MlpGeglu::new(&(p / "pa_fuse"), 3 * spec.dim, 3 * spec.dim, spec.dim),
        }
    }

    /// (N, C, D, H, W) channel-first to channel-last (N, D, H', W', C') after the reshape.
    fn reshape_in(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let s = x.size();
        let (n, c, d, h, w) = (s[0], s[1], s[2], s[3], s[4]);
        let x = match self.reshape {
            Reshape::None => x.f_permute([0, 2, 3, 4, 1])?,
            // 'n c d (h nh) (w nw) -> n d h w (nw nh c)'
            Reshape::Down => x
                .f_view([n, c, d, h / 2, 2, w / 2, 2].as_slice())?
                .f_permute([0, 2, 3, 5, 6, 4, 1])?
                .f_reshape([n, d, h / 2, w / 2, 4 * c])?,
            // 'n (nw nh c) d h w -> n d (h nh) (w nw) c'
            Reshape::Up => x
                .f_view([n, 2, 2, c / 4, d, h, w].as_slice())?
                .f_permute([0, 4, 5, 2, 6, 1, 3])?
                .f_reshape([n, d, 2 * h, 2 * w, c / 4])?,
        };
        let x = self.norm.f_forward(&x)?;
        match &self.reshape_linear {
            Some(linear) => linear.f_forward(&x),
            None => Ok(x),
        }
    }

    /// (N, C_in, D, H, W) to (N, C, D, H', W'); flows (N, D-1, 2, H', W') at this scale.
    fn forward(
        &self,
        x: &Tensor,
        flow_backward: &Tensor,
        flow_forward: &Tensor,
        train: bool,
    ) -> Result<Tensor, ModelError> {
        let x = self.reshape_in(x).at_stage("reshape")?;
        const GROUP1: &str = "TMSA group 1";
        let group = self.residual_group1.forward(&x, train).at_stage(GROUP1)?;
        let x = self.linear1.f_forward(&group).and_then(|y| y.f_add(&x));
        let x = x.at_stage(GROUP1)?;
        const GROUP2: &str = "TMSA group 2";
        let group = self.residual_group2.forward(&x, train).at_stage(GROUP2)?;
        let x = self.linear2.f_forward(&group).and_then(|y| y.f_add(&x));
        let x = x.at_stage(GROUP2)?;
        // Parallel warping on (N, D, C, H, W).
        let frames = x.f_permute([0, 1, 4, 2, 3]).at_stage(WARP)?;
        let (aligned_backward, aligned_forward) = self
            .align(&frames, flow_backward, flow_forward)
            .at_stage(WARP)?;
        let fused = Tensor::f_cat(&[&frames, &aligned_backward, &aligned_forward], 2)
            .and_then(|t| t.f_permute([0, 1, 3, 4, 2]))
            .and_then(|t| self.pa_fuse.f_forward(&t))
            .and_then(|t| t.f_permute([0, 4, 1, 2, 3]));
        fused.at_stage(WARP)
    }

    /// Each frame's neighbours aligned to it: backward (from frame t+1; zeros at the
    /// last frame) and forward (from t-1; zeros at the first), all pairs in one batch.
    fn align(
        &self,
        x: &Tensor,
        flow_backward: &Tensor,
        flow_forward: &Tensor,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let pairs = align_pairs(x, flow_backward, flow_forward, WarpMode::Bilinear)
            .at_stage("flow warping")?;
        let aligned =
            self.pa_deform
                .forward(&pairs.source, &pairs.warped, &pairs.target, &pairs.flow)?;
        split_aligned(&aligned, x).at_stage("flow warping")
    }
}

/// The frame pairs of parallel warping, both directions in one batch: each source
/// frame, the target frame it is aligned to, the flow between them and the source
/// warped by that flow.
struct AlignPairs {
    source: Tensor,
    target: Tensor,
    flow: Tensor,
    warped: Tensor,
}

/// The pairs of `x` (N, D, C, H, W): later-to-earlier (flows backward) then
/// earlier-to-later (flows forward), each source warped by `mode`.
fn align_pairs(
    x: &Tensor,
    flow_backward: &Tensor,
    flow_forward: &Tensor,
    mode: WarpMode,
) -> Result<AlignPairs, TchError> {
    let s = x.size();
    let (n, d, c, h, w) = (s[0], s[1], s[2], s[3], s[4]);
    let pairs = n * (d - 1);
    let flat = |t: &Tensor, ch: i64| t.f_reshape([pairs, ch, h, w]);
    let later = flat(&x.f_narrow(1, 1, d - 1)?, c)?;
    let earlier = flat(&x.f_narrow(1, 0, d - 1)?, c)?;
    let fb = flat(flow_backward, 2)?;
    let ff = flat(flow_forward, 2)?;
    let source = Tensor::f_cat(&[&later, &earlier], 0)?;
    let flow = Tensor::f_cat(&[&fb, &ff], 0)?;
    let warped = flow_warp(&source, &flow, mode)?;
    Ok(AlignPairs {
        target: Tensor::f_cat(&[&earlier, &later], 0)?,
        source,
        flow,
        warped,
    })
}

/// The aligned pairs (2 x N(D-1), C', H, W) back as (N, D, C', H, W) per direction:
/// backward (from frame t+1; zeros at the last frame) and forward (from t-1; zeros
/// at the first).
fn split_aligned(aligned: &Tensor, x: &Tensor) -> Result<(Tensor, Tensor), TchError> {
    let s = x.size();
    let (n, d, h, w) = (s[0], s[1], s[3], s[4]);
    let c = aligned.size()[1];
    let pairs = n * (d - 1);
    let backward = aligned.f_narrow(0, 0, pairs)?.f_view([n, d - 1, c, h, w])?;
    let forward = aligned
        .f_narrow(0, pairs, pairs)?
        .f_view([n, d - 1, c, h, w])?;
    let zeros = Tensor::f_zeros([n, 1, c, h, w], (x.kind(), x.device()))?;
    Ok((
        Tensor::f_cat(&[&backward, &zeros], 1)?,
        Tensor::f_cat(&[&zeros, &forward], 1)?,
    ))
}

/// Flows (backward, forward) at scales 1, 1/2, 1/4, 1/8 (see [`Vrt::flows`]).
pub type Flows = (Vec<Tensor>, Vec<Tensor>);

/// VRT for deblurring, optionally with the spike branch (VRT-Spike).
#[derive(Debug)]
pub struct Vrt {
    in_chans: i64,
    conv_first: Conv,
    spynet: SpyNet,
    stages: Vec<Stage>,
    stage8_norm: LayerNorm,
    stage8_linear: Linear,
    stage8: Vec<Rtmsa>,
    norm: LayerNorm,
    conv_after_body: Linear,
    conv_last: Conv,
    spike: Option<SpikeBranch>,
}

impl Vrt {
    /// Builds the model under `p` from a validated `MODEL` config.
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Result<Vrt, ModelError> {
        let depths = &cfg.vrt_depths;
        let dims = &cfg.embed_dims;
        if depths.len() < 8 || dims.len() != depths.len() || cfg.num_heads.len() != depths.len() {
            return Err(ModelError::Config(
                "VRT_DEPTHS, EMBED_DIMS and NUM_HEADS need equal lengths of at least 8".into(),
            ));
        }
        let total: i64 = depths.iter().sum();
        let dpr: Vec<f64> = (0..total)
            .map(|i| {
                if total > 1 {
                    cfg.drop_path_rate * i as f64 / (total - 1) as f64
                } else {
                    0.0
                }
            })
            .collect();
        let rates = |i: usize| {
            let start: i64 = depths[..i].iter().sum();
            dpr[start as usize..(start + depths[i]) as usize].to_vec()
        };
        let masks = Arc::new(MaskCache::default());
        let in_chans = cfg.in_chans;
        let conv_first = Conv::per_frame(&(p / "conv_first"), in_chans * 9, dims[0]);
        let spynet = SpyNet::new(&(p / "spynet"));
        let (keep, down, up) = (Reshape::None, Reshape::Down, Reshape::Up);
        let reshapes = [keep, down, down, down, up, up, up];
        let scales = [1.0, 2.0, 4.0, 8.0, 4.0, 2.0, 1.0];
        let stages = (0..7)
            .map(|i| {
                let spec = StageSpec {
                    // Stage 1 has no reshape; the reference passes embed_dims[-1], unused.
                    in_dim: if i == 0 {
                        dims[dims.len() - 1]
                    } else {
                        dims[i - 1]
                    },
                    dim: dims[i],
                    depth: depths[i],
                    heads: cfg.num_heads[i],
                    reshape: reshapes[i],
                    max_residue: 10.0 / scales[i],
                    drop_path: rates(i),
                };
                Stage::new(&(p / format!("stage{}", i + 1)), cfg, &spec, &masks)
            })
            .collect();
        let s8 = p / "stage8";
        let stage8_norm = LayerNorm::new(&(&s8 / 0 / 1), dims[6]);
        let stage8_linear = Linear::new(&(&s8 / 0 / 2), dims[6], dims[7], true);
        let [wd, wh, ww] = cfg.window_size;
        let stage8 = (7..depths.len())
            .map(|i| {
                let indep = cfg.indep_reconsts.contains(&(i as i64));
                let spec = GroupSpec {
                    dim: dims[i],
                    depth: depths[i],
                    heads: cfg.num_heads[i],
                    window: if indep { [1, wh, ww] } else { [wd, wh, ww] },
                    mutual: false,
                    mlp_ratio: cfg.mlp_ratio,
                    qkv_bias: cfg.qkv_bias,
                    drop_path: rates(i),
                    checkpointing: Checkpointing::from_config(cfg),
                };
                Rtmsa::new(&(&s8 / (i - 6)), &spec, masks.clone())
            })
            .collect();
        let last = dims[dims.len() - 1];
        let spike = cfg
            .spike
            .enabled
            .then(|| SpikeBranch::new(p, cfg))
            .transpose()?;
        Ok(Vrt {
            in_chans,
            conv_first,
            spynet,
            stages,
            stage8_norm,
            stage8_linear,
            stage8,
            norm: LayerNorm::new(&(p / "norm"), last),
            conv_after_body: Linear::new(&(p / "conv_after_body"), last, dims[0], true),
            conv_last: Conv::per_frame(&(p / "conv_last"), dims[0], in_chans),
            spike,
        })
    }

    /// Flows between neighbours at scales 1, 1/2, 1/4, 1/8: backward[k] is the flow of
    /// frame t to t+1, forward[k] of t+1 to t; each (N, D-1, 2, H/2^k, W/2^k).
    pub fn flows(&self, x: &Tensor) -> Result<Flows, TchError> {
        let s = x.size();
        let (n, d, c, h, w) = (s[0], s[1], s[2], s[3], s[4]);
        let first = x.f_narrow(1, 0, d - 1)?.f_reshape([-1, c, h, w])?;
        let second = x.f_narrow(1, 1, d - 1)?.f_reshape([-1, c, h, w])?;
        // Both directions in one SpyNet batch.
        let all = self.spynet.forward(
            &Tensor::f_cat(&[&first, &second], 0)?,
            &Tensor::f_cat(&[&second, &first], 0)?,
        )?;
        let pairs = n * (d - 1);
        let mut backward = Vec::with_capacity(4);
        let mut forward = Vec::with_capacity(4);
        for (k, flow) in all.iter().enumerate() {
            let shape = [n, d - 1, 2, h >> k, w >> k];
            backward.push(flow.f_narrow(0, 0, pairs)?.f_reshape(shape)?);
            forward.push(flow.f_narrow(0, pairs, pairs)?.f_reshape(shape)?);
        }
        Ok((backward, forward))
    }

    /// Each frame with its neighbours warped by the flow (`nearest4`): (N, D, 9C, H, W).
    fn aligned_input(
        &self,
        x: &Tensor,
        flow_backward: &Tensor,
        flow_forward: &Tensor,
    ) -> Result<Tensor, TchError> {
        let pairs = align_pairs(x, flow_backward, flow_forward, WarpMode::Nearest4)?;
        let (backward, forward) = split_aligned(&pairs.warped, x)?;
        Tensor::f_cat(&[x, &backward, &forward], 2)
    }

    /// Checks the input shapes; returns (N, D, H, W).
    fn check(&self, x: &Tensor, voxels: Option<&Tensor>) -> Result<(), ModelError> {
        let s = x.size();
        if s.len() != 5 || s[2] != self.in_chans {
            return Err(ModelError::Shape(format!(
                "input must be (N, D, {}, H, W), got {s:?}",
                self.in_chans
            )));
        }
        if s[1] < 2 {
            return Err(ModelError::Shape(format!(
                "VRT needs at least 2 frames, got {}",
                s[1]
            )));
        }
        if s[3] % 8 != 0 || s[4] % 8 != 0 || s[3] < 8 || s[4] < 8 {
            return Err(ModelError::Shape(format!(
                "height and width must be positive multiples of 8, got {} x {}",
                s[3], s[4]
            )));
        }
        match (&self.spike, voxels) {
            (Some(branch), Some(v)) => branch.check(v, &s),
            (Some(_), None) => Err(ModelError::Shape(
                "the spike branch is on (MODEL.SPIKE.ENABLED) but no voxels were given".into(),
            )),
            (None, _) => Ok(()),
        }
    }

    /// Stage 8 on stage 7's output plus `x1` (N, C, D, H, W): channel-last (N, D, H, W, C).
    fn stage8(&self, y: &Tensor, train: bool) -> Result<Tensor, ModelError> {
        const STAGE8: &str = "stage 8";
        let y = y.f_permute([0, 2, 3, 4, 1]).at_stage(STAGE8)?;
        let y = self.stage8_norm.f_forward(&y).at_stage(STAGE8)?;
        let mut y = self.stage8_linear.f_forward(&y).at_stage(STAGE8)?;
        for (i, group) in self.stage8.iter().enumerate() {
            y = group
                .forward(&y, train)
                .at_stage(&format!("{STAGE8}, RTMSA group {}", i + 1))?;
        }
        Ok(y)
    }

    /// The restored clip (N, D, C, H, W) from stage 8's output, the first features
    /// and the input `x`.
    fn reconstruct(&self, y: &Tensor, feat: &Tensor, x: &Tensor) -> Result<Tensor, TchError> {
        let body = self
            .conv_after_body
            .f_forward(&self.norm.f_forward(y)?)?
            .f_permute([0, 4, 1, 2, 3])?;
        let out = self
            .conv_last
            .f_forward(&feat.f_add(&body)?)?
            .f_transpose(1, 2)?;
        out.f_add(x)
    }

    /// Sets how the spike branch chunks its per-pixel attention (no effect without it).
    pub fn set_chunks(&mut self, chunks: crate::config::FuseConfig) {
        if let Some(branch) = &mut self.spike {
            branch.set_chunks(chunks);
        }
    }
}

impl Restorer for Vrt {
    fn arch(&self) -> &'static str {
        Arch::VrtSpike.name()
    }

    /// Whether the spike branch is built (`MODEL.SPIKE.ENABLED`).
    fn uses_voxels(&self) -> bool {
        self.spike.is_some()
    }

    fn size_multiple(&self) -> i64 {
        8
    }

    /// Deblurs (N, D, C, H, W) in [0, 1]; `voxels` (N, D, K, Hs, Ws) when the spike
    /// branch is on. Returns (N, D, C, H, W).
    fn forward(
        &self,
        x: &Tensor,
        voxels: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor, ModelError> {
        self.forward_marked(x, voxels, train, &mut NoMarks)
    }

    /// As [`Restorer::forward`], telling `marks` as each part ends (flows, conv_first, spike
    /// encoder, stages 1-8, reconstruction) so a profiler can time them; the parts on
    /// the main path (all but the flows and the spike encoder) pass their output.
    fn forward_marked(
        &self,
        x: &Tensor,
        voxels: Option<&Tensor>,
        train: bool,
        marks: &mut dyn PartMarks,
    ) -> Result<Tensor, ModelError> {
        self.check(x, voxels)?;
        let (backward, forward) = self.flows(x).at_stage("SpyNet flows")?;
        marks.part("spynet");
        let feat = self
            .aligned_input(x, &backward[0], &forward[0])
            .and_then(|input| self.conv_first.f_forward(&input.f_transpose(1, 2)?))
            .at_stage("conv_first")?;
        let feat = marks.output("conv_first", feat)?;
        let spike_feats = match (&self.spike, voxels) {
            (Some(branch), Some(v)) => {
                let feats = branch
                    .encode(v, &x.size(), train)
                    .at_stage("spike encoder")?;
                marks.part("spike_encoder");
                Some(feats)
            }
            _ => None,
        };
        let fuse = |i: usize, y: Tensor| -> Result<Tensor, ModelError> {
            match (&self.spike, &spike_feats) {
                (Some(branch), Some(feats)) => branch
                    .fuse(i, &y, &feats[i])
                    .at_stage(&format!("spike fusion {}", i + 1)),
                _ => Ok(y),
            }
        };
        let stage = |i: usize, y: &Tensor, k: usize| {
            let name = format!("stage {}", i + 1);
            let out = self.stages[i].forward(y, &backward[k], &forward[k], train);
            out.at_stage(&name)
        };
        let skip = |y: Tensor, x: &Tensor, name: &str| y.f_add(x).at_stage(name);
        let x1 = marks.output("stage1", fuse(0, stage(0, &feat, 0)?)?)?;
        let x2 = marks.output("stage2", fuse(1, stage(1, &x1, 1)?)?)?;
        let x3 = marks.output("stage3", fuse(2, stage(2, &x2, 2)?)?)?;
        let x4 = marks.output("stage4", fuse(3, stage(3, &x3, 3)?)?)?;
        let y = marks.output("stage5", stage(4, &x4, 2)?)?;
        let y = marks.output("stage6", stage(5, &skip(y, &x3, "stage 6")?, 1)?)?;
        let y = marks.output("stage7", stage(6, &skip(y, &x2, "stage 7")?, 0)?)?;
        let y = marks.output("stage8", self.stage8(&skip(y, &x1, "stage 8")?, train)?)?;
        let out = self.reconstruct(&y, &feat, x).at_stage("reconstruction")?;
        let out = marks.output("reconstruction", out)?;
        Ok(out)
    }

    /// Top-level parameter groups for summaries: (prefix, label).
    fn parts(&self) -> Vec<(String, String)> {
        let mut parts = vec![
            ("spynet".to_string(), "SpyNet".to_string()),
            ("conv_first".to_string(), "conv_first".to_string()),
        ];
        let labels = [
            "1 (x1)", "2 (x1/2)", "3 (x1/4)", "4 (x1/8)", "5 (x1/4)", "6 (x1/2)", "7 (x1)",
        ];
        for (i, label) in labels.iter().enumerate() {
            parts.push((format!("stage{}", i + 1), format!("stage {label}")));
        }
        parts.push(("stage8".to_string(), "stage 8 (RTMSA)".to_string()));
        parts.push(("norm".to_string(), "norm".to_string()));
        parts.push(("conv_after_body".to_string(), "conv_after_body".to_string()));
        parts.push(("conv_last".to_string(), "conv_last".to_string()));
        if self.spike.is_some() {
            parts.extend(SpikeBranch::parts());
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn an_allocation_failure_is_an_error_naming_the_stage() {
        let mut cfg = crate::model::tiny_vrt_spike().model;
        cfg.spike.enabled = false;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = Vrt::new(&vs.root(), &cfg).unwrap();
        // A zero-stride view of a clip of 2^22 x 2^22 frames: no memory until the
        // first operation that materialises it asks for ~384 TiB, more than any
        // address space, which the CPU allocator refuses at once.
        let side = 1 << 22;
        let huge = Tensor::zeros([1, 1, 1, 1, 1], (Kind::Float, Device::Cpu))
            .expand([1, 2, 3, side, side], false);
        let err = tch::no_grad(|| net.forward(&huge, None, false)).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(err.stage(), Some("SpyNet flows"));
        assert!(err.to_string().starts_with("SpyNet flows: "), "{err}");
    }
}
