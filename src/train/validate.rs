//! Validation: no grad, batch 1, each rank on its share of the validation clips,
//! the centre crop (`DATA.VAL_CROP_SIZE`) or the full frame, run whole or by
//! overlapping tiles (`DATA.VAL_TILE`, `DATA.VAL_TILE_OVERLAP`); PSNR/SSIM of the
//! output and PSNR of the blurred input summed online and over ranks.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::config::Config;
use crate::dataset::DatasetIndex;
use crate::eval::quality::{QualityAccumulator, QualitySums};
use crate::eval::tiles::{tiled_forward, Tiling};
use crate::model::Restorer;
use crate::pipeline::loader::{Loader, LoaderBudget, LoaderOptions, Purpose};
use crate::pipeline::sample::{ClipIndex, ClipWindows, CropMode};
use crate::pipeline::sampler::{DistributedSampler, Remainder, SamplerOptions};

use super::amp::AmpMode;
use super::env::RankEnv;
use super::oom::{test_hook, OomPhase, OomSite};
use super::tile_batch::TileBatch;
use super::transfer::batch_to_device;
use super::TrainError;

/// Alignment of tile starts in RGB pixels (a multiple of the spike ratio and of the
/// models' down-sampling).
pub const TILE_ALIGN: i64 = 16;

/// One rank's validation data and settings.
pub struct Validator {
    loader: Option<Loader>,
    forward: ClipForward,
    tile_batch: TileBatch,
    clips: usize,
}

/// How a clip goes through the model.
struct ClipForward {
    tile: Option<(i64, i64)>,
    device: Device,
    amp: AmpMode,
    oom: OomSite,
}

impl Validator {
    /// Clips of `index` (windows of `DATA.CLIP_LEN`, every frame covered), every
    /// world-th one from this rank on (each clip validated once over the ranks),
    /// read through the node cache when one runs, with the rank's loader `budget`
    /// (at most two workers, `VAL_PREFETCH_FACTOR` batches ahead each).
    pub fn new(
        config: &Config,
        index: Arc<DatasetIndex>,
        env: &RankEnv,
        budget: &LoaderBudget,
        amp: AmpMode,
    ) -> Result<Validator, TrainError> {
        let (rank, device) = (env.rank, env.device);
        let all = ClipIndex::new(&index, ClipWindows::covering(config.data.clip_len as usize));
        let sampler = if all.clips.is_empty() {
            None
        } else {
            let options = SamplerOptions {
                world: env.world_size,
                rank,
                shuffle: false,
                seed: 0,
                remainder: Remainder::Uneven,
            };
            Some(DistributedSampler::new(all.clips.len(), options)?)
        };
        let clips = sampler.as_ref().map_or(0, |s| s.num_samples());
        let mut options = LoaderOptions::from_config(
            config,
            rank,
            budget,
            Purpose::Validate,
            env.cache_addr.clone(),
        );
        options.client_name = format!("rank{rank}-val");
        let loader = match sampler {
            Some(sampler) if clips > 0 => {
                Some(Loader::new(index, Arc::new(all), sampler, options.clone())?)
            }
            _ => None,
        };
        let tile = match (options.spec.crop, config.data.val_tile) {
            (CropMode::Full, Some(tile)) => {
                Some((tile as i64, config.data.val_tile_overlap as i64))
            }
            _ => None,
        };
        Ok(Validator {
            loader,
            forward: ClipForward {
                tile,
                device,
                amp,
                oom: OomSite::validation(config, Vec::new(), device),
            },
            tile_batch: TileBatch::new(device),
            clips,
        })
    }

    /// Clips this rank validates.
    pub fn clips(&self) -> usize {
        self.clips
    }

