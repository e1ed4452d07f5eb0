//! Image quality by the VRT/BasicSR protocol: frames quantised to 8-bit RGB, PSNR
//! over all pixels and channels, SSIM with an 11x11 Gaussian window (sigma 1.5) on
//! the valid region of each channel, averaged over channels. Sums are kept online
//! (per frame), so validation never holds a list of outputs.

use tch::{Kind, Tensor};

/// (…, 3, H, W) in [0, 1] to 8-bit levels as f64 (round half to even, like
/// `np.round`, after clamping), on the CPU.
pub fn quantize_u8(image: &Tensor) -> Tensor {
    (image.to_kind(Kind::Double).clamp(0.0, 1.0) * 255.0)
        .round()
        .to_device(tch::Device::Cpu)
}

/// PSNR in dB of two 8-bit-level images (f64, any equal shapes); infinite when equal.
pub fn psnr_u8(a: &Tensor, b: &Tensor) -> f64 {
    let mse = (a - b).square().mean(Kind::Double).double_value(&[]);
    if mse == 0.0 {
        return f64::INFINITY;
    }
    20.0 * (255.0 / mse.sqrt()).log10()
}

/// The normalised 11x11 Gaussian window (sigma 1.5) as (1, 1, 11, 11) f64.
fn gaussian_window() -> Tensor {
    let taps: Vec<f64> = (0..11)
        .map(|i| {
            let x = i as f64 - 5.0;
            (-(x * x) / (2.0 * 1.5 * 1.5)).exp()
        })
        .collect();
    let sum: f64 = taps.iter().sum();
    let taps: Vec<f64> = taps.iter().map(|t| t / sum).collect();
    let k = Tensor::from_slice(&taps);
    k.outer(&k).view([1, 1, 11, 11])
}

/// SSIM of two 8-bit-level images (C, H, W) f64, H and W at least 11: the mean over
/// channels of each channel's mean SSIM map.
pub fn ssim_u8(a: &Tensor, b: &Tensor) -> f64 {
    let (c1, c2) = ((0.01f64 * 255.0).powi(2), (0.03f64 * 255.0).powi(2));
    let channels = a.size()[0];
    let window = gaussian_window().expand([channels, 1, 11, 11], false);
    let filter = |x: &Tensor| {
        x.unsqueeze(0)
            .conv2d(&window, None::<Tensor>, [1, 1], [0, 0], [1, 1], channels)
    };
    let (mu1, mu2) = (filter(a), filter(b));
    let (mu1_sq, mu2_sq, mu12) = (mu1.square(), mu2.square(), &mu1 * &mu2);
    let sigma1 = filter(&(a * a)) - &mu1_sq;
    let sigma2 = filter(&(b * b)) - &mu2_sq;
    let sigma12 = filter(&(a * b)) - &mu12;
    let map = ((mu12 * 2.0 + c1) * (sigma12 * 2.0 + c2))
        / ((mu1_sq + mu2_sq + c1) * (sigma1 + sigma2 + c2));
    // Channels have equal sizes, so the mean of the map is the mean of channel means.
    map.mean(Kind::Double).double_value(&[])
}

/// Running sums of validation quality over frames.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QualitySums {
    /// Sum of the output's per-frame PSNR.
    pub psnr: f64,
    /// Sum of the output's per-frame SSIM.
    pub ssim: f64,
    /// Sum of the input's (blurred frame's) per-frame PSNR.
    pub input_psnr: f64,
    /// Frames counted.
    pub frames: u64,
}

impl QualitySums {
    /// Adds every frame of a clip: `output`, `input` and `target` are (D, 3, H, W) in [0, 1].
    pub fn add_clip(&mut self, output: &Tensor, input: &Tensor, target: &Tensor) {
        let (out, inp, tgt) = (quantize_u8(output), quantize_u8(input), quantize_u8(target));
        for d in 0..out.size()[0] {
            let (o, i, t) = (out.get(d), inp.get(d), tgt.get(d));
            self.psnr += psnr_u8(&o, &t);
            self.ssim += ssim_u8(&o, &t);
            self.input_psnr += psnr_u8(&i, &t);
            self.frames += 1;
        }
    }

    /// Means per frame: (psnr, ssim, input_psnr); zeros when nothing was added.
    pub fn means(&self) -> (f64, f64, f64) {
        if self.frames == 0 {
            return (0.0, 0.0, 0.0);
        }
        let n = self.frames as f64;
        (self.psnr / n, self.ssim / n, self.input_psnr / n)
    }

    /// As a tensor [psnr, ssim, input_psnr, frames] (for a sum over ranks).
    pub fn to_tensor(&self) -> Tensor {
        Tensor::from_slice(&[self.psnr, self.ssim, self.input_psnr, self.frames as f64])
    }

