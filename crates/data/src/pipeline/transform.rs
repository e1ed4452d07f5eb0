//! Dihedral transforms of (h, w) planes: the flips and 90-degree rotations of
//! `DATA.AUGMENT`, applied identically to every RGB and voxel plane of a sample so
//! the two resolutions stay aligned.

use crate::config::Augment;
use crate::util::rng::SplitMix64;

/// `out = flip(transpose?(in))`: transpose first, then flip rows and/or columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dihedral {
    /// Swap rows and columns.
    pub transpose: bool,
    /// Reverse the row order (up-down flip) after transposing.
    pub vflip: bool,
    /// Reverse the column order (left-right flip) after transposing.
    pub hflip: bool,
}

impl Dihedral {
    /// Counter-clockwise rotation by `k` quarter turns (as `numpy.rot90`).
    pub fn rot90(k: u32) -> Dihedral {
        match k % 4 {
            0 => Dihedral::default(),
            1 => Dihedral {
                transpose: true,
                vflip: true,
                hflip: false,
            },
            2 => Dihedral {
                transpose: false,
                vflip: true,
                hflip: true,
            },
            _ => Dihedral {
                transpose: true,
                vflip: false,
                hflip: true,
            },
        }
    }

    /// A random transform as `augment` allows; rotations only when `square`.
    pub fn random(augment: Augment, square: bool, rng: &mut SplitMix64) -> Dihedral {
        let mut t = if augment.rot90 && square {
            Dihedral::rot90(rng.below(4) as u32)
        } else {
            Dihedral::default()
        };
        if augment.hflip && rng.coin() {
            t.hflip = !t.hflip;
        }
        if augment.vflip && rng.coin() {
            t.vflip = !t.vflip;
        }
        t
    }

    /// Whether it leaves planes unchanged.
    pub fn is_identity(&self) -> bool {
        *self == Dihedral::default()
    }

    /// Output (rows, cols) of an `h x w` plane.
    pub fn out_size(&self, h: usize, w: usize) -> (usize, usize) {
        if self.transpose {
            (w, h)
        } else {
            (h, w)
        }
    }

    /// Transforms each `h x w` plane of `data` in place (`scratch` is reused).
    pub fn apply_planes(&self, data: &mut [f32], h: usize, w: usize, scratch: &mut Vec<f32>) {
        if self.is_identity() || h * w == 0 {
            return;
        }
        let (oh, ow) = self.out_size(h, w);
        scratch.resize(h * w, 0.0);
        for plane in data.chunks_exact_mut(h * w) {
            scratch.copy_from_slice(plane);
            for i in 0..oh {
                let si = if self.vflip { oh - 1 - i } else { i };
                for j in 0..ow {
                    let sj = if self.hflip { ow - 1 - j } else { j };
                    let (r, c) = if self.transpose { (sj, si) } else { (si, sj) };
                    plane[i * ow + j] = scratch[r * w + c];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(t: Dihedral, data: &[f32], h: usize, w: usize) -> Vec<f32> {
        let mut out = data.to_vec();
        t.apply_planes(&mut out, h, w, &mut Vec::new());
        out
    }

    #[test]
    fn rotations_match_numpy_rot90() {
        // [[1, 2, 3], [4, 5, 6]] rotated counter-clockwise: [[3, 6], [2, 5], [1, 4]].
        let m = [1., 2., 3., 4., 5., 6.];
        assert_eq!(
            apply(Dihedral::rot90(1), &m, 2, 3),
            vec![3., 6., 2., 5., 1., 4.]
        );
        assert_eq!(
            apply(Dihedral::rot90(2), &m, 2, 3),
            vec![6., 5., 4., 3., 2., 1.]
        );
        assert_eq!(
            apply(Dihedral::rot90(3), &m, 2, 3),
            vec![4., 1., 5., 2., 6., 3.]
        );
        let hflip = Dihedral {
            hflip: true,
            ..Default::default()
        };
        assert_eq!(apply(hflip, &m, 2, 3), vec![3., 2., 1., 6., 5., 4.]);
        // Four quarter turns are the identity, on every plane.
        let two: Vec<f32> = (0..18).map(|v| v as f32).collect();
        let mut x = two.clone();
        for _ in 0..4 {
            x = apply(Dihedral::rot90(1), &x, 3, 3);
        }
        assert_eq!(x, two);
    }

    #[test]
    fn random_respects_augment() {
        let mut rng = SplitMix64::new(1);
        let none = Augment::all(false);
        for _ in 0..50 {
            assert!(Dihedral::random(none, true, &mut rng).is_identity());
            assert!(!Dihedral::random(Augment::all(true), false, &mut rng).transpose);
        }
        let seen: std::collections::HashSet<_> = (0..200)
            .map(|_| {
                let t = Dihedral::random(Augment::all(true), true, &mut rng);
                (t.transpose, t.vflip, t.hflip)
            })
            .collect();
        assert_eq!(seen.len(), 8, "all eight dihedral elements occur");
    }
}
