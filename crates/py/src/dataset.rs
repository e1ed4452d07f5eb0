//! `NativeDataset`, what `vrtspike.data.Dataset` stands on: the split opened from
//! the run config, the node's cache server chosen and held by the process that made
//! it, and each process's own reader, made on its first sample (so a DataLoader
//! worker connects after the fork, never on an inherited connection). A sample
//! comes back as numpy arrays that own the Rust buffers (no copy), which
//! `torch.from_numpy` wraps, again without a copy.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use numpy::ndarray::Array4;
use numpy::PyArray4;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use vrtspike_data::cache::CacheClient;
use vrtspike_data::dataset::h5_probe;
use vrtspike_data::pipeline::draw::{Drawn, SamplePlace};
use vrtspike_data::pipeline::loader::Purpose;

use crate::errors::{guarded, Failure};
use crate::fork::{ours_or_make, ProcessBound};
use crate::reader::{Reader, Worker};
use crate::sampler::OrderKey;
use crate::server::{self, Hold, ServeWith};
use crate::settings::{DatasetSpec, Opened};

/// What the process that made a Dataset decided, handed to the processes that read
/// it (a DataLoader worker started by `spawn` rebuilds the Dataset from it).
#[derive(Debug, Clone)]
struct Decided {
    /// The cache server's address (`None`: from disk).
    address: Option<String>,
    /// The job's label on every connection of its readers.
    job: String,
}

/// A split of a GoPro-Spike dataset, read as the vrtspike loader reads it.
#[pyclass(module = "vrtspike._native", frozen)]
pub struct NativeDataset {
    opened: Opened,
    decided: Decided,
    /// How the server was had, for the user.
    how: String,
    warnings: Vec<String>,
    /// The main process's hold on the server.
    hold: Mutex<Option<ProcessBound<Hold>>>,
    /// This process's reader.
    reader: Mutex<Option<ProcessBound<Reader>>>,
}

/// Locks `mutex`; a poisoned one (a panic in an earlier call, already reported)
/// is taken as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[pymethods]
impl NativeDataset {
    /// Opens `split` of the dataset of the config (`config`: a YAML file, `None`:
    /// the defaults; `overrides`: `KEY.PATH=VALUE`), for training samples when
    /// `train` (default: the split is `train`). The process that makes it chooses
    /// the cache server and holds it; `decided` (address, job label) rebuilds it in
    /// a worker that reads for that process.
    #[new]
    #[pyo3(signature = (split, config=None, overrides=Vec::new(), train=None, server_binary=None, decided=None))]
    fn new(
        py: Python<'_>,
        split: String,
        config: Option<PathBuf>,
        overrides: Vec<String>,
        train: Option<bool>,
        server_binary: Option<PathBuf>,
        decided: Option<(Option<String>, String)>,
    ) -> PyResult<NativeDataset> {
        let purpose = match train.unwrap_or(split == "train") {
            true => Purpose::Train,
            false => Purpose::Validate,
        };
        let spec = DatasetSpec {
            config,
            overrides,
            split,
            purpose,
        };
        py.detach(|| guarded("Dataset", || {}, || open(spec, server_binary, decided)))
    }

    /// Clips of the split.
    fn __len__(&self) -> usize {
        self.opened.clips.clips.len()
    }

