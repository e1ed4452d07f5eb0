//! The spike branch of VRT-Spike: a Conv3d residual pyramid over the voxel clip
//! giving features at the scales of stages 1-4, per-pixel temporal self-attention
//! (`SPIKE_TSA`), and RGB-spike cross-attention (`FUSE`) after stages 1-4. Both are
//! per-pixel attentions computed by one chunked routine ([`per_pixel`]) in spatial
//! chunks so that batch x pixels per chunk stays under `MAX_BATCH_TOKENS`; each has its
//! own chunk keys (`SPIKE_TSA.*` follow `FUSE.*` where unset). With activation
//! checkpointing, each chunk's attention (TSA and FUSE) and TSA MLP are recomputed in
//! the backward pass.

use tch::{nn, TchError, Tensor};

use super::checkpoint::{checkpoint_one, Checkpointing};
use super::layers::{f_leaky_relu, Conv, LayerNorm, Linear, MlpGeglu};
use super::sdp::f_sdpa;
use super::{AtStage, ModelError};
use crate::config::{ChunkShape, Chunking, FuseConfig, ModelConfig};

/// How per-pixel attention is cut into spatial chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkGrid {
    /// Chunk height in pixels.
    pub rows: i64,
    /// Chunk width in pixels.
    pub cols: i64,
}

impl ChunkGrid {
    /// The chunk for a batch of `batch` over an (h, w) map: from the token budget when
    /// `ADAPTIVE_CHUNK`, else `CHUNK_SIZE`; square tiles or bands of full rows.
    pub fn choose(cfg: &Chunking, batch: i64, h: i64, w: i64) -> ChunkGrid {
        let budget = (cfg.max_batch_tokens / batch.max(1)).max(1); // pixels per chunk
        match (cfg.chunk_shape, cfg.adaptive_chunk) {
            (ChunkShape::Square, true) => {
                let side = ((budget as f64).sqrt().floor() as i64).max(1);
                ChunkGrid {
                    rows: side.min(h),
                    cols: side.min(w),
                }
            }
            (ChunkShape::Row, true) => ChunkGrid {
                rows: (budget / w.max(1)).clamp(1, h),
                cols: w,
            },
            (ChunkShape::Square, false) => ChunkGrid {
                rows: cfg.chunk_size.min(h),
                cols: cfg.chunk_size.min(w),
            },
            (ChunkShape::Row, false) => ChunkGrid {
                rows: cfg.chunk_size.min(h),
                cols: w,
            },
        }
    }
}

/// The stage name of [`per_pixel`]'s own cutting and stitching.
const CHUNKS: &str = "per-pixel chunks";

/// Applies `f` to every pixel's sequence over time, chunk by chunk. Inputs are
/// (N, C_i, D, H, W); `f` gets (N * pixels, D, C_i) per input and returns
/// (N * pixels, D, C_out). The result is (N, C_out, D, H, W), independent of `grid`.
pub fn per_pixel(
    inputs: &[&Tensor],
    grid: ChunkGrid,
    f: impl Fn(&[Tensor]) -> Result<Tensor, ModelError>,
) -> Result<Tensor, ModelError> {
    let s = inputs[0].size();
    let (n, d, h, w) = (s[0], s[2], s[3], s[4]);
    let mut rows_out = Vec::new();
    let mut y0 = 0;
    while y0 < h {
        let rh = grid.rows.min(h - y0);
        let mut tiles = Vec::new();
        let mut x0 = 0;
        while x0 < w {
            let cw = grid.cols.min(w - x0);
            let seqs = inputs
                .iter()
                .map(|t| {
                    let c = t.size()[1];
                    t.f_narrow(3, y0, rh)?
                        .f_narrow(4, x0, cw)?
                        .f_permute([0, 3, 4, 2, 1])?
                        .f_reshape([n * rh * cw, d, c])
                })
                .collect::<Result<Vec<Tensor>, TchError>>()
                .at_stage(CHUNKS)?;
            let out = f(&seqs)?;
            let c_out = out.size()[2];
            let tile = out
                .f_view([n, rh, cw, d, c_out])
                .and_then(|t| t.f_permute([0, 4, 3, 1, 2]));
            tiles.push(tile.at_stage(CHUNKS)?);
            x0 += cw;
        }
        rows_out.push(Tensor::f_cat(&tiles, 4).at_stage(CHUNKS)?);
        y0 += rh;
    }
    Tensor::f_cat(&rows_out, 3).at_stage(CHUNKS)
}

