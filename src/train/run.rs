//! One rank's training run as typed parts, built from the config and the rank
//! environment by [`RunBuilder`] (data, communication, model and optimizer, state,
//! sinks; resumed from the newest checkpoint when there is one), and its optimizer
//! step [`Run::step`]: gradient accumulation, AMP, DDP averaging, NaN/inf skipping.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use tch::{nn, Device, Kind, Tensor};

use crate::config::{Config, Workers};
use crate::dataset::{DataError, DatasetIndex, IndexOptions};
use crate::ddp::{GradSync, ReduceOp};
use crate::eval::quality::QualitySums;
use crate::model::Restorer;
use crate::monitor::memory::MemoryMonitor;
use crate::pipeline::loader::{Batch, Loader, LoaderOptions, Purpose};
use crate::pipeline::node_workers;
use crate::pipeline::sample::{ClipIndex, ClipWindows};
use crate::pipeline::sampler::{DistributedSampler, SamplerOptions, SamplerState};

use super::amp::{AmpMode, GradScaler, LossScaler};
use super::checkpoint::{self, TrainState};
use super::comm::{self, BackwardFailure, Communication};
use super::env::RankEnv;
use super::figures::{read_pending, LocalFigures, PendingStep, Settled, UpdateFigures};
use super::heartbeat::{self, Phase};
use super::loader_settings::{LoaderSettings, NodeFacts};
use super::loss::f_charbonnier;
use super::metrics::MetricsSink;
use super::oom::{self, OomPhase, OomSite};
use super::optim::{AdamW, FixPolicy, ParamGroup, ParamGroups};
use super::preempt;
use super::report::{LogWindow, SettledStep, StepReport};
use super::schedule::CosineSchedule;
use super::step::{apply_update, UpdateOptions};
use super::transfer::batch_to_device;
use super::validate::Validator;
use super::{TrainError, TrainOptions};

/// The data of a run.
pub struct RunData {
    /// This rank's training batches.
    pub loader: Loader,
    /// This rank's validation clips (none without a `test` split).
    pub validator: Option<Validator>,
    /// Training clips of the whole job.
    pub train_clips: usize,
}

/// The model and what updates it.
pub struct ModelParts {
    /// The model's variables.
    pub vs: nn::VarStore,
    /// The model.
    pub model: Box<dyn Restorer>,
    /// AdamW over the trainable parameters, sorted by name.
    pub optimizer: AdamW,
    /// The learning rate schedule.
    pub schedule: CosineSchedule,
    /// The precision of forward passes.
    pub amp: AmpMode,
    /// The fp16 loss scaler (the identity otherwise), on the model's device.
    pub scaler: LossScaler,
    /// Trainable parameters.
    pub parameter_count: i64,
}

/// Where figures go.
pub struct Sinks {
    /// `metrics.jsonl` and the progress bar (rank 0; disabled elsewhere).
    pub metrics: MetricsSink,
    /// Memory samples.
    pub monitor: MemoryMonitor,
}

/// The last validation over all ranks.
#[derive(Debug, Clone, Copy)]
pub struct Validation {
    /// The step it ran after.
    pub step: u64,
    /// Its sums over ranks.
    pub sums: QualitySums,
}

/// Figures of this attempt (what outlives it is in [`TrainState`]).
pub struct Attempt {
    /// When the attempt started.
    pub started: Instant,
    /// `samples_seen` at the start.
    pub start_samples: u64,
    /// The checkpoint it resumed from.
    pub resumed_from: Option<PathBuf>,
    /// Seconds in steps not yet added to the state's `train_seconds`.
    pub unsaved_seconds: f64,
    /// Seconds in steps.
    pub step_seconds: f64,
    /// Mean loss over ranks of each step: (step number, loss).
    pub losses: Vec<(u64, f64)>,
    /// Figures since the last `train` log line.
    pub window: LogWindow,
    /// The last validation.
    pub last_val: Option<Validation>,
    /// The last step asked to stop with a checkpoint.
    pub preempted: bool,
    /// Steps whose figures are still on the device (read at the next settle).
    pub pending: Vec<PendingStep>,
}

