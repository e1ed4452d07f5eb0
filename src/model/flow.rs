//! Optical flow for VRT: flow warping (bilinear, or VRT's `nearest4` which stacks the
//! four integer neighbours) and SpyNet (6-level pyramid, ImageNet normalisation
//! buffers) returning flows at scales 1, 1/2, 1/4 and 1/8.

use tch::{nn, Kind, TchError, Tensor};

use super::layers::Conv;

/// How [`flow_warp`] samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarpMode {
    /// Bilinear interpolation, zero outside.
    Bilinear,
    /// Bilinear interpolation, border values outside (SpyNet).
    BilinearBorder,
    /// The four integer neighbours (floor/ceil of x and y), nearest, zero outside:
    /// 4x the channels, ordered (xf,yf), (xf,yc), (xc,yf), (xc,yc).
    Nearest4,
}

/// Warps `x` (N, C, H, W) by `flow` (N, 2, H, W), flow in pixels (x, y), with the
/// reference's coordinate convention (align_corners = true). The sampling positions
/// are computed, and sampled, in float32 whatever the flow's dtype (the result is in
/// `x`'s): in bfloat16 a position near pixel 200 would be rounded to a whole pixel
/// (see [`sample_at`]).
pub fn flow_warp(x: &Tensor, flow: &Tensor, mode: WarpMode) -> Result<Tensor, TchError> {
    let s = x.size();
    let (h, w) = (s[2], s[3]);
    let flow = flow.f_to_kind(Kind::Float)?;
    let opts = (Kind::Float, flow.device());
    let grid_x = Tensor::f_arange(w, opts)?.f_view([1, 1, w])?;
    let grid_y = Tensor::f_arange(h, opts)?.f_view([1, h, 1])?;
    let vx = flow.f_select(1, 0)?.f_add(&grid_x)?;
    let vy = flow.f_select(1, 1)?.f_add(&grid_y)?;
    let norm = |v: &Tensor, len: i64| {
        v.f_mul_scalar(2.0 / (len - 1).max(1) as f64)?
            .f_sub_scalar(1.0)
    };
    let sample = |gx: &Tensor, gy: &Tensor, interp: i64, padding: i64| {
        let grid = Tensor::f_stack(&[gx, gy], 3)?;
        sample_at(x, &grid, interp, padding, true)
    };
    match mode {
        WarpMode::Bilinear => sample(&norm(&vx, w)?, &norm(&vy, h)?, 0, 0),
        WarpMode::BilinearBorder => sample(&norm(&vx, w)?, &norm(&vy, h)?, 0, 1),
        WarpMode::Nearest4 => {
            let (xf, xc) = (norm(&vx.f_floor()?, w)?, norm(&vx.f_ceil()?, w)?);
            let (yf, yc) = (norm(&vy.f_floor()?, h)?, norm(&vy.f_ceil()?, h)?);
            Tensor::f_cat(
                &[
                    sample(&xf, &yf, 1, 0)?,
                    sample(&xf, &yc, 1, 0)?,
                    sample(&xc, &yf, 1, 0)?,
                    sample(&xc, &yc, 1, 0)?,
                ],
                1,
            )
        }
    }
}

/// `grid_sampler` of `x` at `grid` (float32 normalised positions) in float32, the
/// result in `x`'s dtype. The positions must stay float32: bfloat16 keeps 8
/// significant bits, so a position of 200.3 pixels (normalised, 0.56 of a
/// 720-pixel side) would be rounded by up to half a pixel, and the gradient that
/// reaches a flow or an offset through the sampling would come from the wrong
/// place (PyTorch's `grid_sample` promotes to float32 for the same reason when the
/// grid is float32; the reference's grids are).
pub fn sample_at(
    x: &Tensor,
    grid: &Tensor,
    interpolation: i64,
    padding: i64,
    align_corners: bool,
) -> Result<Tensor, TchError> {
    let kind = x.kind();
    let sampled = match kind {
        Kind::Float | Kind::Double => x.f_grid_sampler(
            &grid.f_to_kind(kind)?,
            interpolation,
            padding,
            align_corners,
        )?,
        _ => x.f_to_kind(Kind::Float)?.f_grid_sampler(
            &grid.f_to_kind(Kind::Float)?,
            interpolation,
            padding,
            align_corners,
        )?,
    };
    sampled.f_to_kind(kind)
}

/// One SpyNet level: five 7x7 convolutions (8 -> 32 -> 64 -> 32 -> 16 -> 2) with ReLU.
#[derive(Debug)]
struct BasicModule {
    convs: Vec<Conv>,
}

impl BasicModule {
    fn new(p: &nn::Path) -> BasicModule {
        let p = p / "basic_module";
        let chans = [8, 32, 64, 32, 16, 2];
        let convs = (0..5)
            .map(|i| Conv::new(&(&p / (2 * i)), chans[i], chans[i + 1], &[7, 7], &[3, 3]))
            .collect();
        BasicModule { convs }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let mut x = x.shallow_clone();
        for (i, conv) in self.convs.iter().enumerate() {
            x = conv.f_forward(&x)?;
            if i < 4 {
                x = x.f_relu()?;
            }
        }
        Ok(x)
    }
}

