//! Image quality by the VRT/BasicSR protocol: frames quantised to 8-bit RGB, PSNR
//! over all pixels and channels, SSIM with an 11x11 Gaussian window (sigma 1.5) on
//! the valid region of each channel, averaged over channels. Computed on the
//! frames' device in float32 ([`frame_quality`]: the Gaussian filter as two
//! separable passes of plain multiply-adds, so no convolution kernel's TF32 can
//! round it, and the second moments taken around the mid level 128, where float32
//! keeps them to 1e-5), and summed there over a validation ([`QualityAccumulator`]),
//! read back once at its end. [`psnr_u8`] and [`ssim_u8`] are the protocol in
//! float64 on the CPU, as BasicSR computes it: the reference the device figures are
//! tested against (within 1e-4 dB and 1e-5).

use tch::{Kind, TchError, Tensor};

use crate::util::readback;

/// (…, 3, H, W) in [0, 1] to 8-bit levels as f64 (round half to even, like
/// `np.round`, after clamping), on the CPU.
pub fn quantize_u8(image: &Tensor) -> Tensor {
    (image.to_kind(Kind::Double).clamp(0.0, 1.0) * 255.0)
        .round()
        .to_device(tch::Device::Cpu)
}

/// PSNR in dB of two 8-bit-level images (f64, any equal shapes); infinite when equal.
pub fn psnr_u8(a: &Tensor, b: &Tensor) -> Result<f64, TchError> {
    let mse = readback::scalar(&(a - b).square().mean(Kind::Double))?;
    if mse == 0.0 {
        return Ok(f64::INFINITY);
    }
    Ok(20.0 * (255.0 / mse.sqrt()).log10())
}

/// The 11 taps of the normalised Gaussian (sigma 1.5) whose outer product is
/// SSIM's window.
fn gaussian_taps() -> [f64; 11] {
    let mut taps = [0.0f64; 11];
    for (i, t) in taps.iter_mut().enumerate() {
        let x = i as f64 - 5.0;
        *t = (-(x * x) / (2.0 * 1.5 * 1.5)).exp();
    }
    let sum: f64 = taps.iter().sum();
    taps.map(|t| t / sum)
}

/// The normalised 11x11 Gaussian window (sigma 1.5) as (1, 1, 11, 11) f64.
fn gaussian_window() -> Tensor {
    let k = Tensor::from_slice(&gaussian_taps());
    k.outer(&k).view([1, 1, 11, 11])
}

/// SSIM's constants for 8-bit levels: (0.01 x 255)^2 and (0.03 x 255)^2.
const C1: f64 = 6.5025;
const C2: f64 = 58.5225;

/// SSIM of two 8-bit-level images (C, H, W) f64, H and W at least 11: the mean over
/// channels of each channel's mean SSIM map (float64 on the CPU: the reference).
pub fn ssim_u8(a: &Tensor, b: &Tensor) -> Result<f64, TchError> {
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
    let map = ((mu12 * 2.0 + C1) * (sigma12 * 2.0 + C2))
        / ((mu1_sq + mu2_sq + C1) * (sigma1 + sigma2 + C2));
    // Channels have equal sizes, so the mean of the map is the mean of channel means.
    readback::scalar(&map.mean(Kind::Double))
}

/// (…, 3, H, W) in [0, 1] to 8-bit levels as float32 on its device (quantised in
/// float64 as [`quantize_u8`] does, so the levels are the same).
fn levels(image: &Tensor) -> Result<Tensor, TchError> {
    image
        .f_to_kind(Kind::Double)?
        .f_clamp(0.0, 1.0)?
        .f_mul_scalar(255.0)?
        .f_round()?
        .f_to_kind(Kind::Float)
}

/// The valid 11x11 Gaussian filter of `x` (…, H, W) as two separable passes of
/// multiply-adds (rows, then columns).
fn gaussian_filter(x: &Tensor) -> Result<Tensor, TchError> {
    let taps = gaussian_taps();
    let pass = |x: &Tensor, dim: i64| -> Result<Tensor, TchError> {
        let len = x.size()[dim as usize] - 10;
        let mut out = x.f_narrow(dim, 0, len)?.f_mul_scalar(taps[0])?;
        for (k, tap) in taps.iter().enumerate().skip(1) {
            let _ = out.f_add_(&x.f_narrow(dim, k as i64, len)?.f_mul_scalar(*tap)?)?;
        }
        Ok(out)
    };
    let rank = x.dim() as i64;
    pass(&pass(x, rank - 2)?, rank - 1)
}