/// One rank's run.
pub struct Run<'a> {
    /// The run config.
    pub config: &'a Config,
    /// This rank.
    pub env: &'a RankEnv,
    /// The step this attempt stops at (`TRAIN.TOTAL_STEPS` or `stop_after_steps`).
    pub stop_at: u64,
    /// Training and validation data.
    pub data: RunData,
    /// The other ranks.
    pub comm: Box<dyn Communication>,
    /// Model, optimizer, schedule.
    pub model: ModelParts,
    /// What a checkpoint saves.
    pub state: TrainState,
    /// Figures of this attempt.
    pub attempt: Attempt,
    /// Metrics and memory.
    pub sinks: Sinks,
}

/// The dataset splits of a run.
struct Splits {
    train: Arc<DatasetIndex>,
    clips: Arc<ClipIndex>,
    val: Option<Arc<DatasetIndex>>,
}

/// Builds a [`Run`]; every rank of the job must build one.
pub struct RunBuilder<'a> {
    config: &'a Config,
    env: &'a RankEnv,
    options: &'a TrainOptions,
}

impl<'a> RunBuilder<'a> {
    /// A builder for `config` on this rank.
    pub fn new(config: &'a Config, env: &'a RankEnv, options: &'a TrainOptions) -> Self {
        RunBuilder {
            config,
            env,
            options,
        }
    }

    /// Opens the data, builds the model, resumes, connects to the other ranks and
    /// writes the `start` event.
    pub fn build(self) -> Result<Run<'a>, TrainError> {
        let (config, env) = (self.config, self.env);
        heartbeat::start(env);
        let started = Instant::now();
        let dir = env.checkpoint_dir();
        std::fs::create_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
        let splits = open_splits(config)?;
        let loader_settings = resolve_loader_settings(config, env, &splits.train);
        let mut model = build_model(config, env.device)?;
        let sampler = DistributedSampler::new(
            splits.clips.clips.len(),
            SamplerOptions {
                world: env.world_size,
                rank: env.rank,
                shuffle: true,
                seed: config.train.seed,
                remainder: loader_settings.remainder,
            },
        )?;
        let resumed_from = checkpoint::latest(&dir);
        let state = match &resumed_from {
            Some(path) => resume(path, &mut model, env.rank)?,
            None => fresh_state(config, &mut model, &sampler, env.world_size)?,
        };
        model.scaler = LossScaler::new(state.scaler, env.device)?;
        let mut comm = comm::connect(config, env, model.optimizer.params())?;
        check_same_start(comm.as_mut(), &state, env)?;
        let cursor = resumed_from.is_some().then_some(state.sampler);
        if resumed_from.is_some() && state.world_size != env.world_size && env.rank == 0 {
            // Not an error: the sampler splits the rest of the epoch over this world.
            tracing::warn!(
                "resuming a checkpoint of {} ranks with {}: the rest of the epoch is split over \
                 the new world (no sample twice or skipped), and the global batch is \
                 TRAIN.BATCH_SIZE {} x TRAIN.GRADIENT_ACCUMULATION_STEPS {} x {} ranks",
                state.world_size,
                env.world_size,
                config.train.batch_size,
                config.train.gradient_accumulation_steps,
                env.world_size
            );
        }
        let data = open_data(
            config,
            env,
            &loader_settings,
            splits,
            sampler,
            cursor,
            model.amp,
        )?;
        let total = config.train.total_steps;
        let metrics = MetricsSink::new(&env.run_dir, env.rank == 0, state.step, total)
            .map_err(|e| TrainError::io(&env.run_dir, e))?
            .with_tensorboard(config.log.tensorboard);
        let monitor = MemoryMonitor::new(match env.device {
            Device::Cuda(n) => Some(n),
            _ => None,
        });
        let attempt = Attempt {
            started,
            start_samples: state.samples_seen,
            resumed_from,
            unsaved_seconds: 0.0,
            step_seconds: 0.0,
            losses: Vec::new(),
            window: LogWindow::default(),
            last_val: None,
            preempted: false,
            pending: Vec::new(),
        };
        let mut run = Run {
            config,
            env,
            stop_at: self
                .options
                .stop_after_steps
                .map_or(total, |s| s.min(total)),
            data,
            comm,
            model,
            state,
            attempt,
            sinks: Sinks { metrics, monitor },
        };
        run.announce();
        Ok(run)
    }
}