    /// Runs the model on this rank's clips and returns its sums (not yet over ranks)
    /// and a [`Preview`] of each of the first `previews` clips.
    pub fn run(
        &mut self,
        model: &dyn Restorer,
        previews: usize,
    ) -> Result<(QualitySums, Vec<Preview>), TrainError> {
        let mut sums = QualityAccumulator::default();
        let mut kept = Vec::with_capacity(previews);
        let Some(loader) = &mut self.loader else {
            return Ok((QualitySums::default(), kept));
        };
        loader.set_epoch(0);
        while let Some(batch) = loader.next_batch() {
            let forward = &self.forward;
            let (blur, sharp, voxels) = batch_to_device(&batch?, forward.device)?;
            let voxels = model.uses_voxels().then_some(&voxels);
            let site = forward.oom.with_shape(blur.size());
            let at_once = self.tile_batch.before_clip();
            let output = match forward.clip(model, &blur, voxels, at_once) {
                Err(TrainError::OutOfMemory(e)) if at_once > 1 => {
                    tracing::warn!(tiles_at_once = at_once, error = %e, "validation out of memory with tiles batched: one tile at a time from now on");
                    self.tile_batch.fall_back();
                    crate::ddp::empty_cuda_cache()?;
                    forward.clip(model, &blur, voxels, 1)
                }
                other => other,
            }?;
            self.tile_batch.after_clip();
            sums.add_clip(&output.get(0), &blur.get(0), &sharp.get(0))
                .map_err(|e| site.classify(e.into()))?;
            if kept.len() < previews {
                kept.push(Preview::first_frame(&blur, &output, &sharp));
            }
        }
        Ok((sums.read()?, kept))
    }
}

impl ClipForward {
    /// The model's output for one clip, whole or by tiles `at_once` at a time.
    fn clip(
        &self,
        model: &dyn Restorer,
        blur: &Tensor,
        voxels: Option<&Tensor>,
        at_once: usize,
    ) -> Result<Tensor, TrainError> {
        let site = self.oom.with_shape(blur.size());
        tch::no_grad(|| -> Result<Tensor, TrainError> {
            let (device, amp) = (self.device, self.amp);
            let mut forward = |b: &Tensor, v: Option<&Tensor>| -> Result<Tensor, TrainError> {
                test_hook(OomPhase::Validation, device)?;
                let y = amp.run(|| model.forward(b, v, false))?;
                Ok(y.f_to_kind(Kind::Float)?)
            };
            match self.tile {
                Some((tile, overlap)) => {
                    let tiling = Tiling {
                        tile,
                        overlap,
                        align: TILE_ALIGN,
                        batch: at_once,
                    };
                    tiled_forward(&mut forward, blur, voxels, tiling)
                }
                None => forward(blur, voxels),
            }
        })
        .map_err(|e| site.classify(e))
    }
}

/// Most rows of a preview (taller frames are shrunk by an integer factor).
const PREVIEW_MAX_HEIGHT: i64 = 256;

/// The first frame of a validation clip to look at: float CHW in [0, 1] on the CPU.
pub struct Preview {
    /// The blurred input.
    pub blur: Tensor,
    /// The model's output.
    pub output: Tensor,
    /// The sharp target.
    pub sharp: Tensor,
}

impl Preview {
    /// Frame 0 of clip 0 of batches shaped `[clip, frame, channel, height, width]`.
    fn first_frame(blur: &Tensor, output: &Tensor, sharp: &Tensor) -> Preview {
        let frame = |t: &Tensor| {
            let chw = t.get(0).get(0).to_kind(Kind::Float);
            let factor = (chw.size()[1] + PREVIEW_MAX_HEIGHT - 1) / PREVIEW_MAX_HEIGHT;
            let small = if factor > 1 {
                chw.unsqueeze(0)
                    .avg_pool2d(
                        [factor, factor],
                        [factor, factor],
                        [0, 0],
                        false,
                        true,
                        None,
                    )
                    .squeeze_dim(0)
            } else {
                chw
            };
            small.to_device(Device::Cpu)
        };
        Preview {
            blur: frame(blur),
            output: frame(output),
            sharp: frame(sharp),
        }
    }
}