/// SpyNet optical flow (`basic_module.{0..5}`, buffers `mean` and `std`).
#[derive(Debug)]
pub struct SpyNet {
    levels: Vec<BasicModule>,
    mean: Tensor,
    std: Tensor,
}

impl SpyNet {
    /// Six levels and the ImageNet normalisation buffers (1, 3, 1, 1).
    pub fn new(p: &nn::Path) -> SpyNet {
        let levels = (0..6)
            .map(|i| BasicModule::new(&(p / "basic_module" / i)))
            .collect();
        let device = p.device();
        let mean = Tensor::from_slice(&[0.485f32, 0.456, 0.406])
            .view([1, 3, 1, 1])
            .to_device(device);
        let std = Tensor::from_slice(&[0.229f32, 0.224, 0.225])
            .view([1, 3, 1, 1])
            .to_device(device);
        SpyNet {
            levels,
            mean: p.add("mean", mean, false),
            std: p.add("std", std, false),
        }
    }

    /// Flows from `reference` to `support` (both (N, 3, H, W) in [0, 1]) at scales
    /// 1, 1/2, 1/4, 1/8: flow k is (N, 2, H / 2^k, W / 2^k).
    pub fn forward(&self, reference: &Tensor, support: &Tensor) -> Result<Vec<Tensor>, TchError> {
        let s = reference.size();
        let (h, w) = (s[2], s[3]);
        let h_floor = (h + 31) / 32 * 32;
        let w_floor = (w + 31) / 32 * 32;
        let resize = |x: &Tensor| {
            if (h, w) == (h_floor, w_floor) {
                Ok(x.shallow_clone())
            } else {
                x.f_upsample_bilinear2d([h_floor, w_floor], false, None, None)
            }
        };
        let kind = reference.kind();
        let normalise = |x: &Tensor| {
            resize(x)?
                .f_sub(&self.mean.f_to_kind(kind)?)?
                .f_div(&self.std.f_to_kind(kind)?)
        };
        let mut refs = vec![normalise(reference)?];
        let mut sups = vec![normalise(support)?];
        for _ in 0..5 {
            let pool =
                |x: &Tensor| x.f_avg_pool2d([2, 2], [2, 2], [0, 0], false, false, None::<i64>);
            refs.insert(0, pool(&refs[0])?);
            sups.insert(0, pool(&sups[0])?);
        }
        let n = s[0];
        let (h0, w0) = (refs[0].size()[2], refs[0].size()[3]);
        let mut flow = Tensor::f_zeros([n, 2, h0 / 2, w0 / 2], (kind, reference.device()))?;
        let mut flows = Vec::with_capacity(4);
        for level in 0..6 {
            let up = self.upsampled(&flow, &refs[level])?;
            let warped = flow_warp(&sups[level], &up, WarpMode::BilinearBorder)?;
            let input = Tensor::f_cat(&[&refs[level], &warped, &up], 1)?;
            flow = self.levels[level].forward(&input)?.f_add(&up)?;
            if level >= 2 {
                let scale = 1i64 << (5 - level);
                let (oh, ow) = (h / scale, w / scale);
                let out = flow.f_upsample_bilinear2d([oh, ow], false, None, None)?;
                let sx = ow as f64 / (w_floor / scale) as f64;
                let sy = oh as f64 / (h_floor / scale) as f64;
                // In the input's dtype, as the product with its factors was before.
                flows.insert(0, scale_flow(&out, sx, sy)?.f_to_kind(kind)?);
            }
        }
        Ok(flows)
    }

    /// The coarser level's `flow` brought to the size of `level_ref` (N, 3, lh, lw):
    /// upsampled x2 (values x2) and edge-padded by a row/column when odd; zeros when
    /// there is no coarser flow (inputs of 32 px or less).
    fn upsampled(&self, flow: &Tensor, level_ref: &Tensor) -> Result<Tensor, TchError> {
        let (n, kind) = (flow.size()[0], flow.kind());
        let (lh, lw) = (level_ref.size()[2], level_ref.size()[3]);
        let fs = flow.size();
        let mut up = if fs[2] == 0 || fs[3] == 0 {
            Tensor::f_zeros([n, 2, lh, lw], (kind, level_ref.device()))?
        } else {
            flow.f_upsample_bilinear2d([fs[2] * 2, fs[3] * 2], true, None, None)?
                .f_mul_scalar(2.0)?
        };
        if up.size()[2] != lh {
            up = up.f_replication_pad2d([0, 0, 0, 1])?;
        }
        if up.size()[3] != lw {
            up = up.f_replication_pad2d([0, 1, 0, 0])?;
        }
        Ok(up)
    }
}

