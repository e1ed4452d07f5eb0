//! `MODEL`: the architecture and its sizes. `vrt_spike` (the default, as in the user's
//! trainer, which knows no other) is VRT (Liang et al. 2022) with an optional spike
//! branch; `unet_spike` is a compact U-Net for CPU runs and tests. Key names follow the
//! original trainer (`VRT_DEPTHS`, `WINDOW_SIZE`, `FUSE.*`, ...). [`Arch::reads`] says
//! which keys each architecture reads.

use serde::{Deserialize, Deserializer, Serialize};

use super::{at_least, Checks};

/// `MODEL.ARCH`: the architecture to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum Arch {
    /// VRT with the spike branch (the user's model); its defaults are the baseline's
    /// (`configs/deblur/vrt_spike_baseline.yaml`).
    #[default]
    #[serde(rename = "vrt_spike")]
    VrtSpike,
    /// The compact spike-fused U-Net (`MODEL.UNET`).
    #[serde(rename = "unet_spike")]
    UnetSpike,
}

/// The `MODEL` keys `vrt_spike` reads (a section stands for every key under it).
const VRT_SPIKE_KEYS: [&str; 18] = [
    "ARCH",
    "IN_CHANS",
    "VRT_DEPTHS",
    "WINDOW_SIZE",
    "EMBED_DIMS",
    "NUM_HEADS",
    "INDEP_RECONSTS",
    "MUL_ATTN_RATIO",
    "MLP_RATIO",
    "QKV_BIAS",
    "DROP_PATH_RATE",
    "PA_FRAMES",
    "DEFORMABLE_GROUPS",
    "SPIKE",
    "SPIKE_TSA",
    "FUSE",
    "USE_CHECKPOINT_ATTN",
    "USE_CHECKPOINT_FFN",
];

/// The `MODEL` keys `unet_spike` reads.
const UNET_SPIKE_KEYS: [&str; 5] = [
    "ARCH",
    "IN_CHANS",
    "UNET",
    "SPIKE.ENABLED",
    "SPIKE.VOXEL_BINS",
];

impl Arch {
    /// Every architecture, the default first.
    pub const ALL: [Arch; 2] = [Arch::VrtSpike, Arch::UnetSpike];

    /// The name `MODEL.ARCH` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Arch::VrtSpike => "vrt_spike",
            Arch::UnetSpike => "unet_spike",
        }
    }

    /// Whether building this architecture reads `key`, a path under `MODEL`
    /// (`VRT_DEPTHS`, `SPIKE.VOXEL_BINS`); a section is read when any key in it is.
    /// Keys of a feature the config turns off (`SPIKE_TSA.*` with `SPIKE.ENABLED:
    /// false`) count as read: the architecture reads them when the feature is on.
    pub fn reads(self, key: &str) -> bool {
        let keys: &[&str] = match self {
            Arch::VrtSpike => &VRT_SPIKE_KEYS,
            Arch::UnetSpike => &UNET_SPIKE_KEYS,
        };
        keys.iter()
            .any(|read| within(key, read) || within(read, key))
    }
}