/// Per-frame SSIM of level images (D, C, H, W) float32: (D,) float64.
fn ssim_frames(a: &Tensor, b: &Tensor) -> Result<Tensor, TchError> {
    // Second moments around the mid level: the same SSIM, float32 cancels less.
    let (a, b) = (a.f_sub_scalar(128.0)?, b.f_sub_scalar(128.0)?);
    let (mu1, mu2) = (gaussian_filter(&a)?, gaussian_filter(&b)?);
    let sigma1 = gaussian_filter(&a.f_square()?)?.f_sub(&mu1.f_square()?)?;
    let sigma2 = gaussian_filter(&b.f_square()?)?.f_sub(&mu2.f_square()?)?;
    let sigma12 = gaussian_filter(&a.f_mul(&b)?)?.f_sub(&mu1.f_mul(&mu2)?)?;
    let (mu1, mu2) = (mu1.f_add_scalar(128.0)?, mu2.f_add_scalar(128.0)?);
    let luminance = mu1
        .f_mul(&mu2)?
        .f_mul_scalar(2.0)?
        .f_add_scalar(C1)?
        .f_div(&mu1.f_square()?.f_add(&mu2.f_square()?)?.f_add_scalar(C1)?)?;
    let structure = sigma12
        .f_mul_scalar(2.0)?
        .f_add_scalar(C2)?
        .f_div(&sigma1.f_add(&sigma2)?.f_add_scalar(C2)?)?;
    luminance
        .f_mul(&structure)?
        .f_mean_dim(&[1i64, 2, 3][..], false, Kind::Double)
}

/// Per-frame PSNR of level images (D, C, H, W): (D,) float64, infinite where equal.
fn psnr_frames(a: &Tensor, b: &Tensor) -> Result<Tensor, TchError> {
    let mse = a
        .f_sub(b)?
        .f_square()?
        .f_mean_dim(&[1i64, 2, 3][..], false, Kind::Double)?;
    mse.f_reciprocal()?
        .f_mul_scalar(255.0 * 255.0)?
        .f_log10()?
        .f_mul_scalar(10.0)
}

/// The quality of a clip's frames on their device: `output`, `input` and `target`
/// are (D, 3, H, W) in [0, 1]; (D, 3) float64 rows of [PSNR, SSIM, input PSNR].
pub fn frame_quality(output: &Tensor, input: &Tensor, target: &Tensor) -> Result<Tensor, TchError> {
    let (out, inp, tgt) = (levels(output)?, levels(input)?, levels(target)?);
    Tensor::f_stack(
        &[
            psnr_frames(&out, &tgt)?,
            ssim_frames(&out, &tgt)?,
            psnr_frames(&inp, &tgt)?,
        ],
        1,
    )
}

/// Quality sums kept on the device over clips, read back once.
#[derive(Debug, Default)]
pub struct QualityAccumulator {
    /// (4,) float64: [PSNR, SSIM, input PSNR, frames].
    sums: Option<Tensor>,
}

impl QualityAccumulator {
    /// Adds every frame of a clip (see [`frame_quality`]); nothing is read back.
    pub fn add_clip(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        target: &Tensor,
    ) -> Result<(), TchError> {
        let per_frame = frame_quality(output, input, target)?;
        let frames = per_frame.size()[0] as f64;
        let clip = Tensor::f_cat(
            &[
                per_frame.f_sum_dim_intlist(&[0i64][..], false, Kind::Double)?,
                Tensor::f_full([1], frames, (Kind::Double, per_frame.device()))?,
            ],
            0,
        )?;
        self.sums = Some(match self.sums.take() {
            Some(sums) => sums.f_add(&clip)?,
            None => clip,
        });
        Ok(())
    }

    /// The sums on the host (one counted read; zeros when nothing was added).
    pub fn read(&self) -> Result<QualitySums, TchError> {
        match &self.sums {
            Some(sums) => Ok(QualitySums::from_values(&readback::values::<f64>(sums)?)),
            None => Ok(QualitySums::default()),
        }
    }
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
    /// Means per frame: (psnr, ssim, input_psnr); zeros when nothing was added.
    pub fn means(&self) -> (f64, f64, f64) {
        if self.frames == 0 {
            return (0.0, 0.0, 0.0);
        }
        let n = self.frames as f64;
        (self.psnr / n, self.ssim / n, self.input_psnr / n)
    }