/// The training split with its clips, and the validation split when there is one.
fn open_splits(config: &Config) -> Result<Splits, TrainError> {
    let root = config.data.root.clone().ok_or_else(|| TrainError::Config {
        key: "DATA.ROOT".into(),
        message: "not set: the dataset root (e.g. written by `vrtspike synth --out DIR`)".into(),
    })?;
    if !root.is_dir() {
        return Err(TrainError::Config {
            key: "DATA.ROOT".into(),
            message: format!(
                "the dataset root {} does not exist or is not a directory",
                root.display()
            ),
        });
    }
    let index_options = IndexOptions::from_config(&config.data);
    let train = Arc::new(DatasetIndex::open(&root, "train", index_options)?);
    let windows = ClipWindows::sliding(config.data.clip_len as usize);
    let clips = Arc::new(ClipIndex::new(&train, windows));
    let val = match DatasetIndex::open(&root, "test", index_options) {
        Ok(index) => Some(Arc::new(index)),
        Err(DataError::Missing { path, .. }) => {
            tracing::warn!(path = %path.display(), "no validation split: validation skipped");
            None
        }
        Err(e) => return Err(e.into()),
    };
    Ok(Splits { train, clips, val })
}

/// The model from `MODEL` (seeded by `TRAIN.SEED`), AdamW over its trainable
/// parameters sorted by name (in the groups of `TRAIN.FIX_KEYS`), the schedule and
/// the precision.
pub(crate) fn build_model(config: &Config, device: Device) -> Result<ModelParts, TrainError> {
    let tc = &config.train;
    tch::manual_seed(tc.seed as i64);
    let vs = nn::VarStore::new(device);
    let model = crate::model::build(&vs.root(), &config.model)?;
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
    let groups = param_groups(tc, &names)?;
    let parameter_count = params.iter().map(|p| p.numel() as i64).sum();
    let optimizer = AdamW::new(params, tc.betas, tc.eps, tc.weight_decay)
        .with_groups(groups)
        .map_err(|e| TrainError::Config {
            key: "TRAIN.FIX_KEYS".into(),
            message: e.to_string(),
        })?;
    let amp = AmpMode::from_config(tc, device);
    Ok(ModelParts {
        vs,
        model,
        optimizer,
        schedule: CosineSchedule::from_config(tc),
        amp,
        scaler: LossScaler::new(GradScaler::new(amp == AmpMode::Fp16), device)?,
        parameter_count,
    })
}

/// The optimizer groups of the parameters `names` (sorted): `TRAIN.FIX_KEYS` that
/// select nothing while `FIX_ITER` / `FIX_LR_MUL` are set is a config error.
fn param_groups(
    tc: &crate::config::TrainConfig,
    names: &[String],
) -> Result<ParamGroups, TrainError> {
    let policy = FixPolicy::from_config(tc);
    let groups = ParamGroups::by_name(names, &tc.fix_keys, policy);
    let matters = policy.fix_iter > 0 || policy.lr_mul != 1.0;
    if matters && groups.fixed_names().is_empty() {
        let examples: Vec<&str> = names.iter().take(6).map(String::as_str).collect();
        return Err(TrainError::Config {
            key: "TRAIN.FIX_KEYS".into(),
            message: format!(
                "{:?} matches no parameter name (FIX_ITER {}, FIX_LR_MUL {}); the model's {} \
                 parameters are named like: {}",
                tc.fix_keys,
                tc.fix_iter,
                tc.fix_lr_mul,
                names.len(),
                examples.join(", ")
            ),
        });
    }
    Ok(groups)
}

/// The state of a run that starts at step 0.
fn fresh_state(
    config: &Config,
    model: &mut ModelParts,
    sampler: &DistributedSampler,
    world: usize,
) -> Result<TrainState, TrainError> {
    Ok(TrainState {
        step: 0,
        optimizer_steps: 0,
        skipped_steps: 0,
        samples_seen: 0,
        sampler: sampler.state(),
        scaler: GradScaler::new(model.amp == AmpMode::Fp16),
        schedule: model.schedule.into(),
        seed: config.train.seed,
        world_size: world,
        train_seconds: 0.0,
        fixed_group: model.optimizer.fixed_state()?,
    })
}

/// Loads the checkpoint at `path` into the model and optimizer.
fn resume(path: &Path, model: &mut ModelParts, rank: usize) -> Result<TrainState, TrainError> {
    let state = checkpoint::load(path, &model.vs, &mut model.optimizer)?;
    if rank == 0 {
        tracing::info!(checkpoint = %path.display(), step = state.step, "resuming");
    }
    Ok(state)
}