/// Whether the key path `key` is `section` or lies under it.
fn within(key: &str, section: &str) -> bool {
    key.strip_prefix(section)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The `MODEL` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The architecture (`vrt_spike`, `unet_spike`).
    #[serde(rename = "ARCH")]
    pub arch: Arch,
    /// Image channels in and out.
    #[serde(rename = "IN_CHANS")]
    pub in_chans: i64,
    /// Blocks per stage: 7 U-stages, then one entry per stage-8 RTMSA group.
    #[serde(rename = "VRT_DEPTHS")]
    pub vrt_depths: Vec<i64>,
    /// Attention window (frames, height, width). One integer sets the spatial window
    /// (height = width) and keeps the default temporal size.
    #[serde(rename = "WINDOW_SIZE", deserialize_with = "window_size")]
    pub window_size: [i64; 3],
    /// Channels per stage (same length as `VRT_DEPTHS`).
    #[serde(rename = "EMBED_DIMS")]
    pub embed_dims: Vec<i64>,
    /// Attention heads per stage (same length as `VRT_DEPTHS`).
    #[serde(rename = "NUM_HEADS")]
    pub num_heads: Vec<i64>,
    /// Stage-8 groups (indices into `VRT_DEPTHS`) that attend within one frame.
    #[serde(rename = "INDEP_RECONSTS")]
    pub indep_reconsts: Vec<i64>,
    /// Share of a stage's blocks that use mutual + self attention.
    #[serde(rename = "MUL_ATTN_RATIO")]
    pub mul_attn_ratio: f64,
    /// Hidden width of the GEGLU MLP over the embedding width.
    #[serde(rename = "MLP_RATIO")]
    pub mlp_ratio: f64,
    /// Bias in the q/k/v projections.
    #[serde(rename = "QKV_BIAS")]
    pub qkv_bias: bool,
    /// Stochastic depth, rising linearly over all blocks to this rate.
    #[serde(rename = "DROP_PATH_RATE")]
    pub drop_path_rate: f64,
    /// Frames aligned in parallel warping (VRT supports 2; 0 is not supported here).
    #[serde(rename = "PA_FRAMES")]
    pub pa_frames: i64,
    /// Offset groups of the flow-guided deformable convolution.
    #[serde(rename = "DEFORMABLE_GROUPS")]
    pub deformable_groups: i64,
    /// The spike encoder (voxel clip input).
    #[serde(rename = "SPIKE")]
    pub spike: SpikeConfig,
    /// Temporal self-attention over the spike features, per pixel.
    #[serde(rename = "SPIKE_TSA")]
    pub spike_tsa: SpikeTsaConfig,
    /// RGB-spike cross-attention after stages 1-4, in spatial chunks.
    #[serde(rename = "FUSE")]
    pub fuse: FuseConfig,
    /// The compact `unet_spike` architecture.
    #[serde(rename = "UNET")]
    pub unet: UnetConfig,
    /// Recompute window attention in the backward pass (activation checkpointing).
    #[serde(rename = "USE_CHECKPOINT_ATTN")]
    pub use_checkpoint_attn: bool,
    /// Recompute the MLPs in the backward pass (activation checkpointing).
    #[serde(rename = "USE_CHECKPOINT_FFN")]
    pub use_checkpoint_ffn: bool,
}

/// `MODEL.SPIKE`: the spike branch's encoder.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpikeConfig {
    /// `false` gives plain VRT with exactly the reference's parameters.
    #[serde(rename = "ENABLED")]
    pub enabled: bool,
    /// Voxel bins per frame (K).
    #[serde(rename = "VOXEL_BINS")]
    pub voxel_bins: i64,
    /// Residual Conv3d blocks per pyramid level.
    #[serde(rename = "BLOCKS_PER_LEVEL")]
    pub blocks_per_level: i64,
}

/// `MODEL.SPIKE_TSA`: per-pixel temporal self-attention over spike features.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpikeTsaConfig {
    /// Apply temporal self-attention to the spike features.
    #[serde(rename = "ENABLED")]
    pub enabled: bool,
    /// Attention heads (must divide each fused stage's width).
    #[serde(rename = "HEADS")]
    pub heads: i64,
    /// Transformer layers per scale.
    #[serde(rename = "LAYERS")]
    pub layers: i64,
    /// As `FUSE.ADAPTIVE_CHUNK`, for the temporal attention; `null` follows `FUSE`.
    #[serde(rename = "ADAPTIVE_CHUNK")]
    pub adaptive_chunk: Option<bool>,
    /// As `FUSE.MAX_BATCH_TOKENS`; `null` follows `FUSE`.
    #[serde(rename = "MAX_BATCH_TOKENS")]
    pub max_batch_tokens: Option<i64>,
    /// As `FUSE.CHUNK_SIZE`; `null` follows `FUSE`.
    #[serde(rename = "CHUNK_SIZE")]
    pub chunk_size: Option<i64>,
    /// As `FUSE.CHUNK_SHAPE`; `null` follows `FUSE`.
    #[serde(rename = "CHUNK_SHAPE")]
    pub chunk_shape: Option<ChunkShape>,
}

