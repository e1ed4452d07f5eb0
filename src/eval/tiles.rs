//! Full-frame inference by overlapping tiles, so validation at full resolution never
//! needs the whole frame's activations at once. Each output pixel is taken from the
//! one tile where it lies farthest from an inner tile edge (the tiles' kept regions
//! split every overlap at its middle), so a model whose output at a pixel depends
//! only on a neighbourhood of radius <= overlap/2 gives exactly the whole-frame result.

use tch::{TchError, Tensor};

/// One tile along an axis: the input span and the span of it that is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileSpan {
    /// First input row/column.
    pub start: i64,
    /// One past the last input row/column.
    pub end: i64,
    /// First kept row/column (frame coordinates).
    pub keep_start: i64,
    /// One past the last kept row/column.
    pub keep_end: i64,
}

/// Tiles covering `len` with tiles of `tile` (at least) overlapping by `overlap`,
/// starts aligned to `align`; the kept spans partition `0..len` exactly.
pub fn tile_spans(len: i64, tile: i64, overlap: i64, align: i64) -> Vec<TileSpan> {
    let align = align.max(1);
    if tile >= len {
        return vec![TileSpan {
            start: 0,
            end: len,
            keep_start: 0,
            keep_end: len,
        }];
    }
    let stride = ((tile - overlap) / align * align).max(align);
    let mut starts = Vec::new();
    let mut start = 0;
    while start + tile < len {
        starts.push(start);
        start += stride;
    }
    let last = ((len - tile) / align * align).max(0);
    if starts.last().is_none_or(|&s| s < last) {
        starts.push(last);
    }
    let ends: Vec<i64> = starts
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            if i + 1 == starts.len() {
                len
            } else {
                (s + tile).min(len)
            }
        })
        .collect();
    let mut spans = Vec::with_capacity(starts.len());
    let mut keep_start = 0;
    for i in 0..starts.len() {
        let keep_end = if i + 1 == starts.len() {
            len
        } else {
            // The middle of the overlap with the next tile.
            ((starts[i + 1] + ends[i]) / 2).clamp(starts[i + 1], ends[i])
        };
        spans.push(TileSpan {
            start: starts[i],
            end: ends[i],
            keep_start,
            keep_end,
        });
        keep_start = keep_end;
    }
    spans
}

/// A model run on one tile: (blur tile, voxel tile) to the restored tile.
pub type TileModel<'m, E> = dyn FnMut(&Tensor, Option<&Tensor>) -> Result<Tensor, E> + 'm;

/// Runs `model` on tiles of `blur` (N, D, 3, H, W) and of `voxels` (N, D, K, Hs, Ws,
/// H/Hs = W/Ws an integer ratio) and stitches the (N, D, 3, H, W) output. Tile starts
/// are aligned to `align` RGB pixels (a multiple of the spike ratio). Tiles of one
/// shape go through the model `batch` at a time (stacked along N; at least 1). A
/// libtorch failure (the output buffer, a tile) is returned as `E`, never a panic.
pub fn tiled_forward<E: From<TchError>>(
    model: &mut TileModel<'_, E>,
    blur: &Tensor,
    voxels: Option<&Tensor>,
    tiling: Tiling,
) -> Result<Tensor, E> {
    let size = blur.size();
    let (n, h, w) = (size[0], size[3], size[4]);
    let ratio = voxels.map_or(1, |v| (h / v.size()[3]).max(1));
    let align = (tiling.align.max(1) + ratio - 1) / ratio * ratio;
    let out = blur.f_zeros_like()?;
    let rows = tile_spans(h, tiling.tile, tiling.overlap, align);
    let cols = tile_spans(w, tiling.tile, tiling.overlap, align);
    // Tiles in order, grouped by input shape (the last row and column may be wider).
    let mut groups: Vec<Vec<(TileSpan, TileSpan)>> = Vec::new();
    for ty in &rows {
        for tx in &cols {
            let shape = (ty.end - ty.start, tx.end - tx.start);
            let same = |g: &Vec<(TileSpan, TileSpan)>| {
                g.first()
                    .is_some_and(|(a, b)| (a.end - a.start, b.end - b.start) == shape)
            };
            match groups.iter_mut().find(|g| same(g)) {
                Some(group) => group.push((*ty, *tx)),
                None => groups.push(vec![(*ty, *tx)]),
            }
        }
    }
    let crop = |t: &Tensor, ty: &TileSpan, tx: &TileSpan, scale: i64| {
        t.f_narrow(3, ty.start / scale, (ty.end - ty.start) / scale)?
            .f_narrow(4, tx.start / scale, (tx.end - tx.start) / scale)
    };
    for group in &groups {
        for chunk in group.chunks(tiling.batch.max(1)) {
            let stack = |t: &Tensor, scale: i64| -> Result<Tensor, TchError> {
                let parts = chunk
                    .iter()
                    .map(|(ty, tx)| crop(t, ty, tx, scale))
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::f_cat(&parts, 0)
            };
            let b = stack(blur, 1)?;
            let v = voxels.map(|v| stack(v, ratio)).transpose()?;
            let y = model(&b, v.as_ref())?;
            for (k, (ty, tx)) in chunk.iter().enumerate() {
                let kept = y
                    .f_narrow(0, k as i64 * n, n)?
                    .f_narrow(3, ty.keep_start - ty.start, ty.keep_end - ty.keep_start)?
                    .f_narrow(4, tx.keep_start - tx.start, tx.keep_end - tx.keep_start)?;
                out.f_narrow(3, ty.keep_start, ty.keep_end - ty.keep_start)?
                    .f_narrow(4, tx.keep_start, tx.keep_end - tx.keep_start)?
                    .f_copy_(&kept)?;
            }
        }
    }
    Ok(out)
}

