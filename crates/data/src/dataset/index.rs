//! The dataset index: sequences and their frames in time order, each frame's
//! spike step count and each sequence's sizes, all checked up front, over the
//! folder layout (PNG + `.dat`, or legacy `.npy` voxels) or HDF5 sessions. A bad
//! frame is an error naming the file, or with `skip_bad` a counted skip that
//! [`DatasetIndex::skipped`] reports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::BlurDir;

use super::dat;
use super::error::{DataError, Result};
use super::h5::{self, H5Session};
use super::h5_probe;
use super::image;
use super::meta::DatasetMeta;
use super::npy;
use super::record::{RecordLayout, SpikePayload};

/// One usable frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameEntry {
    /// File stem shared by `blur/`, `sharp/` and `spike/` (e.g. `000047`).
    pub name: String,
    /// Spike steps `T` of its `.dat` file (0 in a voxel sequence).
    pub spike_steps: u32,
}

/// Where a sequence's frames are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Storage {
    /// `blur/`, `sharp/` PNG and `spike/` `.dat` files.
    Folder,
    /// `blur/`, `sharp/` PNG and legacy `spike_vox/` `.npy` f32 grids of `bins` planes.
    FolderVoxels {
        /// Voxel planes `K`.
        bins: u32,
    },
    /// One open HDF5 session file.
    Hdf5(Arc<H5Session>),
}

/// One sequence (a folder under the split).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceIndex {
    /// Folder name (e.g. `GOPR0372_07_00`).
    pub name: String,
    /// `<root>/<split>/<name>` (a folder, or the `.h5` file).
    pub dir: PathBuf,
    /// RGB rows of every frame.
    pub height: u32,
    /// RGB columns of every frame.
    pub width: u32,
    /// Rows of the spike grid (or of the stored voxel grids).
    pub spike_height: u32,
    /// Columns of the spike grid (or of the stored voxel grids).
    pub spike_width: u32,
    /// How its frames are stored.
    pub storage: Storage,
    /// Usable frames in time (name) order.
    pub frames: Vec<FrameEntry>,
}

/// A frame that was skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedFrame {
    /// The file at fault.
    pub path: PathBuf,
    /// The error it gave.
    pub reason: String,
}

/// How to index a root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexOptions {
    /// `blur` or `blur_gamma` (`DATA.BLUR_DIR`).
    pub blur_dir: BlurDir,
    /// Skip bad frames (counted) instead of failing (`DATA.SKIP_BAD_FRAMES`).
    pub skip_bad: bool,
    /// HDF5 chunk cache per open session file, MiB (`DATA.CHUNK_CACHE_MB`).
    pub chunk_cache_mb: u32,
    /// Which spike files the folder layout is read from (`DATA.USE_PRECOMPUTED_VOXELS`).
    pub spike_source: SpikeSource,
}

/// Which spike files a folder-layout sequence is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpikeSource {
    /// `spike/*.dat` when the sequence has a `spike/` folder, else `spike_vox/*.npy`.
    #[default]
    Auto,
    /// Always the raw `spike/*.dat` streams.
    Raw,
    /// Always the precomputed `spike_vox/*.npy` voxel grids.
    Voxels,
}

impl SpikeSource {
    /// From `DATA.USE_PRECOMPUTED_VOXELS` (`true`, `false`, or unset).
    pub fn from_flag(use_precomputed_voxels: Option<bool>) -> SpikeSource {
        match use_precomputed_voxels {
            None => SpikeSource::Auto,
            Some(false) => SpikeSource::Raw,
            Some(true) => SpikeSource::Voxels,
        }
    }

    /// Whether a sequence folder `dir` is read from its voxel grids.
    fn voxels_in(self, dir: &Path) -> bool {
        match self {
            SpikeSource::Auto => !dir.join("spike").is_dir() && dir.join("spike_vox").is_dir(),
            SpikeSource::Raw => false,
            SpikeSource::Voxels => true,
        }
    }
}

impl Default for IndexOptions {
    fn default() -> Self {
        IndexOptions {
            blur_dir: BlurDir::default(),
            skip_bad: false,
            chunk_cache_mb: 64,
            spike_source: SpikeSource::Auto,
        }
    }
}

impl IndexOptions {
    /// Options from the `DATA` config section.
    pub fn from_config(data: &crate::config::DataConfig) -> IndexOptions {
        IndexOptions {
            blur_dir: data.blur_dir,
            skip_bad: data.skip_bad_frames,
            chunk_cache_mb: data.chunk_cache_mb,
            spike_source: SpikeSource::from_flag(data.use_precomputed_voxels),
        }
    }
}

