//! `.npy` voxel grids: headers with any version, length field, dtype, order and
//! shape (huge axes included), over data of any length, give the grid the file
//! really holds or an error naming the file, without allocating what the header
//! claims.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use vrtspike::dataset::npy::{read_voxels_f16_into, voxel_header, write_f32};

use super::{accepted, bounded_by_input, check, largest_allocation, mutated, names};

/// A shape axis as header text: small, huge, or not a number at all.
fn axis() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (0..5u64).prop_map(|v| v.to_string()),
        2 => (u32::MAX - 3..=u32::MAX).prop_map(|v| v.to_string()),
        1 => any::<u32>().prop_map(|v| v.to_string()),
        1 => any::<u64>().prop_map(|v| v.to_string()),
        1 => Just("18446744073709551616".to_string()),
        1 => Just("1e12".to_string()),
        1 => Just("-3".to_string()),
        1 => "[ ,()'a-z0-9]{0,6}",
    ]
}

/// The header dict, from its fields, and the cells of its shape when that is a
/// small (K, H, W) that a data length can match.
fn dict() -> impl Strategy<Value = (String, Option<usize>)> {
    let descr = prop_oneof![
        4 => Just("'<f4'".to_string()),
        1 => Just("\"<f4\"".to_string()),
        1 => prop::sample::select(vec!["'<f8'", "'|u1'"]).prop_map(str::to_string),
        1 => "[ '<a-z0-9]{0,5}",
    ];
    let order = prop_oneof![4 => Just("False".to_string()), 1 => "True|[A-Za-z]{0,6}"];
    let rank = prop_oneof![3 => Just(3..4usize), 1 => Just(0..5usize)];
    let shape = rank
        .prop_flat_map(|rank| prop::collection::vec(axis(), rank))
        .prop_map(|axes| {
            let cells = axes
                .iter()
                .map(|a| a.parse::<usize>().ok().filter(|v| *v < 5))
                .try_fold(1, |n, v| Some(n * v?));
            let text = match axes.len() {
                1 => format!("({},)", axes[0]),
                _ => format!("({})", axes.join(", ")),
            };
            (text, cells)
        });
    let pick = prop_oneof![3 => Just(0), 3 => Just(1), 1 => Just(2)];
    (descr, order, shape, pick).prop_map(|(descr, order, (shape, cells), pick)| {
        let dict = match pick {
            0 => format!("{{'descr': {descr}, 'fortran_order': {order}, 'shape': {shape}, }}\n"),
            1 => format!("{{'shape': {shape}, 'fortran_order': {order}, 'descr': {descr}}}"),
            _ => format!("{{'descr': {descr}, 'shape': {shape}}}"),
        };
        (dict, cells)
    })
}

/// Magic, version, length field (true or random), dict, then data bytes.
fn npy_file() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![6 => Just(1u8), 2 => Just(2u8), 1 => Just(3u8), 1 => any::<u8>()],
        dict(),
        prop::option::weighted(0.2, any::<u32>()),
        prop::option::weighted(0.5, 0..200usize),
    )
        .prop_map(|(version, (dict, cells), bad_len, data_len)| {
            let data_len = data_len.or(cells.map(|c| 4 * c)).unwrap_or(0);
            let mut out = b"\x93NUMPY".to_vec();
            out.extend_from_slice(&[version, 0]);
            let len = bad_len.unwrap_or(dict.len() as u32);
            if version == 1 {
                out.extend_from_slice(&(len as u16).to_le_bytes());
            } else {
                out.extend_from_slice(&len.to_le_bytes());
            }
            out.extend_from_slice(dict.as_bytes());
            out.extend((0..data_len).map(|i| i as u8));
            out
        })
}

/// Reads `bytes` as `path` both ways; an accepted grid must be the file's whole data.
fn read_both_ways(path: &std::path::Path, bytes: &[u8]) -> Result<(), TestCaseError> {
    std::fs::write(path, bytes).unwrap();
    let start = Instant::now();
    let (probe, largest) = largest_allocation(|| voxel_header(path));
    bounded_by_input(largest, bytes.len(), 2)?;
    let expected = probe.as_ref().map_or((1, 1, 2), |grid| *grid);
    let cells = expected.0 as usize * expected.1 as usize * expected.2 as usize;
    prop_assert!(4 * cells < bytes.len().max(9));
    let mut dst = vec![0u8; 2 * cells];
    let (read, largest) = largest_allocation(|| read_voxels_f16_into(path, expected, &mut dst));
    bounded_by_input(largest, bytes.len(), 2)?;
    match (probe, read) {
        (Ok(_), Ok(())) => accepted(),
        (Err(probe), Err(read)) => {
            names(&probe.to_string(), "case.npy")?;
            names(&read.to_string(), "case.npy")?;
        }
        (probe, read) => {
            return Err(TestCaseError::fail(format!(
                "the header probe gave {probe:?} but the read {read:?}"
            )))
        }
    }
    prop_assert!(start.elapsed() < Duration::from_secs(5), "slow parse");
    Ok(())
}

#[test]
fn any_header_is_the_grid_on_disk_or_a_named_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.npy");
    check("npy headers", 3000, npy_file(), |bytes| {
        read_both_ways(&path, &bytes)
    });
}

#[test]
fn mutated_and_truncated_grids_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.npy");
    let values: Vec<f32> = (0..2 * 3 * 4).map(|i| i as f32).collect();
    write_f32(&path, &[2, 3, 4], &values).unwrap();
    let valid = std::fs::read(&path).unwrap();
    check("npy mutations", 1500, mutated(valid), |bytes| {
        read_both_ways(&path, &bytes)
    });
}
