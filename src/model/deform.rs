//! Modulated deformable convolution (DCNv2, torchvision's `deform_conv2d` semantics),
//! built from `grid_sampler` (bilinear, zero padding) and one matrix product, since
//! core libtorch has no deformable convolution; and VRT's flow-guided alignment module.

use tch::{nn, Kind, TchError, Tensor};

use super::checkpoint::checkpoint_one;
use super::flow::sample_at;
use super::layers::{f_leaky_relu, Conv};
use super::{AtStage, ModelError};

/// DCNv2: `x` (B, Cin, H, W), `offset` (B, 2*G*kh*kw, Ho, Wo) as (dy, dx) pairs per
/// group and kernel tap, `mask` (B, G*kh*kw, Ho, Wo), `weight` (Cout, Cin, kh, kw);
/// stride 1, dilation 1, zero padding `padding`. Samples outside the input read 0.
/// The sampling positions are float32 whatever the offsets' dtype (torchvision's
/// kernel runs in float32 under autocast).
pub fn modulated_deform_conv(
    x: &Tensor,
    offset: &Tensor,
    mask: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    padding: i64,
) -> Result<Tensor, TchError> {
    let xs = x.size();
    let (b, cin, h, w) = (xs[0], xs[1], xs[2], xs[3]);
    let ws = weight.size();
    let (cout, kh, kw) = (ws[0], ws[2], ws[3]);
    let taps = kh * kw;
    let os = offset.size();
    let (ho, wo) = (os[2], os[3]);
    let groups = os[1] / (2 * taps);
    let opts = (Kind::Float, offset.device());

    // Positions in float32 whatever the offsets' dtype (see `flow::sample_at`).
    let off = offset
        .f_to_kind(Kind::Float)?
        .f_view([b, groups, taps, 2, ho, wo])?;
    let tap_y = Tensor::f_arange(kh, opts)?.f_repeat_interleave_self_int(kw, 0, None)?;
    let tap_x = Tensor::f_arange(kw, opts)?.f_repeat([kh])?;
    // Tap offset plus output position, minus the padding: (taps, Ho, 1) or (taps, 1, Wo).
    let base = |tap: &Tensor, len: i64, shape: [i64; 3]| {
        tap.f_view([taps, 1, 1])?
            .f_add(&Tensor::f_arange(len, opts)?.f_view(shape)?)?
            .f_sub_scalar(padding as f64)
    };
    let py = off.f_select(3, 0)?.f_add(&base(&tap_y, ho, [1, ho, 1])?)?; // (B, G, taps, Ho, Wo)
    let px = off.f_select(3, 1)?.f_add(&base(&tap_x, wo, [1, 1, wo])?)?;
    // Normalised coordinates for align_corners = false: pixel p -> (2p + 1) / size - 1.
    let normalise = |p: &Tensor, size: i64| {
        p.f_mul_scalar(2.0)?
            .f_add_scalar(1.0)?
            .f_div_scalar(size as f64)?
            .f_sub_scalar(1.0)
    };
    let (gy, gx) = (normalise(&py, h)?, normalise(&px, w)?);
    let grid = Tensor::f_stack(&[gx, gy], -1)?.f_view([b * groups, taps * ho, wo, 2])?;
    let grouped = x.f_reshape([b * groups, cin / groups, h, w])?;
    let sampled = sample_at(&grouped, &grid, 0, 0, false)?;
    let modulated = sampled
        .f_view([b, groups, cin / groups, taps, ho, wo])?
        .f_mul(
            &mask
                .f_view([b, groups, 1, taps, ho, wo])?
                .f_to_kind(x.kind())?,
        )?;
    let columns = modulated.f_reshape([b, cin * taps, ho * wo])?;
    let out = weight
        .f_reshape([cout, cin * taps])?
        .f_matmul(&columns)?
        .f_view([b, cout, ho, wo])?;
    match bias {
        Some(bias) => out.f_add(&bias.f_view([1, cout, 1, 1])?),
        None => Ok(out),
    }
}