    /// From [`QualitySums::to_tensor`]'s layout.
    pub fn from_tensor(t: &Tensor) -> QualitySums {
        let v = Vec::<f64>::try_from(t.to_kind(Kind::Double)).unwrap_or_default();
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        QualitySums {
            psnr: at(0),
            ssim: at(1),
            input_psnr: at(2),
            frames: at(3).round() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SSIM by the formula with plain loops (valid 11x11 windows), for one channel.
    fn ssim_reference(a: &[f64], b: &[f64], h: usize, w: usize) -> f64 {
        let mut g = [0.0f64; 11];
        for (i, v) in g.iter_mut().enumerate() {
            let x = i as f64 - 5.0;
            *v = (-(x * x) / 4.5).exp();
        }
        let s: f64 = g.iter().sum();
        g.iter_mut().for_each(|v| *v /= s);
        let (c1, c2) = (6.5025, 58.5225);
        let mut total = 0.0;
        let mut count = 0.0;
        for y in 0..=h - 11 {
            for x in 0..=w - 11 {
                let (mut ma, mut mb, mut saa, mut sbb, mut sab) = (0.0, 0.0, 0.0, 0.0, 0.0);
                for dy in 0..11 {
                    for dx in 0..11 {
                        let k = g[dy] * g[dx];
                        let (va, vb) = (a[(y + dy) * w + x + dx], b[(y + dy) * w + x + dx]);
                        ma += k * va;
                        mb += k * vb;
                        saa += k * va * va;
                        sbb += k * vb * vb;
                        sab += k * va * vb;
                    }
                }
                let (va, vb, cov) = (saa - ma * ma, sbb - mb * mb, sab - ma * mb);
                total += ((2.0 * ma * mb + c1) * (2.0 * cov + c2))
                    / ((ma * ma + mb * mb + c1) * (va + vb + c2));
                count += 1.0;
            }
        }
        total / count
    }

    #[test]
    fn psnr_of_a_known_mse() {
        let a = Tensor::zeros([3, 4, 4], (Kind::Double, tch::Device::Cpu));
        // Every level off by 5: MSE 25, PSNR = 20 log10(255 / 5).
        let b = &a + 5.0;
        let expected = 20.0 * (255.0f64 / 5.0).log10();
        assert!((psnr_u8(&a, &b) - expected).abs() < 1e-9);
        assert!(psnr_u8(&a, &a).is_infinite());
        // Quantisation: 0.5/255 steps round to even levels, out-of-range clamps.
        let q = quantize_u8(&Tensor::from_slice(&[-0.1f32, 0.0, 1.0 / 255.0, 1.5]));
        assert_eq!(
            Vec::<f64>::try_from(&q).unwrap(),
            vec![0.0, 0.0, 1.0, 255.0]
        );
    }

    #[test]
    fn ssim_matches_a_loop_reference_and_is_one_on_identical_images() {
        tch::manual_seed(3);
        let (h, w) = (16usize, 19usize);
        let a = (Tensor::rand([3, h as i64, w as i64], (Kind::Double, tch::Device::Cpu)) * 255.0)
            .round();
        let noise = Tensor::randn([3, h as i64, w as i64], (Kind::Double, tch::Device::Cpu)) * 20.0;
        let b = (&a + noise).clamp(0.0, 255.0).round();
        assert!((ssim_u8(&a, &a) - 1.0).abs() < 1e-12);
        let mut expected = 0.0;
        for c in 0..3 {
            let av = Vec::<f64>::try_from(a.get(c).reshape([-1])).unwrap();
            let bv = Vec::<f64>::try_from(b.get(c).reshape([-1])).unwrap();
            expected += ssim_reference(&av, &bv, h, w) / 3.0;
        }
        let got = ssim_u8(&a, &b);
        assert!((got - expected).abs() < 1e-9, "{got} vs {expected}");
        assert!(got < 0.999 && got > 0.0, "{got}");
    }

    #[test]
    fn sums_average_per_frame_and_round_trip() {
        let target = Tensor::full(
            [2, 3, 12, 12],
            100.0 / 255.0,
            (Kind::Float, tch::Device::Cpu),
        );
        let off = &target + 2.0 / 255.0;
        let mut sums = QualitySums::default();
        sums.add_clip(&off, &(&target + 4.0 / 255.0), &target);
        let (psnr, ssim, input) = sums.means();
        assert_eq!(sums.frames, 2);
        assert!(
            (psnr - 20.0 * (255.0f64 / 2.0).log10()).abs() < 1e-6,
            "{psnr}"
        );
        assert!(
            (input - 20.0 * (255.0f64 / 4.0).log10()).abs() < 1e-6,
            "{input}"
        );
        assert!(ssim > 0.99 && ssim <= 1.0);
        assert_eq!(QualitySums::from_tensor(&sums.to_tensor()), sums);
    }
}