/// How [`tiled_forward`] cuts a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiling {
    /// Tile side in RGB pixels (at least).
    pub tile: i64,
    /// Overlap of neighbouring tiles.
    pub overlap: i64,
    /// Alignment of tile starts in RGB pixels.
    pub align: i64,
    /// Tiles of one shape run at once.
    pub batch: usize,
}

/// Tiles of the frame (`h` x `w`) a [`Tiling`] makes.
#[cfg(test)]
fn tile_count(h: i64, w: i64, tiling: Tiling) -> usize {
    tile_spans(h, tiling.tile, tiling.overlap, tiling.align).len()
        * tile_spans(w, tiling.tile, tiling.overlap, tiling.align).len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn kept_spans_partition_the_axis() {
        for (len, tile, overlap, align) in [
            (100, 32, 8, 4),
            (96, 32, 16, 8),
            (37, 16, 4, 1),
            (20, 64, 8, 4),
            (64, 16, 0, 16),
        ] {
            let spans = tile_spans(len, tile, overlap, align);
            assert_eq!(spans[0].keep_start, 0);
            assert_eq!(spans.last().map(|s| s.keep_end), Some(len));
            for pair in spans.windows(2) {
                assert_eq!(pair[0].keep_end, pair[1].keep_start, "{spans:?}");
            }
            for s in &spans {
                assert!(
                    s.start <= s.keep_start && s.keep_end <= s.end && s.keep_start < s.keep_end,
                    "{s:?}"
                );
                assert_eq!(s.start % align, 0);
                assert!(s.end - s.start >= tile.min(len));
                // Kept pixels are at least overlap/2 from an inner tile edge.
                if s.start > 0 {
                    assert!(s.keep_start - s.start >= overlap / 2, "{s:?}");
                }
                if s.end < len {
                    assert!(s.end - s.keep_end >= overlap / 2, "{s:?}");
                }
            }
        }
    }

    /// A 3x3 box filter per frame and channel (zero padding): output depends on a
    /// radius-1 neighbourhood, plus the voxels' mean to check their tiling.
    fn local_model(blur: &Tensor, voxels: Option<&Tensor>) -> Result<Tensor, TchError> {
        let s = blur.size();
        let frames = blur.reshape([s[0] * s[1] * s[2], 1, s[3], s[4]]);
        let kernel = Tensor::full([1, 1, 3, 3], 1.0 / 9.0, (Kind::Float, Device::Cpu));
        let y = frames
            .conv2d(&kernel, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1)
            .view(s.as_slice());
        let v = voxels.ok_or_else(|| TchError::Torch("no voxels".into()))?;
        let vs = v.size();
        let up = v
            .mean_dim([2i64].as_slice(), true, Kind::Float)
            .reshape([vs[0] * vs[1], 1, vs[3], vs[4]])
            .upsample_nearest2d([s[3], s[4]], None, None)
            .view([s[0], s[1], 1, s[3], s[4]]);
        Ok(y + up)
    }

    #[test]
    fn tiled_equals_whole_frame_for_a_local_model() {
        tch::manual_seed(1);
        let blur = Tensor::rand([1, 2, 3, 48, 72], (Kind::Float, Device::Cpu));
        let vox = Tensor::rand([1, 2, 4, 24, 36], (Kind::Float, Device::Cpu));
        let whole = local_model(&blur, Some(&vox)).unwrap();
        let mut calls = 0;
        let mut counted = |b: &Tensor, v: Option<&Tensor>| {
            calls += 1;
            local_model(b, v)
        };
        let tiling = |overlap: i64, batch: usize| Tiling {
            tile: 24,
            overlap,
            align: 2,
            batch,
        };
        let tiled = tiled_forward(&mut counted, &blur, Some(&vox), tiling(4, 1)).unwrap();
        assert!(calls > 4, "several tiles ({calls})");
        assert_eq!(calls, tile_count(48, 72, tiling(4, 1)));
        let diff = (&tiled - &whole).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "max difference {diff}");
        // Tiles of one shape in batches of 4 (the last row and column are wider):
        // fewer calls, the same frame.
        let mut batched_calls = 0;
        let mut counted = |b: &Tensor, v: Option<&Tensor>| {
            batched_calls += 1;
            local_model(b, v)
        };
        let batched = tiled_forward(&mut counted, &blur, Some(&vox), tiling(4, 4)).unwrap();
        assert!(
            batched_calls < calls,
            "{batched_calls} calls batched, {calls} one by one"
        );
        let diff = (&batched - &whole).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "batched: max difference {diff}");
        // Without overlap the tile borders would differ: the test can fail.
        let seams = tiled_forward(&mut local_model, &blur, Some(&vox), tiling(0, 1)).unwrap();
        assert!((&seams - &whole).abs().max().double_value(&[]) > 1e-3);
    }
}
