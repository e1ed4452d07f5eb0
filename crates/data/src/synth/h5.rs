//! The HDF5-session writer of the synthetic generator (`synth --h5`): one
//! `<SEQ>.h5` per sequence as the format page's section 5 describes it, which
//! `dataset::h5` reads back.

use std::path::Path;

use hdf5::types::VarLenUnicode;
use hdf5::File;
use ndarray::{s, ArrayView3};

use crate::dataset::error::{DataError, Result};
use crate::dataset::frame_name;
use crate::dataset::h5::h5_err;

use super::SyntheticSequence;

/// Writes `seq` as an HDF5 session at `path`: one frame a chunk, rows top-down.
pub fn write_session(path: &Path, seq: &SyntheticSequence) -> Result<()> {
    let err = |what: &str, e: hdf5::Error| h5_err(path, what, e);
    let (Some(first), Some(spikes0)) = (seq.blur.first(), seq.spikes.first()) else {
        return Err(DataError::Request(format!(
            "{}: sequence {} has no frame",
            path.display(),
            seq.name
        )));
    };
    let n = seq.blur.len();
    let (h, w) = (first.height as usize, first.width as usize);
    let (t, hs, ws) = (
        spikes0.steps as usize,
        spikes0.height as usize,
        spikes0.width as usize,
    );
    let file = File::create(path).map_err(|e| err("cannot create", e))?;
    for (name, v) in [("spike_height", hs), ("spike_width", ws)] {
        file.new_attr::<i64>()
            .create(name)
            .and_then(|a| a.write_scalar(&(v as i64)))
            .map_err(|e| err(name, e))?;
    }
    let rgb = |name: &str| {
        file.new_dataset::<u8>()
            .chunk((1, h, w, 3))
            .shape((n, h, w, 3))
            .create(name)
            .map_err(|e| err(name, e))
    };
    let (blur, sharp) = (rgb("blur")?, rgb("sharp")?);
    let spike = file
        .new_dataset::<u8>()
        .chunk((1, t, hs, ws / 8))
        .shape((n, t, hs, ws / 8))
        .create("spike")
        .map_err(|e| err("spike", e))?;
    let shape_err = |e: ndarray::ShapeError| DataError::Request(format!("{}: {e}", path.display()));
    for i in 0..n {
        for (ds, name, image) in [
            (&blur, "blur", &seq.blur[i]),
            (&sharp, "sharp", &seq.sharp[i]),
        ] {
            let view = ArrayView3::from_shape((h, w, 3), &image.data).map_err(shape_err)?;
            ds.write_slice(view, s![i, .., .., ..])
                .map_err(|e| err(name, e))?;
        }
        let view =
            ArrayView3::from_shape((t, hs, ws / 8), &seq.spikes[i].bits).map_err(shape_err)?;
        spike
            .write_slice(view, s![i, .., .., ..])
            .map_err(|e| err("spike", e))?;
    }
    let names: Vec<VarLenUnicode> = (0..n as u32)
        .map(|i| {
            frame_name(i)
                .parse()
                .map_err(|_| DataError::Request("frame name".into()))
        })
        .collect::<Result<_>>()?;
    file.new_dataset_builder()
        .with_data(&names)
        .create("frame_names")
        .map_err(|e| err("frame_names", e))?;
    Ok(())
}