/// How a per-pixel attention (FUSE or SPIKE_TSA) is cut into spatial chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunking {
    /// Pick the chunk from `max_batch_tokens` (`false`: use `chunk_size`).
    pub adaptive_chunk: bool,
    /// Upper bound of batch x pixels attended at once.
    pub max_batch_tokens: i64,
    /// Side of a square chunk, or rows of a row chunk.
    pub chunk_size: i64,
    /// Square tiles or bands of full rows.
    pub chunk_shape: ChunkShape,
}

impl FuseConfig {
    /// The chunking of the fusion attention.
    pub fn chunking(&self) -> Chunking {
        Chunking {
            adaptive_chunk: self.adaptive_chunk,
            max_batch_tokens: self.max_batch_tokens,
            chunk_size: self.chunk_size,
            chunk_shape: self.chunk_shape,
        }
    }
}

impl SpikeTsaConfig {
    /// The chunking of the temporal attention: its own keys, `FUSE`'s where unset.
    pub fn chunking(&self, fuse: &FuseConfig) -> Chunking {
        Chunking {
            adaptive_chunk: self.adaptive_chunk.unwrap_or(fuse.adaptive_chunk),
            max_batch_tokens: self.max_batch_tokens.unwrap_or(fuse.max_batch_tokens),
            chunk_size: self.chunk_size.unwrap_or(fuse.chunk_size),
            chunk_shape: self.chunk_shape.unwrap_or(fuse.chunk_shape),
        }
    }
}

/// `WINDOW_SIZE`: `[T, H, W]`, or one integer for H = W with the default T.
fn window_size<'de, D: Deserializer<'de>>(de: D) -> Result<[i64; 3], D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Spatial(i64),
        Full([i64; 3]),
    }
    match Raw::deserialize(de) {
        Ok(Raw::Spatial(s)) => Ok([ModelConfig::default().window_size[0], s, s]),
        Ok(Raw::Full(w)) => Ok(w),
        Err(_) => Err(serde::de::Error::custom(
            "expected one integer (spatial window) or [frames, height, width]",
        )),
    }
}

/// Shape of the spatial chunks of the per-pixel attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChunkShape {
    /// `CHUNK_SIZE` x `CHUNK_SIZE` tiles.
    Square,
    /// Bands of `CHUNK_SIZE` full rows.
    Row,
}

/// `MODEL.FUSE`: RGB-spike cross-attention.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FuseConfig {
    /// Attention heads (must divide each fused stage's width).
    #[serde(rename = "HEADS")]
    pub heads: i64,
    /// Pick the chunk from `MAX_BATCH_TOKENS` (`false`: use `CHUNK_SIZE`).
    #[serde(rename = "ADAPTIVE_CHUNK")]
    pub adaptive_chunk: bool,
    /// Upper bound of batch x pixels attended at once.
    #[serde(rename = "MAX_BATCH_TOKENS")]
    pub max_batch_tokens: i64,
    /// Side of a square chunk, or rows of a row chunk, in pixels of the stage.
    #[serde(rename = "CHUNK_SIZE")]
    pub chunk_size: i64,
    /// `square` or `row`.
    #[serde(rename = "CHUNK_SHAPE")]
    pub chunk_shape: ChunkShape,
}

/// `MODEL.UNET`: the compact spike-fused U-Net.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UnetConfig {
    /// Channels at full resolution (doubled at each level).
    #[serde(rename = "CHANNELS")]
    pub channels: i64,
    /// Down-sampling levels (input sides must divide by 2^LEVELS).
    #[serde(rename = "LEVELS")]
    pub levels: i64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: Arch::VrtSpike,
            in_chans: 3,
            vrt_depths: vec![8, 8, 8, 8, 4, 4, 4, 8],
            window_size: [6, 8, 8],
            embed_dims: vec![96, 96, 96, 96, 96, 96, 96, 120],
            num_heads: vec![6; 8],
            indep_reconsts: vec![],
            mul_attn_ratio: 0.75,
            mlp_ratio: 2.0,
            qkv_bias: true,
            drop_path_rate: 0.2,
            pa_frames: 2,
            deformable_groups: 16,
            spike: SpikeConfig::default(),
            spike_tsa: SpikeTsaConfig::default(),
            fuse: FuseConfig::default(),
            unet: UnetConfig::default(),
            use_checkpoint_attn: false,
            use_checkpoint_ffn: false,
        }
    }
}

