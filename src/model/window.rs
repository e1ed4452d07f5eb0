//! 3-D (T, H, W) window helpers of VRT's attention: partition and reverse, the
//! window shrunk to small inputs, the cyclic-shift masks, the relative position
//! index and the sine position encoding of mutual attention.

use std::collections::HashMap;
use std::sync::Mutex;

use tch::{Device, Kind, TchError, Tensor};

/// Cuts (B, D, H, W, C) into windows: (B * nW, wd * wh * ww, C), batch outermost.
/// D, H and W must be multiples of the window.
pub fn window_partition(x: &Tensor, window: [i64; 3]) -> Result<Tensor, TchError> {
    let s = x.size();
    let (b, d, h, w, c) = (s[0], s[1], s[2], s[3], s[4]);
    let [wd, wh, ww] = window;
    x.f_view([b, d / wd, wd, h / wh, wh, w / ww, ww, c].as_slice())?
        .f_permute([0, 1, 3, 5, 2, 4, 6, 7])?
        .f_contiguous()?
        .f_view([-1, wd * wh * ww, c])
}

/// Inverse of [`window_partition`]: (B * nW, wd * wh * ww, C) to (B, D, H, W, C).
pub fn window_reverse(
    windows: &Tensor,
    window: [i64; 3],
    b: i64,
    d: i64,
    h: i64,
    w: i64,
) -> Result<Tensor, TchError> {
    let [wd, wh, ww] = window;
    windows
        .f_view([b, d / wd, h / wh, w / ww, wd, wh, ww, -1].as_slice())?
        .f_permute([0, 1, 4, 2, 5, 3, 6, 7])?
        .f_contiguous()?
        .f_view([b, d, h, w, -1])
}

/// The window and shift used for an input of `size` (D, H, W): a dimension no larger
/// than the window uses its whole extent and no shift.
pub fn effective_window(size: [i64; 3], window: [i64; 3], shift: [i64; 3]) -> ([i64; 3], [i64; 3]) {
    let mut use_window = window;
    let mut use_shift = shift;
    for i in 0..3 {
        if size[i] <= window[i] {
            use_window[i] = size[i];
            use_shift[i] = 0;
        }
    }
    (use_window, use_shift)
}

/// Python's `range(len)[start:stop]` for the start/stop values the mask uses.
fn py_slice(start: Option<i64>, stop: Option<i64>, len: i64) -> std::ops::Range<i64> {
    let norm = |v: i64| if v < 0 { (len + v).max(0) } else { v.min(len) };
    let lo = start.map_or(0, norm);
    let hi = stop.map_or(len, norm);
    lo..hi.max(lo)
}

/// Region labels of the shifted-window mask over a padded volume (Dp, Hp, Wp), built
/// exactly as the reference does (including its slicing when a shift is 0).
fn region_labels(padded: [i64; 3], window: [i64; 3], shift: [i64; 3]) -> Vec<f32> {
    let [dp, hp, wp] = padded;
    let mut labels = vec![0f32; (dp * hp * wp) as usize];
    let slices = |i: usize, len: i64| {
        [
            py_slice(None, Some(-window[i]), len),
            py_slice(Some(-window[i]), Some(-shift[i]), len),
            py_slice(Some(-shift[i]), None, len),
        ]
    };
    let mut count = 0f32;
    for ds in slices(0, dp) {
        for hs in slices(1, hp) {
            for ws in slices(2, wp) {
                for d in ds.clone() {
                    for h in hs.clone() {
                        for w in ws.clone() {
                            labels[((d * hp + h) * wp + w) as usize] = count;
                        }
                    }
                }
                count += 1.0;
            }
        }
    }
    labels
}