/// Every rank must resume from the same step (a run directory not shared by all
/// nodes would silently mix fresh and resumed optimizer state).
fn check_same_start(
    comm: &mut dyn Communication,
    state: &TrainState,
    env: &RankEnv,
) -> Result<(), TrainError> {
    let highest = comm.all_reduce(&[state.step as f64], ReduceOp::Max)?[0];
    let lowest = comm.all_reduce(&[state.step as f64], ReduceOp::Min)?[0];
    if highest == lowest {
        return Ok(());
    }
    Err(TrainError::Config {
        key: "run directory".into(),
        message: format!(
            "ranks resume from different steps ({lowest} to {highest}; this rank {} from {}): \
             every node must see the same {}",
            env.rank,
            state.step,
            env.checkpoint_dir().display()
        ),
    })
}

/// The loader settings of this rank, resolved once (and logged by rank 0).
fn resolve_loader_settings(config: &Config, env: &RankEnv, train: &DatasetIndex) -> LoaderSettings {
    let mut node = NodeFacts::this_machine(env.local_world_size, env.device.is_cuda());
    if let (Workers::Auto, Some(address)) = (config.dataloader.total_workers, &env.cache_addr) {
        let job = crate::cache::client::job_label();
        match node_workers::other_jobs_workers_at(address, &job) {
            Ok(count) => node.other_jobs_workers = count,
            // The loader reports a server it cannot reach; auto sizes for the node.
            Err(error) => tracing::debug!(%error, "other jobs' loader workers not known"),
        }
    }
    let settings = LoaderSettings::resolve(config, node, Some(train));
    if env.rank == 0 {
        settings.log();
    }
    settings
}

/// This rank's training loader (at `cursor` when resuming) and validator.
fn open_data(
    config: &Config,
    env: &RankEnv,
    loader_settings: &LoaderSettings,
    splits: Splits,
    sampler: DistributedSampler,
    cursor: Option<SamplerState>,
    amp: AmpMode,
) -> Result<RunData, TrainError> {
    let rank = env.rank;
    let options = LoaderOptions::from_config(
        config,
        rank,
        &loader_settings.budget,
        Purpose::Train,
        env.cache_addr.clone(),
    );
    if config.data.use_ram_cache && env.cache_addr.is_none() && rank == 0 {
        tracing::warn!("no cache server (VRTSPIKE_CACHE_ADDR unset): reading from disk");
    }
    let train_clips = splits.clips.clips.len();
    let mut loader = Loader::new(splits.train, splits.clips, sampler, options)?;
    if let Some(mut cursor) = cursor {
        cursor.rank = rank;
        loader.restore(&cursor)?;
    }
    let validator = match splits.val {
        Some(index) => Some(Validator::new(
            config,
            index,
            env,
            &loader_settings.budget,
            amp,
        )?),
        None => None,
    };
    Ok(RunData {
        loader,
        validator,
        train_clips,
    })
}

/// The next training batch, starting the next epoch when one ends.
fn next_batch(loader: &mut Loader) -> Result<Batch, TrainError> {
    for _ in 0..2 {
        match loader.next_batch() {
            Some(batch) => return Ok(batch?),
            None => {
                let epoch = loader.state().epoch + 1;
                tracing::debug!(epoch, "new epoch");
                loader.set_epoch(epoch);
            }
        }
    }
    Err(DataError::Request(
        "the training loader yields no batch (fewer clips than the batch size?)".into(),
    )
    .into())
}

/// Seed of libtorch's generator for step `step` (so a resumed run draws the same numbers).
fn step_seed(seed: u64, step: u64) -> i64 {
    (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xBF58_476D_1CE4_E5B9)) as i64
        & i64::MAX
}

/// This rank's part of a step, before the reduction over ranks.
struct LocalStep {
    /// The losses, on the device.
    figures: LocalFigures,
    /// The samples of each micro-batch (`sequence/frame+frame`).
    micro_samples: Vec<Vec<String>>,
    /// Samples of the step.
    samples: usize,
}

/// The micro-batches of a step so far.
#[derive(Default)]
struct MicroBatches {
    /// Their losses (0-dim, divided by the accumulation), on the device.
    losses: Vec<Tensor>,
    /// Their input losses, likewise.
    input_losses: Vec<Tensor>,
    /// Each one's samples (`sequence/frame+frame`).
    samples: Vec<Vec<String>>,
    /// Samples in all.
    count: usize,
}