impl Default for SpikeConfig {
    fn default() -> Self {
        SpikeConfig {
            enabled: true,
            voxel_bins: 32,
            blocks_per_level: 1,
        }
    }
}

impl Default for SpikeTsaConfig {
    fn default() -> Self {
        SpikeTsaConfig {
            enabled: true,
            heads: 4,
            layers: 1,
            adaptive_chunk: None,
            max_batch_tokens: None,
            chunk_size: None,
            chunk_shape: None,
        }
    }
}

impl Default for FuseConfig {
    fn default() -> Self {
        FuseConfig {
            heads: 4,
            adaptive_chunk: true,
            max_batch_tokens: 65536,
            chunk_size: 64,
            chunk_shape: ChunkShape::Square,
        }
    }
}

impl Default for UnetConfig {
    fn default() -> Self {
        UnetConfig {
            channels: 32,
            levels: 2,
        }
    }
}

impl ModelConfig {
    /// The chunking of the temporal spike attention (its keys, else `FUSE`'s).
    pub fn tsa_chunking(&self) -> Chunking {
        self.spike_tsa.chunking(&self.fuse)
    }

    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        let tsa = &self.spike_tsa;
        at_least(
            "MODEL",
            1,
            [
                ("IN_CHANS", self.in_chans),
                ("SPIKE.VOXEL_BINS", self.spike.voxel_bins),
                ("FUSE.MAX_BATCH_TOKENS", self.fuse.max_batch_tokens),
                ("FUSE.CHUNK_SIZE", self.fuse.chunk_size),
                (
                    "SPIKE_TSA.MAX_BATCH_TOKENS",
                    tsa.max_batch_tokens.unwrap_or(1),
                ),
                ("SPIKE_TSA.CHUNK_SIZE", tsa.chunk_size.unwrap_or(1)),
            ],
        )?;
        at_least(
            "MODEL",
            0,
            [("SPIKE.BLOCKS_PER_LEVEL", self.spike.blocks_per_level)],
        )?;
        if self.arch == Arch::UnetSpike {
            at_least("MODEL", 1, [("UNET.CHANNELS", self.unet.channels)])?;
            let levels_ok = (1..=5).contains(&self.unet.levels);
            return Checks("MODEL").check(levels_ok, "UNET.LEVELS", "expected 1 to 5");
        }
        self.validate_vrt()
    }

    fn validate_vrt(&self) -> Result<(), (String, String)> {
        let m = Checks("MODEL");
        let n = self.vrt_depths.len();
        let stages = "7 U-stages and at least one stage-8 group (8+ entries)";
        m.expect(n >= 8, "VRT_DEPTHS", stages, n)?;
        if let Some(d) = self.vrt_depths.iter().find(|&&d| d < 1) {
            m.expect(false, "VRT_DEPTHS", "positive depths", d)?;
        }
        let per_depth = format!("{n} entries (one per VRT_DEPTHS entry)");
        for (key, len) in [
            ("EMBED_DIMS", self.embed_dims.len()),
            ("NUM_HEADS", self.num_heads.len()),
        ] {
            m.expect(len == n, key, &per_depth, len)?;
        }
        let windows_ok = self.window_size.iter().all(|&w| w >= 1);
        m.check(windows_ok, "WINDOW_SIZE", "expected positive sizes")?;
        for (i, (&dim, &heads)) in self.embed_dims.iter().zip(&self.num_heads).enumerate() {
            let divides = heads >= 1 && dim >= 1 && dim % heads == 0;
            let must = format!("entry {i}: {heads} heads must divide EMBED_DIMS {dim}");
            m.check(divides, "NUM_HEADS", must)?;
            let even = format!("entry {i}: expected an even width, got {dim}");
            m.check(dim % 2 == 0, "EMBED_DIMS", even)?;
        }
        for i in 4..7 {
            let shuffled = format!(
                "entry {}: stage {} pixel-shuffles it, so it must divide by 4",
                i - 1,
                i + 1
            );
            m.check(self.embed_dims[i - 1] % 4 == 0, "EMBED_DIMS", shuffled)?;
        }
        let group = |&&i: &&i64| i < 7 || i as usize >= n;
        if let Some(i) = self.indep_reconsts.iter().find(group) {
            let not_a_group = format!("{i} is not a stage-8 group index (7..{n})");
            m.check(false, "INDEP_RECONSTS", not_a_group)?;
        }
        let ratio_ok = (0.0..=1.0).contains(&self.mul_attn_ratio);
        m.check(ratio_ok, "MUL_ATTN_RATIO", "expected a ratio in [0, 1]")?;
        m.check(
            self.mlp_ratio > 0.0,
            "MLP_RATIO",
            "expected a positive ratio",
        )?;
        let rate_ok = (0.0..1.0).contains(&self.drop_path_rate);
        m.check(rate_ok, "DROP_PATH_RATE", "expected a rate in [0, 1)")?;
        let only_2 = format!("only 2 is supported, got {}", self.pa_frames);
        m.check(self.pa_frames == 2, "PA_FRAMES", only_2)?;
        at_least("MODEL", 1, [("DEFORMABLE_GROUPS", self.deformable_groups)])?;
        let divides = |heads: i64, key: &str, dims: &[i64]| {
            dims.iter().enumerate().try_for_each(|(i, &dim)| {
                let must = format!("{heads} must divide EMBED_DIMS entry {i} ({dim})");
                m.check(heads >= 1 && dim % heads == 0, key, must)
            })
        };
        divides(
            self.deformable_groups,
            "DEFORMABLE_GROUPS",
            &self.embed_dims[..7],
        )?;
        if self.spike.enabled {
            divides(self.fuse.heads, "FUSE.HEADS", &self.embed_dims[..4])?;
            if self.spike_tsa.enabled {
                divides(
                    self.spike_tsa.heads,
                    "SPIKE_TSA.HEADS",
                    &self.embed_dims[..4],
                )?;
            }
            at_least("MODEL", 0, [("SPIKE_TSA.LAYERS", self.spike_tsa.layers)])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{ChunkShape, Config};
    use std::path::Path;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("m.yaml")).map_err(|e| e.to_string())
    }

    #[test]
    fn nested_sections_parse_and_unknown_keys_name_their_path() {
        let cfg = parse("MODEL:\n  ARCH: vrt_spike\n  FUSE:\n    CHUNK_SHAPE: row\n    MAX_BATCH_TOKENS: 4096\n")
            .unwrap();
        assert_eq!(cfg.model.fuse.chunk_shape, ChunkShape::Row);
        assert_eq!(cfg.model.fuse.max_batch_tokens, 4096);
        let err = parse("MODEL:\n  FUSE:\n    CHUNK_SHAP: row\n").unwrap_err();
        assert!(
            err.contains("MODEL.FUSE") && err.contains("CHUNK_SHAP"),
            "{err}"
        );
        let err = parse("MODEL:\n  SPIKE_TSA:\n    HEADS: many\n").unwrap_err();
        assert!(err.contains("MODEL.SPIKE_TSA.HEADS"), "{err}");
    }

    #[test]
    fn inconsistent_vrt_sizes_name_the_key() {
        let err = parse("MODEL:\n  ARCH: vrt_spike\n  EMBED_DIMS: [96, 96]\n").unwrap_err();
        assert!(err.contains("MODEL.EMBED_DIMS"), "{err}");
        let err = parse("MODEL:\n  ARCH: vrt_spike\n  DEFORMABLE_GROUPS: 7\n").unwrap_err();
        assert!(err.contains("MODEL.DEFORMABLE_GROUPS"), "{err}");
        let err = parse("MODEL:\n  ARCH: vrt\n").unwrap_err();
        assert!(err.contains("MODEL.ARCH"), "{err}");
    }
}