/// Flow-guided deformable alignment (BasicVSR++ / VRT `DCNv2PackFlowGuided`, 2 frames):
/// offsets are `max_residue * tanh(conv)` around the flow, the mask a sigmoid.
#[derive(Debug)]
pub struct FlowGuidedDcn {
    weight: Tensor,
    bias: Tensor,
    conv_offset: [Conv; 4],
    max_residue: f64,
}

impl FlowGuidedDcn {
    /// `weight` (dim, dim, 3, 3), `bias`, and `conv_offset.{0,2,4,6}` taking
    /// [warped, current, flow] (2*dim + 2 channels) to 27 * `groups` channels.
    pub fn new(p: &nn::Path, dim: i64, groups: i64, max_residue: f64) -> FlowGuidedDcn {
        let bound = 1.0 / ((dim * 9) as f64).sqrt();
        let weight = p.uniform("weight", &[dim, dim, 3, 3], -bound, bound);
        let bias = p.zeros("bias", &[dim]);
        let co = p / "conv_offset";
        let mut last = Conv::new(&(&co / 6), dim, 27 * groups, &[3, 3], &[1, 1]);
        last.zero_();
        let conv_offset = [
            Conv::new(&(&co / 0), 2 * dim + 2, dim, &[3, 3], &[1, 1]),
            Conv::new(&(&co / 2), dim, dim, &[3, 3], &[1, 1]),
            Conv::new(&(&co / 4), dim, dim, &[3, 3], &[1, 1]),
            last,
        ];
        FlowGuidedDcn {
            weight,
            bias,
            conv_offset,
            max_residue,
        }
    }

    /// Aligns `x` (B, C, H, W) to `current` given `warped` (x warped by `flow`) and the
    /// flow (B, 2, H, W) in pixels (x, y). The deformable convolution keeps only its
    /// inputs for the backward pass and samples again there, as torchvision's kernel
    /// does: its sampled columns are 9x the input and would otherwise stay alive.
    pub fn forward(
        &self,
        x: &Tensor,
        warped: &Tensor,
        current: &Tensor,
        flow: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let (offset, mask) = self
            .offset_and_mask(warped, current, flow)
            .at_stage("deformable offsets")?;
        let (weight, bias) = (self.weight.shallow_clone(), self.bias.shallow_clone());
        checkpoint_one(&[x, &offset, &mask], move |t| {
            modulated_deform_conv(&t[0], &t[1], &t[2], &weight, Some(&bias), 1)
                .at_stage("deformable convolution")
        })
    }