/// The additive attention mask of shifted windows: (nW, N, N), 0 within a region and
/// -100 across regions, for a padded volume (Dp, Hp, Wp).
pub fn shift_mask(
    padded: [i64; 3],
    window: [i64; 3],
    shift: [i64; 3],
    device: Device,
) -> Result<Tensor, TchError> {
    let labels = region_labels(padded, window, shift);
    let [dp, hp, wp] = padded;
    let volume = Tensor::f_from_slice(&labels)?.f_view([1, dp, hp, wp, 1])?;
    let windows = window_partition(&volume, window)?.f_squeeze_dim(-1)?;
    let diff = windows.f_unsqueeze(1)?.f_sub(&windows.f_unsqueeze(2)?)?;
    let mask = diff
        .f_ne(0.0)?
        .f_to_kind(Kind::Float)?
        .f_mul_scalar(-100.0)?;
    mask.f_to_device(device)
}

/// Caches shift masks by (padded size, window, shift, device), as the reference's
/// `lru_cache` does; shared by all groups of a model.
#[derive(Debug, Default)]
pub struct MaskCache {
    masks: Mutex<HashMap<(Vec<i64>, Device), Tensor>>,
}

impl MaskCache {
    /// The mask for these sizes, computed once.
    pub fn get(
        &self,
        padded: [i64; 3],
        window: [i64; 3],
        shift: [i64; 3],
        device: Device,
    ) -> Result<Tensor, TchError> {
        let key: Vec<i64> = padded
            .iter()
            .chain(&window)
            .chain(&shift)
            .copied()
            .collect();
        let mut masks = match self.masks.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        let key = (key, device);
        if let Some(mask) = masks.get(&key) {
            return Ok(mask.shallow_clone());
        }
        let mask = shift_mask(padded, window, shift, device)?;
        masks.insert(key, mask.shallow_clone());
        Ok(mask)
    }
}

/// Pairwise relative position index of the tokens of a window: (N, N) i64 with
/// N = wd * wh * ww, indexing a table of (2wd-1)(2wh-1)(2ww-1) biases.
pub fn relative_position_index(window: [i64; 3]) -> Tensor {
    let [wd, wh, ww] = window;
    let coords: Vec<[i64; 3]> = (0..wd)
        .flat_map(|d| (0..wh).flat_map(move |h| (0..ww).map(move |w| [d, h, w])))
        .collect();
    let mut index = Vec::with_capacity(coords.len() * coords.len());
    for a in &coords {
        for b in &coords {
            let rd = a[0] - b[0] + wd - 1;
            let rh = a[1] - b[1] + wh - 1;
            let rw = a[2] - b[2] + ww - 1;
            index.push(rd * (2 * wh - 1) * (2 * ww - 1) + rh * (2 * ww - 1) + rw);
        }
    }
    let n = coords.len() as i64;
    Tensor::from_slice(&index).view([n, n])
}