/// Multi-head attention of (B, L, C) queries over (B, S, C) keys/values given projections.
fn heads_attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: i64) -> Result<Tensor, TchError> {
    let split = |t: &Tensor| {
        let s = t.size();
        t.f_view([s[0], s[1], heads, s[2] / heads])?
            .f_transpose(1, 2)
    };
    let out = f_sdpa(&split(q)?, &split(k)?, &split(v)?, None)?;
    let s = out.size();
    out.f_transpose(1, 2)?.f_reshape([s[0], s[2], s[1] * s[3]])
}

/// One pre-norm temporal transformer layer over spike features.
#[derive(Debug)]
struct TsaLayer {
    attn: TsaAttention,
    ffn: TsaFeedForward,
}

/// The attention half of a TSA layer: norm1, self-attention over time, proj.
#[derive(Debug)]
struct TsaAttention {
    norm1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    heads: i64,
}

/// The MLP half of a TSA layer: norm2 and a GEGLU MLP.
#[derive(Debug)]
struct TsaFeedForward {
    norm2: LayerNorm,
    mlp: MlpGeglu,
}

impl TsaLayer {
    fn new(p: &nn::Path, dim: i64, heads: i64) -> TsaLayer {
        TsaLayer {
            attn: TsaAttention {
                norm1: LayerNorm::new(&(p / "norm1"), dim),
                qkv: Linear::new(&(p / "qkv"), dim, 3 * dim, true),
                proj: Linear::new(&(p / "proj"), dim, dim, true),
                heads,
            },
            ffn: TsaFeedForward {
                norm2: LayerNorm::new(&(p / "norm2"), dim),
                mlp: MlpGeglu::new(&(p / "mlp"), dim, 2 * dim, dim),
            },
        }
    }

    /// (B, D, C) sequences to the same shape, each half recomputed in the backward
    /// pass when `checkpointing` says so.
    fn forward(&self, x: &Tensor, checkpointing: Checkpointing) -> Result<Tensor, ModelError> {
        const ATTN: &str = "attention";
        const MLP: &str = "MLP";
        let attn = if checkpointing.attn {
            let part = self.attn.shallow_clone();
            checkpoint_one(&[x], move |t| part.forward(&t[0]).at_stage(ATTN))?
        } else {
            self.attn.forward(x).at_stage(ATTN)?
        };
        let x = x.f_add(&attn).at_stage(ATTN)?;
        let mlp = if checkpointing.ffn {
            let part = self.ffn.shallow_clone();
            checkpoint_one(&[&x], move |t| part.forward(&t[0]).at_stage(MLP))?
        } else {
            self.ffn.forward(&x).at_stage(MLP)?
        };
        x.f_add(&mlp).at_stage(MLP)
    }
}

impl TsaAttention {
    /// The attention update of (B, D, C) sequences.
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let qkv = self
            .qkv
            .f_forward(&self.norm1.f_forward(x)?)?
            .f_chunk(3, 2)?;
        self.proj
            .f_forward(&heads_attention(&qkv[0], &qkv[1], &qkv[2], self.heads)?)
    }

    /// The same part sharing its parameters (for a checkpointed closure).
    fn shallow_clone(&self) -> TsaAttention {
        TsaAttention {
            norm1: self.norm1.shallow_clone(),
            qkv: self.qkv.shallow_clone(),
            proj: self.proj.shallow_clone(),
            heads: self.heads,
        }
    }
}

impl TsaFeedForward {
    /// The MLP update of (B, D, C) sequences.
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        self.mlp.f_forward(&self.norm2.f_forward(x)?)
    }

    /// The same part sharing its parameters (for a checkpointed closure).
    fn shallow_clone(&self) -> TsaFeedForward {
        TsaFeedForward {
            norm2: self.norm2.shallow_clone(),
            mlp: self.mlp.shallow_clone(),
        }
    }
}

/// Cross-attention of RGB features (queries) over spike features (keys, values).
#[derive(Debug)]
struct Fuse {
    norm_q: LayerNorm,
    norm_kv: LayerNorm,
    q: Linear,
    kv: Linear,
    proj: Linear,
    heads: i64,
}

impl Fuse {
    fn new(p: &nn::Path, dim: i64, heads: i64) -> Fuse {
        Fuse {
            norm_q: LayerNorm::new(&(p / "norm_q"), dim),
            norm_kv: LayerNorm::new(&(p / "norm_kv"), dim),
            q: Linear::new(&(p / "q"), dim, dim, true),
            kv: Linear::new(&(p / "kv"), dim, 2 * dim, true),
            proj: Linear::new(&(p / "proj"), dim, dim, true),
            heads,
        }
    }

