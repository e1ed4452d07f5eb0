//! HDF5 sessions (format page, section 5): one `<SEQ>.h5` per sequence holding
//! `blur`/`sharp` (N,H,W,3) u8, `spike` (N,T,H_s,W_s/8) u8 and optional
//! `frame_names`. Read lazily (the file stays open, each read fetches one frame's
//! hyperslabs, chunk cache from `DATA.CHUNK_CACHE_MB`); written by `synth::h5`.
//! A file is first checked in a child process ([`super::h5_probe`]), so a corrupt
//! one that crashes libhdf5 is an error here, not a crash.

use std::path::{Path, PathBuf};

use hdf5::types::VarLenUnicode;
use hdf5::{Dataset, File};
use ndarray::{s, Ix3};

use super::error::{DataError, Result};
use super::frame_name;
use super::record::{RecordLayout, SpikePayload};

/// Chunk-cache hash slots per dataset (a prime, as HDF5 recommends).
const CHUNK_CACHE_SLOTS: usize = 521;

/// One open HDF5 session: its datasets checked against the format page.
pub struct H5Session {
    /// The `.h5` file.
    pub path: PathBuf,
    _file: File,
    blur: Dataset,
    sharp: Dataset,
    spike: Dataset,
    /// RGB rows `H`.
    pub height: u32,
    /// RGB columns `W`.
    pub width: u32,
    /// Spike steps `T` of every frame.
    pub steps: u32,
    /// Spike rows `H_s` (file attribute `spike_height`).
    pub spike_height: u32,
    /// Spike columns `W_s` (file attribute `spike_width`).
    pub spike_width: u32,
    /// Frame names (`frame_names`, or six-digit numbers from 000001 when absent).
    pub frame_names: Vec<String>,
}

impl std::fmt::Debug for H5Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H5Session")
            .field("path", &self.path)
            .field("frames", &self.frame_names.len())
            .field("size", &(self.height, self.width))
            .field("spike", &(self.steps, self.spike_height, self.spike_width))
            .finish()
    }
}

impl PartialEq for H5Session {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path
    }
}

impl Eq for H5Session {}

/// An HDF5 failure on `path` while doing `what`, as a format error naming the file.
pub fn h5_err(path: &Path, what: &str, err: hdf5::Error) -> DataError {
    DataError::format(path, format!("{what}: {err}"))
}

fn to_u32(path: &Path, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| DataError::format(path, format!("{what} = {v} is too large")))
}

/// Opens a u8 dataset of rank `rank` and returns it with its shape.
fn u8_dataset(file: &File, path: &Path, name: &str, rank: usize) -> Result<(Dataset, Vec<usize>)> {
    if !file.link_exists(name) {
        return Err(DataError::format(
            path,
            format!("dataset '{name}' is missing (format page, section 5)"),
        ));
    }
    let ds = file
        .dataset(name)
        .map_err(|e| h5_err(path, &format!("dataset '{name}'"), e))?;
    let dtype = ds
        .dtype()
        .map_err(|e| h5_err(path, &format!("dataset '{name}' dtype"), e))?;
    if !dtype.is::<u8>() {
        let desc = dtype
            .to_descriptor()
            .map_or_else(|_| "an unknown type".to_owned(), |d| d.to_string());
        return Err(DataError::format(
            path,
            format!("dataset '{name}' has dtype {desc}, expected u8"),
        ));
    }
    let shape = ds.shape();
    if shape.len() != rank {
        return Err(DataError::format(
            path,
            format!(
                "dataset '{name}' has shape {shape:?}, expected {rank} dimensions (format page, section 5)"
            ),
        ));
    }
    Ok((ds, shape))
}

fn size_attr(file: &File, path: &Path, name: &str) -> Result<u32> {
    if !file
        .attr_names()
        .is_ok_and(|names| names.iter().any(|n| n == name))
    {
        return Err(DataError::format(
            path,
            format!("file attribute '{name}' is missing"),
        ));
    }
    let value: i64 = file
        .attr(name)
        .and_then(|a| a.read_scalar())
        .map_err(|e| h5_err(path, &format!("file attribute '{name}'"), e))?;
    u32::try_from(value).ok().filter(|v| *v > 0).ok_or_else(|| {
        DataError::format(
            path,
            format!("file attribute '{name}' = {value}, expected a positive size"),
        )
    })
}