/// Normalised 2-D sine position encoding of an (h, w) grid: (1, h*w, 2*feats),
/// y features then x features, each alternating sin/cos (DETR style, scale 2 pi).
pub fn sine_position_encoding(hw: [i64; 2], feats: i64) -> Tensor {
    let [h, w] = hw;
    let scale = 2.0 * std::f64::consts::PI;
    let eps = 1e-6;
    let dim_t: Vec<f64> = (0..feats)
        .map(|i| 10000f64.powf(2.0 * (i / 2) as f64 / feats as f64))
        .collect();
    let encode = |pos: f64, out: &mut Vec<f32>| {
        for (i, t) in dim_t.iter().enumerate() {
            let v = pos / t;
            out.push(if i % 2 == 0 { v.sin() } else { v.cos() } as f32);
        }
    };
    let mut data = Vec::with_capacity((h * w * 2 * feats) as usize);
    for y in 0..h {
        for x in 0..w {
            // Embeddings are cumulative counts (1-based), normalised by the last one.
            let y_embed = (y + 1) as f32 as f64 / ((h as f32) as f64 + eps) * scale;
            let x_embed = (x + 1) as f32 as f64 / ((w as f32) as f64 + eps) * scale;
            encode(y_embed, &mut data);
            encode(x_embed, &mut data);
        }
    }
    Tensor::from_slice(&data).view([1, h * w, 2 * feats])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_then_reverse_is_identity() {
        let x = Tensor::randn([2, 4, 8, 12, 5], (Kind::Float, Device::Cpu));
        let windows = window_partition(&x, [2, 4, 4]).unwrap();
        assert_eq!(windows.size(), vec![2 * 2 * 2 * 3, 32, 5]);
        // The first window is the top-left-first block of the first sample.
        let first = x
            .get(0)
            .narrow(0, 0, 2)
            .narrow(1, 0, 4)
            .narrow(2, 0, 4)
            .reshape([32, 5]);
        assert!(windows.get(0).equal(&first));
        let back = window_reverse(&windows, [2, 4, 4], 2, 4, 8, 12).unwrap();
        assert!(back.equal(&x));
    }

    #[test]
    fn effective_window_shrinks_to_small_inputs() {
        let (w, s) = effective_window([2, 16, 4], [6, 8, 8], [3, 4, 4]);
        assert_eq!(w, [2, 8, 4]);
        assert_eq!(s, [0, 4, 0]);
    }

    #[test]
    fn relative_index_counts_offsets() {
        let idx = relative_position_index([2, 3, 3]);
        assert_eq!(idx.size(), vec![18, 18]);
        let v: Vec<i64> = Vec::try_from(idx.flatten(0, -1)).unwrap();
        // Same token: the centre of the (3, 5, 5) table.
        assert_eq!(v[0], 5 * 5 + 2 * 5 + 2);
        // Token 0 vs token 17 (d=1, h=2, w=2): offsets (-1, -2, -2) -> (0, 0, 0).
        assert_eq!(v[17], 0);
        // Token 17 vs token 0: offsets (1, 2, 2) -> the last entry.
        assert_eq!(v[17 * 18], 3 * 5 * 5 - 1);
        assert_eq!(*v.iter().max().unwrap(), 74);
        // Antisymmetry of offsets: idx[a][b] + idx[b][a] = 2 * centre.
        for a in 0..18 {
            for b in 0..18 {
                assert_eq!(v[a * 18 + b] + v[b * 18 + a], 2 * v[0]);
            }
        }
    }

    #[test]
    fn shift_mask_separates_wrapped_regions() {
        // One frame, 8 x 8 padded, window 4 x 4, shift 2 x 2: 4 windows of 16 tokens.
        let mask = shift_mask([1, 8, 8], [1, 4, 4], [0, 2, 2], Device::Cpu).unwrap();
        assert_eq!(mask.size(), vec![4, 16, 16]);
        let m: Vec<f32> = Vec::try_from(mask.flatten(0, -1)).unwrap();
        let at = |w: usize, i: usize, j: usize| m[(w * 16 + i) * 16 + j];
        // Window 0 (top-left) lies in one region: no masking.
        assert!((0..16).all(|i| (0..16).all(|j| at(0, i, j) == 0.0)));
        // Window 3 (bottom-right) has 4 regions of 2 x 2: token (0,0) and (0,3) differ.
        assert_eq!(at(3, 0, 3), -100.0);
        assert_eq!(at(3, 0, 1), 0.0);
        assert_eq!(at(3, 0, 4), 0.0);
        assert_eq!(at(3, 0, 8), -100.0);
        // Window 1 (top-right) splits columns only.
        assert_eq!(at(1, 0, 12), 0.0);
        assert_eq!(at(1, 0, 2), -100.0);
        // Symmetric, zero diagonal.
        assert!(mask.equal(&mask.transpose(1, 2)));
        let cache = MaskCache::default();
        let a = cache
            .get([1, 8, 8], [1, 4, 4], [0, 2, 2], Device::Cpu)
            .unwrap();
        assert!(a.equal(&mask));
    }

    #[test]
    fn sine_encoding_shape_and_values() {
        let pe = sine_position_encoding([2, 2], 4);
        assert_eq!(pe.size(), vec![1, 4, 8]);
        let v: Vec<f32> = Vec::try_from(pe.flatten(0, -1)).unwrap();
        // Token 0: y = x = 0.5 * 2pi = pi (minus eps); feature 0 = sin(pi) ~ 0, feature 1 = cos(pi) = -1.
        assert!(v[0].abs() < 1e-4);
        assert!((v[1] + 1.0).abs() < 1e-4);
    }
}