/// The frames of one split of a dataset.
#[derive(Debug, Clone)]
pub struct DatasetIndex {
    /// Dataset root.
    pub root: PathBuf,
    /// `train` or `test` (any folder under the root).
    pub split: String,
    /// `dataset.yaml`.
    pub meta: DatasetMeta,
    /// Options it was built with.
    pub options: IndexOptions,
    /// Sequences in name order.
    pub sequences: Vec<SequenceIndex>,
    /// Frames skipped under `skip_bad` (empty otherwise).
    pub skipped: Vec<SkippedFrame>,
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') {
            out.push((name, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Stems of the files with extension `ext` in `dir`; a missing `dir` is an error
/// saying `why` it is needed.
fn stems(dir: &Path, ext: &str, why: &str) -> Result<BTreeSet<String>> {
    if !dir.is_dir() {
        return Err(DataError::Missing {
            path: dir.to_path_buf(),
            why: why.into(),
        });
    }
    Ok(read_dir_sorted(dir)?
        .into_iter()
        .filter_map(|(name, _)| name.strip_suffix(ext).map(str::to_owned))
        .collect())
}

impl DatasetIndex {
    /// Indexes `<root>/<split>` in whichever layout it holds: HDF5 sessions when
    /// `<split>` has `.h5` files, the folder layout otherwise.
    pub fn open(root: &Path, split: &str, options: IndexOptions) -> Result<DatasetIndex> {
        let split_dir = root.join(split);
        if split_dir.is_dir() && !h5::session_files(&split_dir)?.is_empty() {
            Self::open_h5(root, split, options)
        } else {
            Self::open_folder(root, split, options)
        }
    }

    /// Indexes the HDF5 sessions `<root>/<split>/*.h5` (kept open). `dataset.yaml`
    /// is optional here: the spike size comes from each file's attributes (and
    /// must agree with `dataset.yaml` when there is one).
    pub fn open_h5(root: &Path, split: &str, options: IndexOptions) -> Result<DatasetIndex> {
        let yaml = DatasetMeta::load(root);
        let split_dir = root.join(split);
        let files = h5::session_files(&split_dir)?;
        let meta = DatasetMeta {
            spike_height: 0,
            spike_width: 0,
            spike_flipped: false,
            blur_frames: Default::default(),
        };
        let mut index = DatasetIndex::empty(root, split, meta, options);
        let mut grid: Option<(u32, u32)> = match yaml {
            Ok(meta) => {
                let grid = (meta.spike_height, meta.spike_width);
                index.meta = meta;
                Some(grid)
            }
            Err(DataError::Missing { .. }) => None,
            Err(err) => return Err(err),
        };
        for path in files {
            let opened = h5_probe::open(&path, options.chunk_cache_mb).and_then(|session| {
                let this = (session.spike_height, session.spike_width);
                match grid {
                    Some(g) if g != this => Err(DataError::format(
                        &path,
                        format!(
                            "spike grid {}x{} differs from the dataset's {}x{}",
                            this.0, this.1, g.0, g.1
                        ),
                    )),
                    _ => Ok(session),
                }
            });
            let session = match opened {
                Ok(s) => s,
                Err(err) => {
                    index.skip_or_fail(err)?;
                    continue;
                }
            };
            grid = Some((session.spike_height, session.spike_width));
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            index.sequences.push(SequenceIndex {
                name,
                dir: path.clone(),
                height: session.height,
                width: session.width,
                spike_height: session.spike_height,
                spike_width: session.spike_width,
                frames: session
                    .frame_names
                    .iter()
                    .map(|n| FrameEntry {
                        name: n.clone(),
                        spike_steps: session.steps,
                    })
                    .collect(),
                storage: Storage::Hdf5(Arc::new(session)),
            });
        }
        if let Some((hs, ws)) = grid {
            index.meta.spike_height = hs;
            index.meta.spike_width = ws;
        }
        index.finished(&split_dir, "no usable HDF5 session (<SEQ>.h5)")
    }

    /// Indexes `<root>/<split>`: reads `dataset.yaml`, lists sequences and frames,
    /// checks every PNG header and `.dat` size.
    pub fn open_folder(root: &Path, split: &str, options: IndexOptions) -> Result<DatasetIndex> {
        let meta = DatasetMeta::load(root)?;
        let split_dir = root.join(split);
        if !split_dir.is_dir() {
            return Err(DataError::Missing {
                path: split_dir,
                why: format!("split '{split}' of the dataset"),
            });
        }
        let mut index = DatasetIndex::empty(root, split, meta, options);
        for (name, dir) in read_dir_sorted(&split_dir)? {
            if dir.is_dir() {
                if let Some(seq) = index.index_sequence(&name, &dir)? {
                    index.sequences.push(seq);
                }
            }
        }
        let expected = "no usable sequence (expected <SEQ>/blur, sharp and spike folders)";
        index.finished(&split_dir, expected)
    }

    /// An index of `split` under `root` with no sequence yet.
    fn empty(root: &Path, split: &str, meta: DatasetMeta, options: IndexOptions) -> DatasetIndex {
        DatasetIndex {
            root: root.to_path_buf(),
            split: split.to_owned(),
            meta,
            options,
            sequences: Vec::new(),
            skipped: Vec::new(),
        }
    }

    /// The index once its sequences are read, its skipped frames logged; `missing`
    /// is the error (naming `split_dir`) when no sequence is usable.
    fn finished(self, split_dir: &Path, missing: &str) -> Result<DatasetIndex> {
        if self.sequences.is_empty() {
            return Err(DataError::format(split_dir, missing));
        }
        for skip in &self.skipped {
            tracing::warn!(file = %skip.path.display(), reason = %skip.reason, "skipped bad frame");
        }
        if !self.skipped.is_empty() {
            tracing::warn!(
                skipped = self.skipped.len(),
                kept = self.frame_count(),
                "DATA.SKIP_BAD_FRAMES: frames skipped while indexing"
            );
        }
        Ok(self)
    }

    /// Turns `err` into a counted skip when allowed, or returns it.
    fn skip_or_fail(&mut self, err: DataError) -> Result<()> {
        if !self.options.skip_bad || !err.judges_the_data() {
            return Err(err);
        }
        let path = match &err {
            DataError::Io { path, .. }
            | DataError::Missing { path, .. }
            | DataError::Format { path, .. }
            | DataError::Unjudged { path, .. } => path.clone(),
            DataError::Request(_) => PathBuf::new(),
        };
        self.skipped.push(SkippedFrame {
            path,
            reason: err.to_string(),
        });
        Ok(())
    }

    fn index_sequence(&mut self, name: &str, dir: &Path) -> Result<Option<SequenceIndex>> {
        let blur_dir = dir.join(self.options.blur_dir.folder());
        let sharp_dir = dir.join("sharp");
        // DATA.USE_PRECOMPUTED_VOXELS, or unset: raw spikes when there are any,
        // legacy voxel grids otherwise.
        let voxels = self.options.spike_source.voxels_in(dir);
        let (spike_dir, spike_ext) = if voxels {
            (dir.join("spike_vox"), ".npy")
        } else {
            (dir.join("spike"), ".dat")
        };
        let folders = [
            (&blur_dir, ".png"),
            (&sharp_dir, ".png"),
            (&spike_dir, spike_ext),
        ];
        let mut sets = Vec::with_capacity(3);
        let why = if voxels && self.options.spike_source == SpikeSource::Voxels {
            "DATA.USE_PRECOMPUTED_VOXELS: true reads every sequence's spike_vox/*.npy"
        } else {
            "every sequence needs blur, sharp and spike folders"
        };
        for (folder, ext) in folders {
            match stems(folder, ext, why) {
                Ok(s) => sets.push(s),
                Err(err) => {
                    self.skip_or_fail(err)?;
                    return Ok(None);
                }
            }
        }
        let all: BTreeSet<&String> = sets.iter().flatten().collect();
        let (hs, ws) = (self.meta.spike_height, self.meta.spike_width);
        let mut size: Option<(u32, u32)> = None;
        let mut grid: Option<(u32, u32, u32)> = None;
        let mut frames = Vec::new();
        for stem in all {
            let blur = blur_dir.join(format!("{stem}.png"));
            let sharp = sharp_dir.join(format!("{stem}.png"));
            let spike = spike_dir.join(format!("{stem}{spike_ext}"));
            let checked = (|| -> Result<(u32, u32, u32)> {
                for (i, (path, kind)) in [(&blur, "blur"), (&sharp, "sharp"), (&spike, "spike")]
                    .into_iter()
                    .enumerate()
                {
                    if !sets[i].contains(stem) {
                        return Err(DataError::Missing {
                            path: path.clone(),
                            why: format!(
                                "partner {kind} file of frame {stem}{}",
                                if i == 2 && voxels {
                                    " (precomputed voxels)"
                                } else {
                                    ""
                                }
                            ),
                        });
                    }
                }
                let blur_size = image::png_size(&blur)?;
                let sharp_size = image::png_size(&sharp)?;
                if sharp_size != blur_size {
                    return Err(DataError::format(
                        &sharp,
                        format!(
                            "sharp is {}x{} but its blur is {}x{}",
                            sharp_size.0, sharp_size.1, blur_size.0, blur_size.1
                        ),
                    ));
                }
                if voxels {
                    let shape = npy::voxel_header(&spike)?;
                    if let Some(g) = grid.filter(|g| *g != shape) {
                        return Err(DataError::format(
                            &spike,
                            format!("voxel grid is {shape:?} but its sequence's are {g:?}"),
                        ));
                    }
                    grid = Some(shape);
                    return Ok((blur_size.0, blur_size.1, 0));
                }
                let steps = dat::dat_steps(&spike, hs, ws)?;
                Ok((blur_size.0, blur_size.1, steps))
            })();
            match checked {
                Ok((h, w, steps)) => {
                    if let Some((sh, sw)) = size {
                        if (sh, sw) != (h, w) {
                            self.skip_or_fail(DataError::format(
                                &blur,
                                format!("image is {h}x{w} but its sequence is {sh}x{sw}"),
                            ))?;
                            continue;
                        }
                    } else {
                        let (gh, gw) = grid.map_or((hs, ws), |g| (g.1, g.2));
                        check_alignment(&blur, h, w, gh, gw)?;
                        size = Some((h, w));
                    }
                    frames.push(FrameEntry {
                        name: stem.clone(),
                        spike_steps: steps,
                    });
                }
                Err(err) => self.skip_or_fail(err)?,
            }
        }
        let Some((height, width)) = size else {
            self.skip_or_fail(DataError::format(dir, "sequence has no usable frame"))?;
            return Ok(None);
        };
        let (storage, spike_height, spike_width) = match grid {
            Some((bins, gh, gw)) => (Storage::FolderVoxels { bins }, gh, gw),
            None => (Storage::Folder, hs, ws),
        };
        Ok(Some(SequenceIndex {
            name: name.to_owned(),
            dir: dir.to_path_buf(),
            height,
            width,
            spike_height,
            spike_width,
            storage,
            frames,
        }))
    }

    /// Usable frames over all sequences.
    pub fn frame_count(&self) -> usize {
        self.sequences.iter().map(|s| s.frames.len()).sum()
    }

    /// The compact size of every record of the split, bytes.
    pub fn compact_bytes(&self) -> u64 {
        let frames = self.sequences.iter().enumerate();
        let records = frames.flat_map(|(seq, s)| (0..s.frames.len()).map(move |f| (seq, f)));
        records
            .map(|(seq, f)| self.record_layout(seq, f).byte_len() as u64)
            .sum()
    }

    /// The sequence named `name`.
    pub fn sequence(&self, name: &str) -> Result<(usize, &SequenceIndex)> {
        self.sequences
            .iter()
            .enumerate()
            .find(|(_, s)| s.name == name)
            .ok_or_else(|| {
                DataError::Request(format!(
                    "no sequence '{name}' in {}",
                    self.root.join(&self.split).display()
                ))
            })
    }

    /// Paths of the blur, sharp and spike (`.dat` or voxel `.npy`) files of a frame
    /// of the folder layout (for an HDF5 session: the `.h5` file three times).
    pub fn frame_paths(&self, seq: usize, frame: usize) -> (PathBuf, PathBuf, PathBuf) {
        let s = &self.sequences[seq];
        let name = &s.frames[frame].name;
        let spike = match s.storage {
            Storage::Folder => s.dir.join("spike").join(format!("{name}.dat")),
            Storage::FolderVoxels { .. } => s.dir.join("spike_vox").join(format!("{name}.npy")),
            Storage::Hdf5(_) => return (s.dir.clone(), s.dir.clone(), s.dir.clone()),
        };
        (
            s.dir
                .join(self.options.blur_dir.folder())
                .join(format!("{name}.png")),
            s.dir.join("sharp").join(format!("{name}.png")),
            spike,
        )
    }

    /// The record layout of a frame (known before decoding it).
    pub fn record_layout(&self, seq: usize, frame: usize) -> RecordLayout {
        let s = &self.sequences[seq];
        RecordLayout {
            height: s.height,
            width: s.width,
            spike_height: s.spike_height,
            spike_width: s.spike_width,
            payload: match s.storage {
                Storage::FolderVoxels { bins } => SpikePayload::VoxelF16 { bins },
                Storage::Folder | Storage::Hdf5(_) => SpikePayload::Bits {
                    steps: s.frames[frame].spike_steps,
                },
            },
        }
    }

    /// Decodes a frame from disk straight into `record` (exactly
    /// [`Self::record_layout`]`.byte_len()` bytes, e.g. a cache slot).
    pub fn encode_into(&self, seq: usize, frame: usize, record: &mut [u8]) -> Result<()> {
        let layout = self.record_layout(seq, frame);
        if let Storage::Hdf5(session) = &self.sequences[seq].storage {
            return session.read_frame_into(frame, record);
        }
        layout.write_header(record)?;
        let (blur, sharp, spike) = self.frame_paths(seq, frame);
        let size = (layout.height, layout.width);
        image::read_png_rgb_into(&blur, size, &mut record[layout.blur_range()])?;
        image::read_png_rgb_into(&sharp, size, &mut record[layout.sharp_range()])?;
        if let SpikePayload::VoxelF16 { bins } = layout.payload {
            let grid = (bins, layout.spike_height, layout.spike_width);
            return npy::read_voxels_f16_into(&spike, grid, &mut record[layout.spike_range()]);
        }
        dat::read_dat_into(
            &spike,
            layout.spike_height,
            layout.spike_width,
            self.meta.spike_flipped,
            &mut record[layout.spike_range()],
        )?;
        Ok(())
    }

    /// A cache key naming the frame and what its record holds, unambiguously across
    /// datasets and readers on one node:
    /// `<hash>/<kind>/<split>/<seq>/<frame>`, the kind being `dat` (PNG + `.dat`
    /// spikes), `vox<K>` (PNG + precomputed voxels of `K` bins) or `h5` (an HDF5
    /// session), and the hash over the root and every option that changes the
    /// record's bytes ([`Self::record_encoding`]). Two jobs on one root that read
    /// a frame differently (`DATA.USE_PRECOMPUTED_VOXELS`, `DATA.BLUR_DIR`) never
    /// share its record.
    pub fn record_key(&self, seq: usize, frame: usize) -> String {
        let root = std::fs::canonicalize(&self.root).unwrap_or_else(|_| self.root.clone());
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(root.to_string_lossy().as_bytes());
        hasher.update(b"\0");
        hasher.update(self.record_encoding(seq).as_bytes());
        let s = &self.sequences[seq];
        format!(
            "{:08x}/{}/{}/{}/{}",
            hasher.finalize(),
            storage_tag(&s.storage),
            self.split,
            s.name,
            s.frames[frame].name
        )
    }

    /// What the records of sequence `seq` are made of and how: the record format's
    /// version, the storage kind and every option that changes their bytes (the
    /// blur folder, the `.dat` files' row order, the voxel bins baked into `.npy`
    /// grids). Part of every key of the sequence ([`Self::record_key`]).
    pub fn record_encoding(&self, seq: usize) -> String {
        let version = super::record::FORMAT_VERSION;
        let blur = self.options.blur_dir.folder();
        match &self.sequences[seq].storage {
            Storage::Folder => format!(
                "record v{version}; png {blur} + spike .dat, flipped {}",
                self.meta.spike_flipped
            ),
            Storage::FolderVoxels { bins } => {
                format!("record v{version}; png {blur} + spike_vox .npy of {bins} bins as f16")
            }
            Storage::Hdf5(_) => format!("record v{version}; hdf5 session"),
        }
    }
}

/// The storage kind as a record key names it.
fn storage_tag(storage: &Storage) -> String {
    match storage {
        Storage::Folder => "dat".into(),
        Storage::FolderVoxels { bins } => format!("vox{bins}"),
        Storage::Hdf5(_) => "h5".into(),
    }
}

/// RGB and spike grids must line up on whole pixels: the RGB size is an exact
/// multiple-ratio of the spike size in both directions.
fn check_alignment(path: &Path, h: u32, w: u32, hs: u32, ws: u32) -> Result<()> {
    if h < hs || w < ws {
        return Err(DataError::format(
            path,
            format!("image is {h}x{w}, smaller than the spike grid {hs}x{ws} of dataset.yaml"),
        ));
    }
    Ok(())
}

/// The RGB-pixel step on which crops line up with whole spike pixels:
/// `(H / gcd(H, H_s), W / gcd(W, W_s))`.
pub fn crop_alignment(height: u32, width: u32, spike_height: u32, spike_width: u32) -> (u32, u32) {
    let step = |len: u32, spike: u32| len / gcd(len.into(), spike.into()).max(1) as u32;
    (step(height, spike_height), step(width, spike_width))
}

/// The greatest common divisor of `a` and `b` (`a` when `b` is 0).
pub fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