    /// The sample of `clip` at `position` of `rank`'s `epoch`: `(blur, sharp,
    /// voxel, info)`, the arrays `float32` in (L, C, h, w) order. With `order`
    /// (world, seed, shuffle, drop_last of the sampler that gave it) and the
    /// planned policy, this process's reader announces that order to the cache.
    /// `worker` is (id, count) of the DataLoader worker that reads, if any.
    #[pyo3(signature = (clip, epoch, rank, position, order=None, worker=None))]
    #[allow(clippy::too_many_arguments)]
    fn sample<'py>(
        &self,
        py: Python<'py>,
        clip: usize,
        epoch: u64,
        rank: usize,
        position: usize,
        order: Option<(usize, u64, bool, bool)>,
        worker: Option<(usize, usize)>,
    ) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        let place = SamplePlace {
            epoch,
            rank,
            position,
            clip,
        };
        let order = order.map(|(world, seed, shuffle, drop_last)| OrderKey {
            world,
            rank,
            seed,
            shuffle,
            drop_last,
        });
        let worker = worker.map(|(id, count)| Worker { id, count });
        let drawn = py.detach(|| {
            guarded(
                "Dataset sample",
                || *lock(&self.reader) = None,
                || self.draw(place, order, worker),
            )
        })?;
        into_python(py, drawn, place)
    }

    /// This process's reads so far: hits, misses, bypass (from disk), prefetched,
    /// disk_bytes, replaced (clips under `DATA.SKIP_BAD_FRAMES`), connected.
    fn reader_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = lock(&self.reader)
            .as_ref()
            .and_then(ProcessBound::get)
            .map(Reader::stats)
            .unwrap_or_default();
        let dict = PyDict::new(py);
        dict.set_item("hits", stats.hits)?;
        dict.set_item("misses", stats.misses)?;
        dict.set_item("bypass", stats.bypass)?;
        dict.set_item("prefetched", stats.prefetched)?;
        dict.set_item("disk_bytes", stats.disk_bytes)?;
        dict.set_item("replaced", stats.replaced)?;
        dict.set_item("connected", stats.connected)?;
        Ok(dict)
    }

    /// The cache server's statistics as JSON (what `vrtspike cache stats --json`
    /// prints), or `None` without a server.
    fn cache_stats_json(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let Some(address) = self.decided.address.clone() else {
            return Ok(None);
        };
        py.detach(|| {
            guarded(
                "cache stats",
                || {},
                || {
                    let client = CacheClient::connect(&address, "python cache stats")?;
                    let report = client.stats()?;
                    serde_json::to_string(&report)
                        .map(Some)
                        .map_err(|e| Failure::Request(format!("cache stats as JSON: {e}")))
                },
            )
        })
    }

    /// Drops this process's reader and its hold on the server (the server of its
    /// own job stops); the Dataset reads on with a new reader if asked again.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let reader = lock(&self.reader).take();
            drop(reader);
            let hold = lock(&self.hold).take();
            drop(hold);
        });
    }

    /// The cache server's address (`None`: every read from disk).
    #[getter]
    fn cache_address(&self) -> Option<String> {
        self.decided.address.clone()
    }

    /// How the cache server was had (`attached (node-shared)`, `started
    /// (node-shared)`, `started (job's)`, `not used ...`, `none: reading from disk`).
    #[getter]
    fn cache_how(&self) -> String {
        self.how.clone()
    }

    /// The job's label on its readers' connections.
    #[getter]
    fn job(&self) -> String {
        self.decided.job.clone()
    }

    /// What the user should know about how the Dataset reads (a fall-back to disk).
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.warnings.clone()
    }

    /// `TRAIN.SEED`: the seed of the sampler's shuffle and of the samples' draws.
    #[getter]
    fn seed(&self) -> u64 {
        self.opened.config.train.seed
    }

    /// `DATALOADER.DROP_LAST`.
    #[getter]
    fn drop_last(&self) -> bool {
        self.opened.config.dataloader.drop_last
    }

    /// Whether it cuts training samples (else validation samples).
    #[getter]
    fn train(&self) -> bool {
        self.opened.purpose == Purpose::Train
    }

    /// The resolved config as YAML.
    fn config_yaml(&self) -> String {
        self.opened.config.to_yaml()
    }
}

impl NativeDataset {
    fn draw(
        &self,
        place: SamplePlace,
        order: Option<OrderKey>,
        worker: Option<Worker>,
    ) -> Result<Drawn, Failure> {
        let mut slot = lock(&self.reader);
        let reader = ours_or_make(&mut slot, || {
            vrtspike_data::cache::client::set_job_label(&self.decided.job);
            let label = reader_label(&self.decided.job, place.rank, worker);
            Ok::<_, Failure>(Reader::open(self.decided.address.as_deref(), label))
        })?;
        reader.draw(&self.opened, place, order, worker)
    }
}