fn read_names(file: &File, path: &Path, frames: usize) -> Result<Vec<String>> {
    if !file.link_exists("frame_names") {
        return Ok((0..frames as u32).map(frame_name).collect());
    }
    let ds = file
        .dataset("frame_names")
        .map_err(|e| h5_err(path, "dataset 'frame_names'", e))?;
    let names: Vec<String> = ds
        .read_raw::<VarLenUnicode>()
        .map(|v| v.iter().map(|s| s.as_str().to_owned()).collect())
        .or_else(|_| {
            ds.read_raw::<hdf5::types::VarLenAscii>()
                .map(|v| v.iter().map(|s| s.as_str().to_owned()).collect())
        })
        .map_err(|e| h5_err(path, "dataset 'frame_names' (expected strings)", e))?;
    if names.len() != frames {
        return Err(DataError::format(
            path,
            format!(
                "dataset 'frame_names' has {} names for {frames} frames",
                names.len()
            ),
        ));
    }
    Ok(names)
}

/// The most bytes of data one byte of an HDF5 file can hold (deflate's ratio, the
/// best of the usual filters).
const MAX_INFLATE: u128 = 1032;

/// Refuses datasets whose shapes claim more data than the file can hold even
/// compressed (chunks that were never written): every buffer a session sizes
/// (frame names, records) comes from these shapes.
fn check_claimed_size(path: &Path, shapes: &[&[usize]]) -> Result<()> {
    let file_len = std::fs::metadata(path)
        .map_err(|e| DataError::io(path, e))?
        .len();
    let claimed = shapes.iter().try_fold(0u128, |sum, shape| {
        let cells = shape
            .iter()
            .try_fold(1u128, |n, d| n.checked_mul(*d as u128))?;
        sum.checked_add(cells)
    });
    match claimed {
        Some(bytes) if bytes <= MAX_INFLATE * file_len as u128 => Ok(()),
        _ => Err(DataError::format(
            path,
            format!(
                "datasets 'blur', 'sharp' and 'spike' claim {} bytes, more than a file of {file_len} bytes holds (chunks never written?)",
                claimed.map_or_else(|| "over 2^128".to_string(), |b| b.to_string())
            ),
        )),
    }
}

impl H5Session {
    /// Opens `path` read-only with a chunk cache of `chunk_cache_mb` MiB for the
    /// file (split over its three datasets) and checks every dataset and attribute.
    /// This is libhdf5 in this process, with no probe first: what the probe child
    /// runs. Everyone else opens through `dataset::h5_probe::open`, which has a
    /// child read the file first (libhdf5 crashes on some corrupt files).
    pub fn open_unprobed(path: &Path, chunk_cache_mb: u32) -> Result<H5Session> {
        let per_dataset = chunk_cache_mb as usize * (1 << 20) / 3;
        // Read-only, so no file lock: a lock fails on cluster file systems without
        // flock (Lustre, NFS), and a writer's exclusive lock lives on in any child
        // process spawned while the writer had the file open (libhdf5 opens files
        // without O_CLOEXEC), refusing every later reader.
        let file = File::with_options()
            .with_fapl(|p| {
                p.chunk_cache(CHUNK_CACHE_SLOTS, per_dataset, 0.75)
                    .file_locking(false)
            })
            .open(path)
            .map_err(|e| h5_err(path, "cannot open as HDF5", e))?;
        let spike_height = size_attr(&file, path, "spike_height")?;
        let spike_width = size_attr(&file, path, "spike_width")?;
        let (blur, blur_shape) = u8_dataset(&file, path, "blur", 4)?;
        let (sharp, sharp_shape) = u8_dataset(&file, path, "sharp", 4)?;
        let (spike, spike_shape) = u8_dataset(&file, path, "spike", 4)?;
        let frames = blur_shape[0];
        if blur_shape[3] != 3 || frames == 0 {
            return Err(DataError::format(
                path,
                format!("dataset 'blur' has shape {blur_shape:?}, expected (N>0, H, W, 3)"),
            ));
        }
        if sharp_shape != blur_shape {
            return Err(DataError::format(
                path,
                format!("dataset 'sharp' has shape {sharp_shape:?} but 'blur' has {blur_shape:?}"),
            ));
        }
        let row_bytes = spike_width as usize / 8;
        if spike_width % 8 != 0
            || spike_shape[0] != frames
            || spike_shape[2] != spike_height as usize
            || spike_shape[3] != row_bytes
            || spike_shape[1] == 0
        {
            return Err(DataError::format(
                path,
                format!(
                    "dataset 'spike' has shape {spike_shape:?}, expected ({frames}, T, {spike_height}, {spike_width}/8) from 'blur' and the spike_height/spike_width attributes"
                ),
            ));
        }
        let (height, width) = (blur_shape[1], blur_shape[2]);
        if height < spike_height as usize || width < spike_width as usize {
            return Err(DataError::format(
                path,
                format!("frames are {height}x{width}, smaller than the spike grid {spike_height}x{spike_width}"),
            ));
        }
        check_claimed_size(path, &[&blur_shape, &sharp_shape, &spike_shape])?;
        to_u32(path, "N", frames)?;
        let frame_names = read_names(&file, path, frames)?;
        Ok(H5Session {
            path: path.to_path_buf(),
            height: to_u32(path, "H", height)?,
            width: to_u32(path, "W", width)?,
            steps: to_u32(path, "T", spike_shape[1])?,
            spike_height,
            spike_width,
            frame_names,
            _file: file,
            blur,
            sharp,
            spike,
        })
    }

