//! The folder-layout writer of the synthetic generator: `<split>/<SEQ>/blur/*.png`,
//! `sharp/*.png` and `spike/*.dat` (rows bottom-up when `flipped`), as the format
//! page's section 2 reads them.

use std::path::Path;

use crate::dataset::error::{DataError, Result};
use crate::dataset::{dat, frame_name, image};

use super::SyntheticSequence;

/// Writes one sequence in the folder layout under `<split_dir>/<name>/`.
pub fn write_sequence_folder(
    split_dir: &Path,
    seq: &SyntheticSequence,
    flipped: bool,
) -> Result<()> {
    let dir = split_dir.join(&seq.name);
    for sub in ["blur", "sharp", "spike"] {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).map_err(|e| DataError::io(&d, e))?;
    }
    for (i, ((blur, sharp), spikes)) in seq.blur.iter().zip(&seq.sharp).zip(&seq.spikes).enumerate()
    {
        let stem = frame_name(i as u32);
        image::write_png_rgb(&dir.join("blur").join(format!("{stem}.png")), blur)?;
        image::write_png_rgb(&dir.join("sharp").join(format!("{stem}.png")), sharp)?;
        dat::write_dat(
            &dir.join("spike").join(format!("{stem}.dat")),
            spikes,
            flipped,
        )?;
    }
    Ok(())
}