/// The label of a reader's connections in the server's stats.
fn reader_label(job: &str, rank: usize, worker: Option<Worker>) -> String {
    let who = match worker {
        Some(w) => format!("worker{}", w.id),
        None => "main".to_string(),
    };
    format!("{job}/rank{rank}/{who}/pid{}", std::process::id())
}

/// Opens the split and, in the process that makes the Dataset, chooses the server.
fn open(
    spec: DatasetSpec,
    server_binary: Option<PathBuf>,
    decided: Option<(Option<String>, String)>,
) -> Result<NativeDataset, Failure> {
    let binary = server_binary.map(|path| server::check_binary(&path));
    if let Some(Ok(path)) = &binary {
        // HDF5 sessions are probed in a child of the shipped binary (no libtorch).
        h5_probe::set_probe_executable(path.clone());
    }
    let opened = spec.open()?;
    if let Some((address, job)) = decided {
        return Ok(NativeDataset {
            opened,
            decided: Decided { address, job },
            how: "decided by the process that made the Dataset".into(),
            warnings: Vec::new(),
            hold: Mutex::new(None),
            reader: Mutex::new(None),
        });
    }
    let job = job_label();
    let started_by = format!("{job} (python pid {})", std::process::id());
    let with = ServeWith {
        binary: binary
            .as_ref()
            .and_then(|b| b.as_ref().ok())
            .map(PathBuf::as_path),
        config_file: spec.config.as_deref(),
        overrides: &spec.overrides,
        started_by: &started_by,
    };
    let mut choice = server::choose(&opened.config, &with);
    // Why no server could be started, beside the fall-back's warning (a Dataset
    // that reads from disk by its config wanted none and hears nothing).
    if let (Some(Err(why)), false) = (&binary, choice.warnings.is_empty()) {
        choice
            .warnings
            .push(format!("the shipped cache server is unusable: {why}"));
    }
    Ok(NativeDataset {
        opened,
        decided: Decided {
            address: choice.address,
            job,
        },
        how: choice.how,
        warnings: choice.warnings,
        hold: Mutex::new(choice.hold.map(ProcessBound::new)),
        reader: Mutex::new(None),
    })
}

/// This job's label: the launcher's run directory when it names one, else the
/// job's name as its ranks give it (torchrun's or srun's job, else this process).
fn job_label() -> String {
    let from_run_dir = vrtspike_data::cache::client::job_label();
    if !from_run_dir.is_empty() {
        return from_run_dir;
    }
    match vrtspike_contract::env::RankEnv::from_process_env() {
        Ok(env) => format!("py-{}", env.job_name()),
        Err(_) => format!("py-pid{}", std::process::id()),
    }
}

/// A drawn sample as Python objects: three arrays over the sample's own buffers
/// and a dict of what it is.
fn into_python<'py>(
    py: Python<'py>,
    drawn: Drawn,
    place: SamplePlace,
) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
    let s = drawn.sample;
    let rgb = s.rgb_shape();
    let vox = s.voxel_shape();
    let array = |shape: [usize; 4], values: Vec<f32>, name: &str| {
        Array4::from_shape_vec(shape, values)
            .map(|a| PyArray4::from_owned_array(py, a))
            .map_err(|e| {
                PyErr::from(Failure::Request(format!(
                    "sample {name} of shape {shape:?}: {e}"
                )))
            })
    };
    let blur = array(rgb, s.blur, "blur")?;
    let sharp = array(rgb, s.sharp, "sharp")?;
    let voxel = array(vox, s.voxel, "voxel")?;
    let info = PyDict::new(py);
    info.set_item("sequence", &s.sequence)?;
    info.set_item("frames", &s.frames)?;
    info.set_item("crop", (s.crop.y, s.crop.x, s.crop.h, s.crop.w))?;
    let t = s.transform;
    info.set_item("transform", (t.transpose, t.vflip, t.hflip))?;
    info.set_item("replaced", drawn.replaced)?;
    info.set_item("clip", place.clip)?;
    info.set_item("epoch", place.epoch)?;
    info.set_item("rank", place.rank)?;
    info.set_item("position", place.position)?;
    pyo3::types::PyTuple::new(
        py,
        [
            blur.into_any(),
            sharp.into_any(),
            voxel.into_any(),
            info.into_any(),
        ],
    )
}
