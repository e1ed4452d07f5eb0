//! `.dat` spike streams: any file length against any claimed spike size is a whole
//! stream of exactly the file's bytes or an error naming the file.

use proptest::prelude::*;

use vrtspike::dataset::dat::{dat_steps, read_dat};

use super::{accepted, bounded_by_input, check, largest_allocation, names};

/// A spike size: mostly small, sometimes anything a `dataset.yaml` could claim.
fn side() -> impl Strategy<Value = u32> {
    prop_oneof![3 => Just(8), 4 => 0..40u32, 1 => any::<u32>()]
}

#[test]
fn any_length_and_size_is_a_stream_or_a_named_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.dat");
    let input = (
        side(),
        side(),
        any::<bool>(),
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..600),
            // A whole number of 8x8 frames, the common case of a good file.
            (1..9usize).prop_flat_map(|t| prop::collection::vec(any::<u8>(), 8 * t)),
        ],
    );
    check("dat", 2000, input, |(height, width, flipped, bytes)| {
        std::fs::write(&path, &bytes).unwrap();
        let (read, largest) = largest_allocation(|| read_dat(&path, height, width, flipped));
        bounded_by_input(largest, bytes.len(), 2)?;
        match read {
            Ok(stream) => {
                accepted();
                prop_assert_eq!(stream.bits.len(), bytes.len());
                prop_assert_eq!(stream.steps as usize * stream.step_bytes(), bytes.len());
                prop_assert_eq!(dat_steps(&path, height, width).ok(), Some(stream.steps));
            }
            Err(err) => names(&err.to_string(), "case.dat")?,
        }
        Ok(())
    });
}
