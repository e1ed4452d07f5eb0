//! `unet_spike`: a compact spike-fused U-Net for CPU runs and tests. Each frame's RGB
//! and its voxel bins (resized to the RGB size) go through a 2-D U-Net (Conv3d with
//! (1,3,3) kernels) with one temporal (3,3,3) block at the bottleneck; the output is a
//! residual added to the blurred frames.

use tch::{nn, TchError, Tensor};

use super::layers::{f_leaky_relu, Conv};
use super::{AtStage, ModelError, Restorer};
use crate::config::{Arch, ModelConfig};

/// The compact U-Net (`head`, `down.{l}`, `mid`, `up.{l}`, `tail`).
#[derive(Debug)]
pub struct UnetSpike {
    in_chans: i64,
    bins: Option<i64>,
    levels: i64,
    head: Conv,
    down: Vec<(Conv, Conv)>,
    mid: (Conv, Conv),
    up: Vec<(Conv, Conv)>,
    tail: Conv,
}

impl UnetSpike {
    /// Builds from `MODEL.UNET` (channels, levels), `IN_CHANS` and `SPIKE`.
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Result<UnetSpike, ModelError> {
        let c = cfg.unet.channels;
        let levels = cfg.unet.levels;
        if c < 1 || !(1..=5).contains(&levels) {
            return Err(ModelError::Config(
                "UNET.CHANNELS >= 1 and UNET.LEVELS in 1..=5".into(),
            ));
        }
        let bins = cfg.spike.enabled.then_some(cfg.spike.voxel_bins);
        let input = cfg.in_chans + bins.unwrap_or(0);
        let width = |l: i64| c << l;
        let head = Conv::per_frame(&(p / "head"), input, c);
        let down = (0..levels)
            .map(|l| {
                let dp = p / "down" / l;
                (
                    Conv::down_frame(&(&dp / "conv"), width(l), width(l + 1)),
                    Conv::per_frame(&(&dp / "refine"), width(l + 1), width(l + 1)),
                )
            })
            .collect();
        let mid_conv = |name| {
            let w = width(levels);
            Conv::new(&(p / "mid" / name), w, w, &[3, 3, 3], &[1, 1, 1])
        };
        let mid = (mid_conv("conv1"), mid_conv("conv2"));
        let up = (0..levels)
            .map(|l| {
                let up = p / "up" / l;
                (
                    Conv::per_frame(&(&up / "conv"), width(l + 1), width(l)),
                    Conv::per_frame(&(&up / "refine"), width(l), width(l)),
                )
            })
            .collect();
        let tail = Conv::per_frame(&(p / "tail"), c, cfg.in_chans);
        Ok(UnetSpike {
            in_chans: cfg.in_chans,
            bins,
            levels,
            head,
            down,
            mid,
            up,
            tail,
        })
    }

    fn check(&self, blur: &Tensor, voxels: Option<&Tensor>) -> Result<(), ModelError> {
        let s = blur.size();
        let m = 1i64 << self.levels;
        if s.len() != 5
            || s[2] != self.in_chans
            || s[3] % m != 0
            || s[4] % m != 0
            || s[3] == 0
            || s[4] == 0
        {
            return Err(ModelError::Shape(format!(
                "input must be (N, D, {}, H, W) with H and W positive multiples of {m}, got {s:?}",
                self.in_chans
            )));
        }
        match (self.bins, voxels) {
            (Some(k), Some(v)) => {
                let vs = v.size();
                if vs.len() != 5
                    || vs[0] != s[0]
                    || vs[1] != s[1]
                    || vs[2] != k
                    || vs[3] < 1
                    || vs[4] < 1
                {
                    return Err(ModelError::Shape(format!(
                        "voxels must be (N={}, D={}, K={k}, Hs, Ws), got {vs:?}",
                        s[0], s[1]
                    )));
                }
                Ok(())
            }
            (Some(_), None) => Err(ModelError::Shape(
                "MODEL.SPIKE.ENABLED is true but no voxels were given".into(),
            )),
            (None, _) => Ok(()),
        }
    }

    /// The blur with the voxels (resized to the frames) stacked on its channels.
    fn input(&self, blur: &Tensor, voxels: Option<&Tensor>) -> Result<Tensor, TchError> {
        let s = blur.size();
        let (n, d, h, w) = (s[0], s[1], s[3], s[4]);
        let (Some(k), Some(v)) = (self.bins, voxels) else {
            return Ok(blur.shallow_clone());
        };
        let vs = v.size();
        let v = v.f_to_kind(blur.kind())?;
        let v = if (vs[3], vs[4]) == (h, w) {
            v
        } else {
            v.f_reshape([n * d, k, vs[3], vs[4]])?
                .f_upsample_bilinear2d([h, w], false, None, None)?
                .f_view([n, d, k, h, w])?
        };
        Tensor::f_cat(&[blur, &v], 2)
    }

    /// Encoder, middle and decoder on `input`; the output is `blur` plus the residual.
    fn body(&self, input: &Tensor, blur: &Tensor) -> Result<Tensor, TchError> {
        let act = |x: Tensor| f_leaky_relu(&x, 0.1);
        let mut x = act(self.head.f_forward(&input.f_transpose(1, 2)?)?)?;
        let mut skips = Vec::with_capacity(self.down.len());
        for (conv, refine) in &self.down {
            skips.push(x.shallow_clone());
            x = act(conv.f_forward(&x)?)?;
            x = x.f_add(&act(refine.f_forward(&x)?)?)?;
        }
        let mid = self.mid.1.f_forward(&act(self.mid.0.f_forward(&x)?)?)?;
        x = x.f_add(&mid)?;
        for ((conv, refine), skip) in self.up.iter().zip(skips.iter()).rev() {
            let ss = skip.size();
            let up = x.f_upsample_nearest3d([ss[2], ss[3], ss[4]], None, None, None)?;
            x = act(conv.f_forward(&up)?)?.f_add(skip)?;
            x = x.f_add(&act(refine.f_forward(&x)?)?)?;
        }
        let residual = self.tail.f_forward(&x)?.f_transpose(1, 2)?;
        residual.f_add(blur)
    }
}

impl Restorer for UnetSpike {
    fn arch(&self) -> &'static str {
        Arch::UnetSpike.name()
    }

    /// Whether the model takes voxels (`MODEL.SPIKE.ENABLED`).
    fn uses_voxels(&self) -> bool {
        self.bins.is_some()
    }

    /// Heights and widths must be multiples of this (`2^LEVELS`).
    fn size_multiple(&self) -> i64 {
        1 << self.levels
    }

    /// Parameter groups for summaries.
    fn parts(&self) -> Vec<(String, String)> {
        ["head", "down", "mid", "up", "tail"]
            .iter()
            .map(|s| (s.to_string(), s.to_string()))
            .collect()
    }

    /// (N, D, C, H, W) blur (+ voxels (N, D, K, Hs, Ws)) to the restored clip.
    fn forward(
        &self,
        blur: &Tensor,
        voxels: Option<&Tensor>,
        _train: bool,
    ) -> Result<Tensor, ModelError> {
        self.check(blur, voxels)?;
        let input = self.input(blur, voxels).at_stage("U-Net input")?;
        self.body(&input, blur).at_stage("U-Net")
    }
}