    /// (B, D, C) RGB and spike sequences to the RGB update (B, D, C).
    fn forward(&self, rgb: &Tensor, spike: &Tensor) -> Result<Tensor, TchError> {
        let q = self.q.f_forward(&self.norm_q.f_forward(rgb)?)?;
        let kv = self
            .kv
            .f_forward(&self.norm_kv.f_forward(spike)?)?
            .f_chunk(2, 2)?;
        self.proj
            .f_forward(&heads_attention(&q, &kv[0], &kv[1], self.heads)?)
    }

    /// The same fusion sharing its parameters (for a checkpointed closure).
    fn shallow_clone(&self) -> Fuse {
        Fuse {
            norm_q: self.norm_q.shallow_clone(),
            norm_kv: self.norm_kv.shallow_clone(),
            q: self.q.shallow_clone(),
            kv: self.kv.shallow_clone(),
            proj: self.proj.shallow_clone(),
            heads: self.heads,
        }
    }

    /// As [`Fuse::forward`], recomputed in the backward pass when `checkpointing.attn`.
    fn forward_checkpointed(
        &self,
        rgb: &Tensor,
        spike: &Tensor,
        checkpointing: Checkpointing,
    ) -> Result<Tensor, ModelError> {
        const ATTN: &str = "cross-attention";
        if !checkpointing.attn {
            return self.forward(rgb, spike).at_stage(ATTN);
        }
        let part = self.shallow_clone();
        checkpoint_one(&[rgb, spike], move |t| {
            part.forward(&t[0], &t[1]).at_stage(ATTN)
        })
    }
}

/// One pyramid level of the encoder: optional stride-2 down-sampling, residual blocks.
#[derive(Debug)]
struct Level {
    down: Option<Conv>,
    blocks: Vec<(Conv, Conv)>,
}

impl Level {
    /// Down-sampling (levels 1-3) then the residual blocks, on (N, C, D, H, W).
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let mut x = match &self.down {
            Some(down) => f_leaky_relu(&down.f_forward(x)?, 0.1)?,
            None => x.shallow_clone(),
        };
        for (conv1, conv2) in &self.blocks {
            let y = conv2.f_forward(&f_leaky_relu(&conv1.f_forward(&x)?, 0.1)?)?;
            x = x.f_add(&y)?;
        }
        Ok(x)
    }
}

/// The spike branch: encoder, temporal self-attention and fusion for stages 1-4.
#[derive(Debug)]
pub struct SpikeBranch {
    bins: i64,
    head: Conv,
    levels: Vec<Level>,
    tsa: Vec<Vec<TsaLayer>>,
    fuse: Vec<Fuse>,
    fuse_chunks: Chunking,
    tsa_chunks: Chunking,
    checkpointing: Checkpointing,
}

impl SpikeBranch {
    /// Parameters under `spike_encoder`, `spike_tsa.{0..3}` and `fuse.{0..3}`.
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Result<SpikeBranch, ModelError> {
        let dims = &cfg.embed_dims;
        if dims.len() < 4 {
            return Err(ModelError::Config(
                "EMBED_DIMS needs the widths of stages 1-4".into(),
            ));
        }
        let enc = p / "spike_encoder";
        let bins = cfg.spike.voxel_bins;
        let head = Conv::new(&(&enc / "head"), bins, dims[0], &[3, 3, 3], &[1, 1, 1]);
        let levels = (0..4)
            .map(|l| {
                let lp = &enc / "levels" / l;
                let down = (l > 0).then(|| Conv::down_frame(&(&lp / "down"), dims[l - 1], dims[l]));
                let blocks = (0..cfg.spike.blocks_per_level)
                    .map(|j| {
                        let bp = &lp / "blocks" / j;
                        (
                            Conv::new(&(&bp / "conv1"), dims[l], dims[l], &[3, 3, 3], &[1, 1, 1]),
                            Conv::new(&(&bp / "conv2"), dims[l], dims[l], &[3, 3, 3], &[1, 1, 1]),
                        )
                    })
                    .collect();
                Level { down, blocks }
            })
            .collect();
        let tsa = (0..4)
            .map(|l| {
                if !cfg.spike_tsa.enabled {
                    return Vec::new();
                }
                (0..cfg.spike_tsa.layers)
                    .map(|j| {
                        TsaLayer::new(
                            &(p / "spike_tsa" / l / "layers" / j),
                            dims[l],
                            cfg.spike_tsa.heads,
                        )
                    })
                    .collect()
            })
            .collect();
        let fuse = (0..4)
            .map(|l| Fuse::new(&(p / "fuse" / l), dims[l], cfg.fuse.heads))
            .collect();
        Ok(SpikeBranch {
            bins,
            head,
            levels,
            tsa,
            fuse,
            fuse_chunks: cfg.fuse.chunking(),
            tsa_chunks: cfg.tsa_chunking(),
            checkpointing: Checkpointing::from_config(cfg),
        })
    }