    /// Reads the index entry of every chunk (at most `max_chunks` per dataset) of
    /// the three datasets, so libhdf5 walks each chunk index once.
    pub(crate) fn walk_chunks(&self, max_chunks: usize) -> Result<()> {
        for (name, ds) in [
            ("blur", &self.blur),
            ("sharp", &self.sharp),
            ("spike", &self.spike),
        ] {
            let Some(chunks) = ds.num_chunks() else {
                continue;
            };
            for i in 0..chunks.min(max_chunks) {
                if ds.chunk_info(i).is_none() {
                    return Err(DataError::format(
                        &self.path,
                        format!("dataset '{name}': chunk {i} of {chunks} cannot be located"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The record layout of every frame of the session.
    pub fn record_layout(&self) -> RecordLayout {
        RecordLayout {
            height: self.height,
            width: self.width,
            spike_height: self.spike_height,
            spike_width: self.spike_width,
            payload: SpikePayload::Bits { steps: self.steps },
        }
    }

    fn read_into(&self, ds: &Dataset, name: &str, frame: usize, dst: &mut [u8]) -> Result<()> {
        let what = format!("dataset '{name}' frame {frame}");
        let block = ds
            .read_slice::<u8, _, Ix3>(s![frame, .., .., ..])
            .map_err(|e| h5_err(&self.path, &what, e))?;
        let src = block
            .as_slice()
            .ok_or_else(|| DataError::format(&self.path, format!("{what}: not contiguous")))?;
        if src.len() != dst.len() {
            return Err(DataError::format(
                &self.path,
                format!("{what}: {} bytes, expected {}", src.len(), dst.len()),
            ));
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    /// Reads frame `frame` (blur, sharp and spike hyperslabs only) into `record`,
    /// which must be exactly [`Self::record_layout`]`.byte_len()` bytes.
    pub fn read_frame_into(&self, frame: usize, record: &mut [u8]) -> Result<()> {
        if frame >= self.frame_names.len() {
            return Err(DataError::Request(format!(
                "{}: frame {frame} of {}",
                self.path.display(),
                self.frame_names.len()
            )));
        }
        let layout = self.record_layout();
        layout.write_header(record)?;
        self.read_into(&self.blur, "blur", frame, &mut record[layout.blur_range()])?;
        self.read_into(
            &self.sharp,
            "sharp",
            frame,
            &mut record[layout.sharp_range()],
        )?;
        self.read_into(
            &self.spike,
            "spike",
            frame,
            &mut record[layout.spike_range()],
        )
    }
}

/// `.h5` files directly under `split_dir`, sorted by name.
pub fn session_files(split_dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(split_dir).map_err(|e| DataError::io(split_dir, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| DataError::io(split_dir, e))?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "h5") {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unwritten_huge_datasets_are_refused_before_sizing_anything() {
        // Found by tests/parsers_prop: a few-KiB file whose chunked datasets claim
        // 2^40 frames (chunks never written) made `open` build 2^40 frame names.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("forged.h5");
        let file = File::create(&path).unwrap();
        for name in ["spike_height", "spike_width"] {
            let attr = file.new_attr::<i64>().create(name).unwrap();
            attr.write_scalar(&8i64).unwrap();
        }
        let frames = 1usize << 40;
        for (name, shape) in [
            ("blur", [frames, 8, 8, 3]),
            ("sharp", [frames, 8, 8, 3]),
            ("spike", [frames, 1, 8, 1]),
        ] {
            file.new_dataset::<u8>()
                .shape(shape.to_vec())
                .chunk(vec![1, shape[1], shape[2], shape[3]])
                .create(name)
                .unwrap();
        }
        drop(file);
        // The refusal names the size check, which runs before any buffer is sized
        // from the shapes: were the names built first, this would exhaust memory.
        // (No wall-clock bound: other tests hold the hdf5 crate's global lock.)
        let err = H5Session::open_unprobed(&path, 1).unwrap_err().to_string();
        assert!(
            err.contains("forged.h5") && err.contains("never written"),
            "{err}"
        );
    }
}