    /// As values [psnr, ssim, input_psnr, frames] (for a sum over ranks).
    pub fn to_values(&self) -> [f64; 4] {
        [self.psnr, self.ssim, self.input_psnr, self.frames as f64]
    }

    /// From [`QualitySums::to_values`]'s layout (missing values read as 0).
    pub fn from_values(v: &[f64]) -> QualitySums {
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
        assert!((psnr_u8(&a, &b).unwrap() - expected).abs() < 1e-9);
        assert!(psnr_u8(&a, &a).unwrap().is_infinite());
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
        assert!((ssim_u8(&a, &a).unwrap() - 1.0).abs() < 1e-12);
        let mut expected = 0.0;
        for c in 0..3 {
            let av = Vec::<f64>::try_from(a.get(c).reshape([-1])).unwrap();
            let bv = Vec::<f64>::try_from(b.get(c).reshape([-1])).unwrap();
            expected += ssim_reference(&av, &bv, h, w) / 3.0;
        }
        let got = ssim_u8(&a, &b).unwrap();
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
        let mut acc = QualityAccumulator::default();
        assert_eq!(acc.read().unwrap(), QualitySums::default());
        acc.add_clip(&off, &(&target + 4.0 / 255.0), &target)
            .unwrap();
        let sums = acc.read().unwrap();
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
        assert_eq!(QualitySums::from_values(&sums.to_values()), sums);
    }

    /// A clip of `frames` frames of 3 x `h` x `w` in [0, 1]: smooth gradients, edges
    /// and noise (a target), and a restored and a blurred version of it.
    fn clip(frames: i64, h: i64, w: i64) -> (Tensor, Tensor, Tensor) {
        tch::manual_seed(11);
        let opts = (Kind::Float, tch::Device::Cpu);
        let y = Tensor::linspace(0.0, 1.0, h, opts).view([1, 1, h, 1]);
        let x = Tensor::linspace(0.0, 1.0, w, opts).view([1, 1, 1, w]);
        let bands = (&x * 37.0).sin() * (&y * 23.0).cos() * 0.3;
        let edges = (&x * 5.0).floor().remainder(2.0) * 0.25;
        let target = (bands + edges + &y * 0.4 + Tensor::rand([frames, 3, h, w], opts) * 0.1)
            .clamp(0.0, 1.0);
        let output = (&target + Tensor::randn([frames, 3, h, w], opts) * 0.03).clamp(-0.1, 1.1);
        let blurred = target.avg_pool2d([5, 5], [1, 1], [2, 2], false, true, None::<i64>);
        (output, blurred, target)
    }

    /// The device metrics in float32 equal the float64 reference frame by frame
    /// within 1e-4 dB of PSNR and 1e-5 of SSIM, at a full 720 x 1280 frame too.
    #[test]
    fn float32_device_metrics_equal_the_float64_reference() {
        for (frames, h, w) in [(3, 64, 80), (1, 720, 1280)] {
            let (output, input, target) = clip(frames, h, w);
            let got =
                readback::values::<f64>(&frame_quality(&output, &input, &target).unwrap()).unwrap();
            let (out, inp, tgt) = (
                quantize_u8(&output),
                quantize_u8(&input),
                quantize_u8(&target),
            );
            for d in 0..frames {
                let (o, i, t) = (out.get(d), inp.get(d), tgt.get(d));
                let row = &got[(3 * d) as usize..(3 * d + 3) as usize];
                let want = [
                    psnr_u8(&o, &t).unwrap(),
                    ssim_u8(&o, &t).unwrap(),
                    psnr_u8(&i, &t).unwrap(),
                ];
                let what = format!("{h}x{w} frame {d}: {row:?} vs {want:?}");
                assert!((row[0] - want[0]).abs() < 1e-4, "PSNR {what}");
                assert!((row[1] - want[1]).abs() < 1e-5, "SSIM {what}");
                assert!((row[2] - want[2]).abs() < 1e-4, "input PSNR {what}");
                assert!(
                    want[1] > 0.5 && want[1] < 0.99,
                    "a frame SSIM tells something: {what}"
                );
            }
        }
        // Identical frames: infinite PSNR and SSIM 1, as the reference.
        let (_, _, target) = clip(1, 32, 32);
        let same =
            readback::values::<f64>(&frame_quality(&target, &target, &target).unwrap()).unwrap();
        assert!(
            same[0].is_infinite() && (same[1] - 1.0).abs() < 1e-6,
            "{same:?}"
        );
    }
}