/// `flow` (N, 2, H, W) with its x values times `sx` and its y values times `sy`,
/// without a tensor of the factors copied from the host (scalars travel as kernel
/// arguments): one multiplication when they are equal, none when both are 1.
fn scale_flow(flow: &Tensor, sx: f64, sy: f64) -> Result<Tensor, TchError> {
    if sx == sy {
        return match sx == 1.0 {
            true => Ok(flow.shallow_clone()),
            false => flow.f_mul_scalar(sx),
        };
    }
    let x = flow.f_narrow(1, 0, 1)?.f_mul_scalar(sx)?;
    let y = flow.f_narrow(1, 1, 1)?.f_mul_scalar(sy)?;
    Tensor::f_cat(&[x, y], 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn integer_flow_shifts_pixels() {
        let x = Tensor::arange(20, (Kind::Float, Device::Cpu)).view([1, 1, 4, 5]);
        let flow = Tensor::zeros([1, 2, 4, 5], (Kind::Float, Device::Cpu));
        let _ = flow.select(1, 0).fill_(1.0); // read from x + 1
        let warped = flow_warp(&x, &flow, WarpMode::Bilinear).unwrap();
        let v: Vec<f32> = Vec::try_from(warped.flatten(0, -1)).unwrap();
        assert_eq!(&v[0..5], &[1.0, 2.0, 3.0, 4.0, 0.0]);
        let near = flow_warp(&x, &(flow * 0.5), WarpMode::Nearest4).unwrap();
        assert_eq!(near.size(), vec![1, 4, 4, 5]);
        let v: Vec<f32> = Vec::try_from(near.get(0).get(2).get(0)).unwrap();
        // x ceil of 0.5 shift = 1 pixel right.
        assert_eq!(v, vec![1.0, 2.0, 3.0, 4.0, 0.0]);
    }

    /// A quarter-pixel flow given in bfloat16 samples a ramp at float32 positions:
    /// column 200 reads 200.25 (with positions in bfloat16 it read 200, whose nearest
    /// representable neighbours are a whole pixel apart).
    #[test]
    fn a_bfloat16_flow_samples_at_float32_positions() {
        let w = 300;
        let x = Tensor::arange(w, (Kind::Float, Device::Cpu))
            .view([1, 1, 1, w])
            .expand([1, 1, 2, w], false)
            .contiguous();
        let flow = Tensor::zeros([1, 2, 2, w], (Kind::Float, Device::Cpu));
        let _ = flow.select(1, 0).fill_(0.25);
        let warped = flow_warp(&x, &flow.to_kind(Kind::BFloat16), WarpMode::Bilinear).unwrap();
        assert_eq!(warped.kind(), Kind::Float, "the result in x's dtype");
        let row: Vec<f32> = Vec::try_from(warped.get(0).get(0).get(0)).unwrap();
        for (i, v) in row.iter().enumerate().take(w as usize - 1) {
            assert!((v - (i as f32 + 0.25)).abs() < 1e-3, "column {i}: {v}");
        }
        // And x in bfloat16: the result in bfloat16, sampled at the same places (below
        // column 64 bfloat16 rounds the ramp and the result by 1/8 each at most).
        let half = flow_warp(&x.to_kind(Kind::BFloat16), &flow, WarpMode::Bilinear).unwrap();
        assert_eq!(half.kind(), Kind::BFloat16);
        let diff = (half.to_kind(Kind::Float) - &warped)
            .narrow(3, 0, 64)
            .abs()
            .max()
            .double_value(&[]);
        assert!(
            diff <= 0.25,
            "{diff}: off by more than two roundings of bfloat16"
        );
    }

    #[test]
    fn spynet_scales_flows_without_a_host_tensor() {
        let flow = Tensor::ones([1, 2, 3, 4], (Kind::Float, Device::Cpu));
        let scaled = scale_flow(&flow, 0.5, 2.0).unwrap();
        assert_eq!(scaled.select(1, 0).mean(Kind::Float).double_value(&[]), 0.5);
        assert_eq!(scaled.select(1, 1).mean(Kind::Float).double_value(&[]), 2.0);
        let same = scale_flow(&flow, 3.0, 3.0).unwrap();
        assert_eq!(same.sum(Kind::Float).double_value(&[]), 3.0 * 24.0);
        assert!(scale_flow(&flow, 1.0, 1.0).unwrap().equal(&flow));
    }

    #[test]
    fn spynet_returns_four_scales() {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = SpyNet::new(&(vs.root() / "spynet"));
        let a = Tensor::rand([2, 3, 48, 40], (Kind::Float, Device::Cpu));
        let flows = tch::no_grad(|| net.forward(&a, &a)).unwrap();
        let sizes: Vec<_> = flows.iter().map(|f| f.size()).collect();
        assert_eq!(
            sizes,
            vec![
                vec![2, 2, 48, 40],
                vec![2, 2, 24, 20],
                vec![2, 2, 12, 10],
                vec![2, 2, 6, 5]
            ]
        );
        let params: i64 = vs
            .trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum();
        assert_eq!(params, 1_440_300);
        assert_eq!(vs.variables().len(), 6 * 10 + 2);
    }
}