    /// Parameter groups for summaries: (prefix, label).
    pub fn parts() -> Vec<(String, String)> {
        vec![
            ("spike_encoder".into(), "spike encoder".into()),
            ("spike_tsa".into(), "SPIKE_TSA".into()),
            ("fuse".into(), "FUSE".into()),
        ]
    }

    /// Checks voxels (N, D, K, Hs, Ws) against the RGB input shape (N, D, C, H, W).
    pub fn check(&self, voxels: &Tensor, rgb: &[i64]) -> Result<(), ModelError> {
        let v = voxels.size();
        if v.len() != 5 || v[0] != rgb[0] || v[1] != rgb[1] || v[2] != self.bins {
            return Err(ModelError::Shape(format!(
                "voxels must be (N={}, D={}, K={}, Hs, Ws), got {v:?}",
                rgb[0], rgb[1], self.bins
            )));
        }
        if v[3] % 8 != 0 || v[4] % 8 != 0 || v[3] < 8 || v[4] < 8 {
            return Err(ModelError::Shape(format!(
                "voxel height and width must be positive multiples of 8, got {} x {}",
                v[3], v[4]
            )));
        }
        Ok(())
    }

    /// Spike features for stages 1-4: (N, C_l, D, H / 2^l, W / 2^l) at the RGB
    /// resolution (bilinear up/down-sampling on the device when the spike size differs).
    pub fn encode(
        &self,
        voxels: &Tensor,
        rgb: &[i64],
        _train: bool,
    ) -> Result<Vec<Tensor>, ModelError> {
        self.check(voxels, rgb)?;
        let (n, d, h, w) = (rgb[0], rgb[1], rgb[3], rgb[4]);
        let head = voxels
            .f_transpose(1, 2)
            .and_then(|v| self.head.f_forward(&v));
        let mut x = head.at_stage("head")?;
        let mut feats = Vec::with_capacity(4);
        for (l, level) in self.levels.iter().enumerate() {
            x = level.forward(&x).at_stage(&format!("level {l}"))?;
            let (th, tw) = (h >> l, w >> l);
            let s = x.size();
            let mut f = if (s[3], s[4]) == (th, tw) {
                x.shallow_clone()
            } else {
                let resized = x
                    .f_reshape([n, s[1] * d, s[3], s[4]])
                    .and_then(|t| t.f_upsample_bilinear2d([th, tw], false, None, None))
                    .and_then(|t| t.f_view([n, s[1], d, th, tw]));
                resized.at_stage(&format!("level {l} resize"))?
            };
            if !self.tsa[l].is_empty() {
                let grid = ChunkGrid::choose(&self.tsa_chunks, n, th, tw);
                let layers = &self.tsa[l];
                let checkpointing = self.checkpointing;
                f = per_pixel(&[&f], grid, |seqs| {
                    let mut y = seqs[0].shallow_clone();
                    for (j, layer) in layers.iter().enumerate() {
                        y = layer
                            .forward(&y, checkpointing)
                            .at_stage(&format!("layer {j}"))?;
                    }
                    Ok(y)
                })
                .at_stage(&format!("SPIKE_TSA level {l}"))?;
            }
            feats.push(f);
        }
        Ok(feats)
    }

    /// Fuses spike features into the output of stage `i + 1`: x + cross-attention.
    pub fn fuse(&self, i: usize, x: &Tensor, spike: &Tensor) -> Result<Tensor, ModelError> {
        if x.size() != spike.size() {
            return Err(ModelError::Shape(format!(
                "stage {} features {:?} and spike features {:?} differ",
                i + 1,
                x.size(),
                spike.size()
            )));
        }
        let s = x.size();
        let grid = ChunkGrid::choose(&self.fuse_chunks, s[0], s[3], s[4]);
        let fuse = &self.fuse[i];
        let checkpointing = self.checkpointing;
        let update = per_pixel(&[x, spike], grid, |seqs| {
            fuse.forward_checkpointed(&seqs[0], &seqs[1], checkpointing)
        })?;
        x.f_add(&update).at_stage("residual")
    }

    /// Sets how fusion and temporal attention are chunked, both alike (memory only;
    /// same result).
    pub fn set_chunks(&mut self, chunks: FuseConfig) {
        self.fuse_chunks = chunks.chunking();
        self.tsa_chunks = chunks.chunking();
    }