/// What the host learns of a step from the other ranks.
struct HostFlags {
    preempt_ranks: f64,
    samples: u64,
}

impl Run<'_> {
    /// Installs the preemption handler, logs the start and writes the `start` event.
    fn announce(&mut self) {
        if let Err(e) = preempt::install() {
            tracing::warn!(error = %e, "cannot install the SIGUSR2 handler: preemption requests will kill this rank");
        }
        if self.env.rank != 0 {
            return;
        }
        for notice in self.config.notices() {
            tracing::warn!("config notice: {notice}");
        }
        self.announce_groups();
        let (env, state, model) = (self.env, &self.state, &self.model);
        tracing::info!(
            world = env.world_size,
            params = model.parameter_count,
            clips = self.data.train_clips,
            val_clips = self.data.validator.as_ref().map_or(0, |v| v.clips()),
            start_step = state.step,
            total_steps = self.config.train.total_steps,
            amp = model.amp.name(),
            device = ?env.device,
            "training"
        );
        let resumed_from = self.attempt.resumed_from.as_ref();
        self.sinks.metrics.write(
            "event",
            json!({"event": "start", "step": state.step, "world_size": env.world_size, "restart_count": env.restart_count,
                   "resumed_from": resumed_from.map(|p| p.display().to_string()), "parameters": model.parameter_count}),
        );
    }

    /// Logs the sizes of the optimizer's parameter groups (with `TRAIN.FIX_KEYS`).
    fn announce_groups(&self) {
        if self.config.train.fix_keys.is_empty() {
            return;
        }
        let optimizer = &self.model.optimizer;
        let (main, fixed) = (
            optimizer.group_size(ParamGroup::Main),
            optimizer.group_size(ParamGroup::Fixed),
        );
        let policy = optimizer.groups().policy();
        tracing::info!(
            main_tensors = main.tensors,
            main_params = main.elements,
            fixed_tensors = fixed.tensors,
            fixed_params = fixed.elements,
            fix_keys = ?self.config.train.fix_keys,
            frozen_steps = policy.fix_iter,
            fixed_lr_mul = policy.lr_mul,
            "parameter groups"
        );
    }

    /// Logs (rank 0) the step at which the fixed parameter group starts training.
    fn note_unfreeze(&self, step: u64) {
        let optimizer = &self.model.optimizer;
        let policy = optimizer.groups().policy();
        let unfreezes = policy.fix_iter > 0 && step == policy.fix_iter;
        if self.env.rank != 0 || !unfreezes || optimizer.groups().fixed_names().is_empty() {
            return;
        }
        let fixed = optimizer.group_size(ParamGroup::Fixed);
        tracing::info!(
            step = step + 1,
            fixed_tensors = fixed.tensors,
            fixed_params = fixed.elements,
            lr_mul = policy.lr_mul,
            "the fixed parameter group (TRAIN.FIX_KEYS) unfreezes"
        );
    }

    /// One optimizer step over all ranks; every rank must call it. Nothing is read
    /// back from the device (with several ranks, one collective on host values
    /// carries the preemption flags and sample counts): the step's figures wait on
    /// the device for [`Run::settle`].
    pub fn step(&mut self) -> Result<StepReport, TrainError> {
        let started = Instant::now();
        let step = self.state.step;
        let lr = self.model.schedule.lr_at(step);
        self.note_unfreeze(step);
        tch::manual_seed(step_seed(self.config.train.seed, step));
        let site = OomSite::training(self.config, step + 1, Vec::new(), self.env.device)
            .in_phase(OomPhase::Optimizer);
        self.model
            .optimizer
            .zero_grad()
            .map_err(|e| site.torch(e))?;
        let local = self.accumulate()?;
        heartbeat::beat(step, Phase::AllReduce);
        self.comm.sync_gradients()?;
        let mut global = local
            .figures
            .sums
            .f_mul_scalar(1.0)
            .map_err(|e| site.torch(e))?;
        self.comm.all_reduce_device(&mut global, ReduceOp::Sum)?;
        let flags = self.host_flags(&local)?;
        heartbeat::beat(step, Phase::Optimizer);
        oom::test_hook(OomPhase::Optimizer, self.env.device).map_err(|e| site.torch(e))?;
        let outcome = global
            .f_select(0, 1)
            .and_then(|bad_ranks| {
                apply_update(
                    &mut self.model.optimizer,
                    &mut self.model.scaler,
                    &bad_ranks,
                    UpdateOptions {
                        step,
                        lr,
                        max_grad_norm: self.config.train.grad_clip(),
                    },
                )
            })
            .map_err(|e| site.torch(e))?;
        let pending = self
            .model
            .scaler
            .scale_tensor()
            .and_then(|loss_scale| {
                let update = UpdateFigures {
                    grad_norm: &outcome.grad_norm,
                    skipped: &outcome.skipped,
                    loss_scale: &loss_scale,
                };
                PendingStep::new(
                    step + 1,
                    &global,
                    &local.figures,
                    update,
                    local.micro_samples,
                )
            })
            .map_err(|e| site.torch(e))?;
        self.attempt.pending.push(pending);
        self.sinks.monitor.poll();
        let report = self.record(lr, &flags);
        let seconds = started.elapsed().as_secs_f64();
        self.attempt.unsaved_seconds += seconds;
        self.attempt.step_seconds += seconds;
        self.attempt.window.add(&report);
        self.attempt.preempted = report.preempted;
        Ok(report)
    }

    /// Forward and backward passes of `TRAIN.GRADIENT_ACCUMULATION_STEPS`
    /// micro-batches. Every micro-batch's backward runs, a non-finite loss's too
    /// (whether it is finite is known only on the device): its gradients are not
    /// finite either, and the step is skipped on every rank.
    fn accumulate(&mut self) -> Result<LocalStep, TrainError> {
        let accum = self.config.train.gradient_accumulation_steps as usize;
        let mut parts = MicroBatches::default();
        for micro in 0..accum {
            self.micro_batch(GradSync::for_micro_batch(micro, accum), accum, &mut parts)?;
        }
        let site = OomSite::training(
            self.config,
            self.state.step + 1,
            Vec::new(),
            self.env.device,
        );
        let figures =
            LocalFigures::new(&parts.losses, &parts.input_losses).map_err(|e| site.torch(e))?;
        Ok(LocalStep {
            figures,
            micro_samples: parts.samples,
            samples: parts.count,
        })
    }

    /// One micro-batch's forward and backward pass (of `accum`), its losses kept on
    /// the device in `parts`.
    fn micro_batch(
        &mut self,
        sync: GradSync,
        accum: usize,
        parts: &mut MicroBatches,
    ) -> Result<(), TrainError> {
        let (model, amp) = (&self.model.model, self.model.amp);
        let (step, device) = (self.state.step, self.env.device);
        heartbeat::beat(step, Phase::Data);
        let batch = next_batch(&mut self.data.loader)?;
        let (blur, sharp, voxels) = batch_to_device(&batch, device)?;
        let voxels = model.uses_voxels().then_some(&voxels);
        let site = OomSite::training(self.config, step + 1, blur.size(), device);
        heartbeat::beat(step, Phase::Forward);
        oom::test_hook(OomPhase::Forward, device).map_err(|e| site.torch(e))?;
        self.comm.before_forward(sync)?;
        let output = amp
            .run(|| model.forward(&blur, voxels, true))
            .map_err(|e| site.model(e))?;
        let eps = self.config.train.charbonnier_eps;
        let loss = output
            .f_to_kind(Kind::Float)
            .and_then(|y| f_charbonnier(&y, &sharp, eps))
            .and_then(|l| l.f_div_scalar(accum as f64))
            .map_err(|e| site.torch(e))?;
        let input_loss =
            tch::no_grad(|| f_charbonnier(&blur, &sharp, eps)?.f_div_scalar(accum as f64))
                .map_err(|e| site.torch(e))?;
        parts.count += batch.samples.len();
        parts.samples.push(
            batch
                .samples
                .iter()
                .map(|s| format!("{}/{}", s.sequence, s.frames.join("+")))
                .collect(),
        );
        heartbeat::beat(step, Phase::Backward);
        let site = site.in_phase(OomPhase::Backward);
        oom::test_hook(OomPhase::Backward, device).map_err(|e| site.torch(e))?;
        let scaled = self
            .model
            .scaler
            .scale_loss(&loss)
            .map_err(|e| site.torch(e))?;
        let scaled = heartbeat::in_backward(&scaled).map_err(|e| site.model(e))?;
        self.comm.backward(&scaled, sync).map_err(|e| match e {
            BackwardFailure::Torch(e) => site.torch(e),
            BackwardFailure::Comm(e) => e,
        })?;
        parts.losses.push(loss.detach());
        parts.input_losses.push(input_loss);
        Ok(())
    }

    /// The preemption flags and sample counts of every rank (with one rank, its own:
    /// nothing to exchange, nothing read back).
    fn host_flags(&mut self, local: &LocalStep) -> Result<HostFlags, TrainError> {
        let flags = [
            f64::from(u8::from(preempt::requested())),
            local.samples as f64,
        ];
        let sums = self.comm.all_reduce(&flags, ReduceOp::Sum)?;
        let sum = |i: usize| sums.get(i).copied().unwrap_or(f64::NAN);
        Ok(HostFlags {
            preempt_ranks: sum(0),
            samples: sum(1) as u64,
        })
    }

    /// Advances the state past the step and reports it.
    fn record(&mut self, lr: f64, flags: &HostFlags) -> StepReport {
        let state = &mut self.state;
        state.step += 1;
        state.samples_seen += flags.samples;
        let finished = state.step == self.config.train.total_steps;
        StepReport {
            step: state.step,
            lr,
            samples: flags.samples,
            finished,
            preempted: !finished && (flags.preempt_ranks > 0.0 || state.step == self.stop_at),
        }
    }

    /// Reads the figures of every step since the last settle back from the device,
    /// in one read (with the optimizer's step counts and the loss scaler), and brings
    /// the state, the log window and the losses up to date; a skipped step is logged
    /// and written as an event by rank 0, a non-finite loss logged by its rank. Every
    /// rank calls it at the same steps (log steps, checkpoints, the end).
    pub fn settle(&mut self) -> Result<Vec<SettledStep>, TrainError> {
        if self.attempt.pending.is_empty() {
            return Ok(Vec::new());
        }
        let read = self
            .model
            .optimizer
            .count_tensor()
            .and_then(|counts| {
                let scaler = self.model.scaler.state_tensor()?;
                read_pending(
                    &mut self.attempt.pending,
                    &counts,
                    &scaler,
                    self.env.world_size,
                )
            })
            .map_err(TrainError::Torch)?;
        self.model.optimizer.set_counts(read.counts);
        let state = &mut self.state;
        state.optimizer_steps = read.counts.main;
        state.fixed_group.steps = read.counts.fixed;
        state.scaler = self.model.scaler.settle(read.scaler);
        let mut settled = Vec::with_capacity(read.steps.len());
        for step in read.steps {
            self.note_settled(&step);
            settled.push(step.figures);
        }
        Ok(settled)
    }

    /// Books one settled step: losses, window, skip count, warnings and events.
    fn note_settled(&mut self, settled: &Settled) {
        let figures = &settled.figures;
        self.attempt.losses.push((figures.step, figures.mean_loss));
        self.attempt.window.add_settled(figures);
        if !settled.bad_samples.is_empty() {
            tracing::warn!(step = figures.step, rank = self.env.rank, samples = ?settled.bad_samples, "non-finite loss: the step is skipped on every rank, weights untouched");
        }
        if !figures.skipped {
            return;
        }
        self.state.skipped_steps += 1;
        if self.env.rank == 0 {
            tracing::warn!(
                step = figures.step,
                nonfinite_loss = figures.nonfinite_loss,
                "step skipped: inf/NaN loss or gradients"
            );
            self.sinks.metrics.write("event", json!({"event": "skipped_step", "step": figures.step, "nonfinite_loss": figures.nonfinite_loss,
                "samples": settled.bad_samples, "loss_scale": figures.loss_scale}));
        }
    }

    /// Logs and writes the `preempted` event (rank 0) before the run stops early.
    pub fn note_preempted(&mut self) {
        if self.env.rank == 0 {
            tracing::info!(
                step = self.state.step,
                "stopping after a checkpoint (preemption request or --stop-after-steps)"
            );
            self.sinks.metrics.write(
                "event",
                json!({"event": "preempted", "step": self.state.step}),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_seeds_differ_by_step_and_seed_and_stay_non_negative() {
        assert_eq!(step_seed(7, 3), step_seed(7, 3));
        assert_ne!(step_seed(7, 3), step_seed(7, 4));
        assert_ne!(step_seed(7, 3), step_seed(8, 3));
        assert!((0..1000).all(|s| step_seed(u64::MAX, s) >= 0));
    }
}