    /// The sampling offsets (around the flow) and the modulation mask.
    fn offset_and_mask(
        &self,
        warped: &Tensor,
        current: &Tensor,
        flow: &Tensor,
    ) -> Result<(Tensor, Tensor), TchError> {
        let mut out = Tensor::f_cat(&[warped, current, flow], 1)?;
        for (i, conv) in self.conv_offset.iter().enumerate() {
            out = conv.f_forward(&out)?;
            if i < 3 {
                out = f_leaky_relu(&out, 0.1)?;
            }
        }
        let parts = out.f_chunk(3, 1)?;
        let offset = Tensor::f_cat(&[&parts[0], &parts[1]], 1)?
            .f_tanh()?
            .f_mul_scalar(self.max_residue)?;
        let pairs = offset.size()[1] / 2;
        let offset = offset.f_add(&flow.f_flip([1])?.f_repeat([1, pairs, 1, 1])?)?;
        Ok((offset, parts[2].f_sigmoid()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Bilinear read of channel plane `c` at (y, x), zero outside (torchvision rules).
    fn bilinear(data: &[f32], h: i64, w: i64, y: f64, x: f64) -> f64 {
        if y <= -1.0 || y >= h as f64 || x <= -1.0 || x >= w as f64 {
            return 0.0;
        }
        let (y0, x0) = (y.floor() as i64, x.floor() as i64);
        let (ly, lx) = (y - y0 as f64, x - x0 as f64);
        let at = |yy: i64, xx: i64| {
            if yy < 0 || yy >= h || xx < 0 || xx >= w {
                0.0
            } else {
                data[(yy * w + xx) as usize] as f64
            }
        };
        (1.0 - ly) * (1.0 - lx) * at(y0, x0)
            + (1.0 - ly) * lx * at(y0, x0 + 1)
            + ly * (1.0 - lx) * at(y0 + 1, x0)
            + ly * lx * at(y0 + 1, x0 + 1)
    }

    /// Plain-loop DCNv2 reference.
    fn reference(
        x: &Tensor,
        offset: &Tensor,
        mask: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        pad: i64,
    ) -> Tensor {
        let s = x.size();
        let (b, cin, h, w) = (s[0], s[1], s[2], s[3]);
        let ws = weight.size();
        let (cout, kh, kw) = (ws[0], ws[2], ws[3]);
        let (ho, wo) = (h + 2 * pad - kh + 1, w + 2 * pad - kw + 1);
        let groups = offset.size()[1] / (2 * kh * kw);
        let xv: Vec<f32> = Vec::try_from(x.flatten(0, -1)).unwrap();
        let ov: Vec<f32> = Vec::try_from(offset.flatten(0, -1)).unwrap();
        let mv: Vec<f32> = Vec::try_from(mask.flatten(0, -1)).unwrap();
        let wv: Vec<f32> = Vec::try_from(weight.flatten(0, -1)).unwrap();
        let bv: Vec<f32> = Vec::try_from(bias).unwrap();
        let mut out = vec![0f32; (b * cout * ho * wo) as usize];
        let cpg = cin / groups;
        for n in 0..b {
            for co in 0..cout {
                for oy in 0..ho {
                    for ox in 0..wo {
                        let mut acc = bv[co as usize] as f64;
                        for ci in 0..cin {
                            let g = ci / cpg;
                            let plane = &xv[((n * cin + ci) * h * w) as usize
                                ..((n * cin + ci + 1) * h * w) as usize];
                            for i in 0..kh {
                                for j in 0..kw {
                                    let k = i * kw + j;
                                    let oidx = |c: i64| {
                                        (((n * 2 * groups * kh * kw + c) * ho + oy) * wo + ox)
                                            as usize
                                    };
                                    let dy = ov[oidx(2 * (g * kh * kw + k))] as f64;
                                    let dx = ov[oidx(2 * (g * kh * kw + k) + 1)] as f64;
                                    let m = mv[(((n * groups * kh * kw + g * kh * kw + k) * ho
                                        + oy)
                                        * wo
                                        + ox)
                                        as usize]
                                        as f64;
                                    let y = (oy - pad + i) as f64 + dy;
                                    let xx = (ox - pad + j) as f64 + dx;
                                    let v = bilinear(plane, h, w, y, xx) * m;
                                    acc += v * wv[(((co * cin + ci) * kh + i) * kw + j) as usize]
                                        as f64;
                                }
                            }
                        }
                        out[(((n * cout + co) * ho + oy) * wo + ox) as usize] = acc as f32;
                    }
                }
            }
        }
        Tensor::from_slice(&out).view([b, cout, ho, wo])
    }

    /// Offsets given in bfloat16 sample at float32 positions: the same output as the
    /// same offsets in float32, at columns up to 300 (bfloat16 positions there are
    /// whole pixels apart).
    #[test]
    fn bfloat16_offsets_sample_at_float32_positions() {
        tch::manual_seed(2);
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::rand([1, 2, 4, 300], opts);
        let offset = (Tensor::rand([1, 18, 4, 300], opts) * 8.0 - 4.0)
            .to_kind(Kind::BFloat16)
            .to_kind(Kind::Float);
        let mask = Tensor::rand([1, 9, 4, 300], opts);
        let weight = Tensor::randn([3, 2, 3, 3], opts);
        let bias = Tensor::zeros([3], opts);
        let f32_offsets =
            modulated_deform_conv(&x, &offset, &mask, &weight, Some(&bias), 1).unwrap();
        let bf16_offsets = modulated_deform_conv(
            &x,
            &offset.to_kind(Kind::BFloat16),
            &mask,
            &weight,
            Some(&bias),
            1,
        )
        .unwrap();
        let diff = (&bf16_offsets - &f32_offsets).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "{diff}");
    }

    #[test]
    fn deform_conv_matches_loop_reference() {
        tch::manual_seed(7);
        let opts = (Kind::Float, Device::Cpu);
        let (b, cin, cout, h, w, groups) = (2, 4, 3, 5, 6, 2);
        let x = Tensor::randn([b, cin, h, w], opts);
        // Offsets up to a few pixels, some landing outside the image.
        let offset = Tensor::randn([b, 2 * groups * 9, h, w], opts) * 2.5;
        let mask = Tensor::rand([b, groups * 9, h, w], opts);
        let weight = Tensor::randn([cout, cin, 3, 3], opts);
        let bias = Tensor::randn([cout], opts);
        let got = modulated_deform_conv(&x, &offset, &mask, &weight, Some(&bias), 1).unwrap();
        let expected = reference(&x, &offset, &mask, &weight, &bias, 1);
        assert_eq!(got.size(), vec![b, cout, h, w]);
        let err = (&got - &expected).abs().max().double_value(&[]);
        assert!(err < 1e-4, "max error {err}");
    }

    #[test]
    fn zero_offset_full_mask_is_a_plain_convolution() {
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::randn([1, 4, 7, 5], opts);
        let weight = Tensor::randn([2, 4, 3, 3], opts);
        let offset = Tensor::zeros([1, 2 * 9, 7, 5], opts);
        let mask = Tensor::ones([1, 9, 7, 5], opts);
        let got = modulated_deform_conv(&x, &offset, &mask, &weight, None, 1).unwrap();
        let conv = x.conv2d(&weight, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1);
        assert!(got.allclose(&conv, 1e-4, 1e-4, false));
    }

    /// Gradients of `forward` (sampling again in the backward pass) and of the same
    /// computation keeping every activation.
    #[test]
    fn recomputed_deform_conv_has_the_same_gradients() {
        tch::manual_seed(3);
        let opts = (Kind::Float, Device::Cpu);
        let vs = nn::VarStore::new(Device::Cpu);
        let dcn = FlowGuidedDcn::new(&vs.root(), 4, 2, 10.0);
        // The last offset conv starts at zero; random weights make offsets matter.
        tch::no_grad(|| {
            for (_, mut t) in vs.variables() {
                let _ = t.normal_(0.0, 0.1);
            }
        });
        let inputs: Vec<Tensor> = [4, 4, 4, 2]
            .iter()
            .map(|&c| (Tensor::randn([2, c, 6, 7], opts) * 2.0).set_requires_grad(true))
            .collect();
        let leaves: Vec<Tensor> = vs
            .trainable_variables()
            .into_iter()
            .chain(inputs.iter().map(Tensor::shallow_clone))
            .collect();
        let grads = |y: Tensor| {
            for mut t in leaves.iter().map(Tensor::shallow_clone) {
                t.zero_grad();
            }
            y.square().sum(Kind::Float).backward();
            leaves.iter().map(|t| t.grad().copy()).collect::<Vec<_>>()
        };
        let [x, warped, current, flow] = [0, 1, 2, 3].map(|i| &inputs[i]);
        let recomputed = grads(dcn.forward(x, warped, current, flow).unwrap());
        let (offset, mask) = dcn.offset_and_mask(warped, current, flow).unwrap();
        let kept =
            modulated_deform_conv(x, &offset, &mask, &dcn.weight, Some(&dcn.bias), 1).unwrap();
        let kept = grads(kept);
        assert_eq!(recomputed.len(), 4 + 10);
        for (a, b) in recomputed.iter().zip(&kept) {
            assert!(a.abs().sum(Kind::Float).double_value(&[]) > 0.0);
            assert!(a.allclose(b, 1e-5, 1e-6, false), "gradients differ");
        }
    }
}