    /// The chunking of the temporal attention.
    pub fn tsa_chunking(&self) -> Chunking {
        self.tsa_chunks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn chunk_grids_respect_the_budget() {
        let mut cfg = FuseConfig {
            max_batch_tokens: 1000,
            ..FuseConfig::default()
        }
        .chunking();
        let p = ChunkGrid::choose(&cfg, 2, 64, 64);
        assert_eq!(p, ChunkGrid { rows: 22, cols: 22 });
        assert!(2 * p.rows * p.cols <= 1000);
        cfg.chunk_shape = ChunkShape::Row;
        let p = ChunkGrid::choose(&cfg, 2, 64, 64);
        assert_eq!(p, ChunkGrid { rows: 7, cols: 64 });
        cfg.adaptive_chunk = false;
        cfg.chunk_size = 5;
        assert_eq!(
            ChunkGrid::choose(&cfg, 2, 64, 64),
            ChunkGrid { rows: 5, cols: 64 }
        );
        cfg.chunk_shape = ChunkShape::Square;
        assert_eq!(
            ChunkGrid::choose(&cfg, 2, 64, 3),
            ChunkGrid { rows: 5, cols: 3 }
        );
    }

    #[test]
    fn per_pixel_result_is_independent_of_chunks() {
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::randn([2, 4, 3, 7, 9], opts);
        let weights = Tensor::randn([4, 5], opts);
        // A per-pixel function that mixes time: softmax over frames.
        let f = |s: &[Tensor]| s[0].softmax(1, Kind::Float).matmul(&weights);
        let whole = per_pixel(&[&x], ChunkGrid { rows: 7, cols: 9 }, |s| Ok(f(s))).unwrap();
        assert_eq!(whole.size(), vec![2, 5, 3, 7, 9]);
        for grid in [
            ChunkGrid { rows: 2, cols: 4 },
            ChunkGrid { rows: 1, cols: 9 },
            ChunkGrid { rows: 3, cols: 3 },
        ] {
            let chunked = per_pixel(&[&x], grid, |s| Ok(f(s))).unwrap();
            assert!(chunked.allclose(&whole, 1e-6, 1e-6, false), "{grid:?}");
        }
        // Pixel (1, 2) of sample 1 equals the function on that pixel alone.
        let one = x
            .get(1)
            .select(2, 1)
            .select(2, 2)
            .transpose(0, 1)
            .unsqueeze(0);
        let expected = f(&[one]).squeeze_dim(0).transpose(0, 1);
        assert!(whole
            .get(1)
            .select(2, 1)
            .select(2, 2)
            .allclose(&expected, 1e-6, 1e-6, false));
    }

    #[test]
    fn tsa_chunks_follow_its_own_keys_else_fuse() {
        let text = "MODEL:\n  ARCH: vrt_spike\n  VRT_DEPTHS: [1, 1, 1, 1, 1, 1, 1, 1]\n  \
                    EMBED_DIMS: [8, 8, 8, 8, 8, 8, 8, 8]\n  NUM_HEADS: [2, 2, 2, 2, 2, 2, 2, 2]\n  \
                    DEFORMABLE_GROUPS: 2\n  SPIKE: {VOXEL_BINS: 2}\n  \
                    SPIKE_TSA: {HEADS: 2, ADAPTIVE_CHUNK: false, CHUNK_SIZE: 80}\n  \
                    FUSE: {HEADS: 2, MAX_BATCH_TOKENS: 4096, CHUNK_SHAPE: row}\n";
        let cfg = crate::config::Config::parse(text, std::path::Path::new("c.yaml"))
            .unwrap()
            .model;
        let vs = nn::VarStore::new(Device::Cpu);
        let branch = SpikeBranch::new(&vs.root(), &cfg).unwrap();
        let tsa = branch.tsa_chunking();
        assert!(!tsa.adaptive_chunk);
        assert_eq!(tsa.chunk_size, 80);
        // Unset TSA keys follow FUSE.
        assert_eq!(tsa.max_batch_tokens, 4096);
        assert_eq!(tsa.chunk_shape, ChunkShape::Row);
        let fuse = branch.fuse_chunks;
        assert!(fuse.adaptive_chunk);
        assert_eq!(fuse.chunk_size, 64);
        // The TSA grid uses its fixed 80-row bands, FUSE its token budget.
        assert_eq!(
            ChunkGrid::choose(&tsa, 2, 128, 128),
            ChunkGrid {
                rows: 80,
                cols: 128
            }
        );
        assert_eq!(
            ChunkGrid::choose(&fuse, 2, 128, 128),
            ChunkGrid {
                rows: 16,
                cols: 128
            }
        );
    }
}
