//! HDF5 sessions: files written with the format page's layout and then given wrong
//! or missing attributes, wrong shapes (huge, unwritten axes included), wrong dtypes
//! and wrong frame names open to a session whose frames read back, or to an error
//! naming the file; never a panic, and nothing sized by a shape the file does not
//! hold.

use std::path::Path;
use std::time::{Duration, Instant};

use hdf5::types::VarLenUnicode;
use hdf5::{File, H5Type};
use proptest::prelude::*;

use vrtspike::dataset::h5_probe::{self, ProbeMode, Prober};

use super::{accepted, bounded_by_input, check, largest_allocation, names};

/// A file attribute as written.
#[derive(Debug, Clone)]
enum Attr {
    Missing,
    Int(i64),
    Float(f64),
    Text(String),
}

/// The element type of a dataset.
#[derive(Debug, Clone, Copy)]
enum Dtype {
    U8,
    I16,
    F32,
}

/// A dataset as written: absent, or a dtype and a shape.
#[derive(Debug, Clone)]
enum Data {
    Missing,
    Array(Dtype, Vec<usize>),
}

/// The `frame_names` dataset as written.
#[derive(Debug, Clone)]
enum Names {
    Missing,
    Text(usize),
    Numbers(usize),
}

/// Everything a session file holds, before and after the faults.
#[derive(Debug, Clone)]
struct Session {
    spike_height: Attr,
    spike_width: Attr,
    blur: Data,
    sharp: Data,
    spike: Data,
    names: Names,
}

/// A session laid out as the format page says.
fn valid() -> impl Strategy<Value = Session> {
    (
        1..4usize,
        1..3usize,
        1..3usize,
        0..3usize,
        0..3usize,
        1..4usize,
    )
        .prop_map(|(n, hs, wb, dh, dw, t)| {
            let (hs, ws) = (hs * 4, wb * 8);
            let rgb = vec![n, hs + dh, ws + dw, 3];
            Session {
                spike_height: Attr::Int(hs as i64),
                spike_width: Attr::Int(ws as i64),
                blur: Data::Array(Dtype::U8, rgb.clone()),
                sharp: Data::Array(Dtype::U8, rgb),
                spike: Data::Array(Dtype::U8, vec![n, t, hs, ws / 8]),
                names: Names::Text(n),
            }
        })
}

/// One fault a user's file might have.
#[derive(Debug, Clone)]
enum Fault {
    Attr(bool, Attr),
    Dtype(usize, Dtype),
    Axis(usize, usize, usize),
    Rank(usize, Vec<usize>),
    Drop(usize),
    Names(Names),
    /// The same (maybe huge) frame count on all three datasets, names dropped.
    Frames(usize),
}

fn attr() -> impl Strategy<Value = Attr> {
    prop_oneof![
        Just(Attr::Missing),
        any::<i64>().prop_map(Attr::Int),
        (-2..20i64).prop_map(Attr::Int),
        any::<f64>().prop_map(Attr::Float),
        "[a-z0-9]{0,6}".prop_map(Attr::Text),
    ]
}

/// An axis length: small, or huge (a chunked dataset whose chunks are never written).
fn axis() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0..6usize, 1 => 1usize << 20..1usize << 44]
}

fn fault() -> impl Strategy<Value = Fault> {
    let dtype = prop_oneof![Just(Dtype::U8), Just(Dtype::I16), Just(Dtype::F32)];
    prop_oneof![
        (any::<bool>(), attr()).prop_map(|(h, a)| Fault::Attr(h, a)),
        (0..3usize, dtype).prop_map(|(d, t)| Fault::Dtype(d, t)),
        (0..3usize, 0..4usize, axis()).prop_map(|(d, i, v)| Fault::Axis(d, i, v)),
        (0..3usize, prop::collection::vec(0..4usize, 0..6)).prop_map(|(d, s)| Fault::Rank(d, s)),
        (0..3usize).prop_map(Fault::Drop),
        axis().prop_map(Fault::Frames),
        prop_oneof![
            Just(Names::Missing),
            (0..5usize).prop_map(Names::Text),
            (1..4usize).prop_map(Names::Numbers),
        ]
        .prop_map(Fault::Names),
    ]
}

impl Session {
    fn data_mut(&mut self, which: usize) -> &mut Data {
        match which {
            0 => &mut self.blur,
            1 => &mut self.sharp,
            _ => &mut self.spike,
        }
    }

    fn apply(mut self, fault: Fault) -> Session {
        match fault {
            Fault::Attr(true, a) => self.spike_height = a,
            Fault::Attr(false, a) => self.spike_width = a,
            Fault::Dtype(d, t) => {
                if let Data::Array(dtype, _) = self.data_mut(d) {
                    *dtype = t;
                }
            }
            Fault::Axis(d, i, v) => {
                if let Data::Array(_, shape) = self.data_mut(d) {
                    if let Some(axis) = shape.get_mut(i) {
                        *axis = v;
                    }
                }
            }
            Fault::Rank(d, s) => {
                if let Data::Array(_, shape) = self.data_mut(d) {
                    *shape = s;
                }
            }
            Fault::Drop(d) => *self.data_mut(d) = Data::Missing,
            Fault::Names(n) => self.names = n,
            Fault::Frames(n) => {
                for d in 0..3 {
                    self = self.apply(Fault::Axis(d, 0, n));
                }
                self.names = Names::Missing;
            }
        }
        self
    }
}

/// A session with its faults, and whether it has any.
fn session() -> impl Strategy<Value = (Session, bool)> {
    (valid(), prop::collection::vec(fault(), 0..3)).prop_map(|(s, faults)| {
        let pristine = faults.is_empty();
        (faults.into_iter().fold(s, Session::apply), pristine)
    })
}

fn write_attr(file: &File, name: &str, attr: &Attr) -> hdf5::Result<()> {
    match attr {
        Attr::Missing => Ok(()),
        Attr::Int(v) => file.new_attr::<i64>().create(name)?.write_scalar(v),
        Attr::Float(v) => file.new_attr::<f64>().create(name)?.write_scalar(v),
        Attr::Text(v) => {
            let text: VarLenUnicode = v.parse().unwrap();
            file.new_attr::<VarLenUnicode>()
                .create(name)?
                .write_scalar(&text)
        }
    }
}

/// Writes a dataset: zeros when small, chunked and unwritten when an axis is huge.
fn write_array<T: H5Type + Default + Clone>(
    file: &File,
    name: &str,
    shape: &[usize],
) -> hdf5::Result<()> {
    // hdf5-metno's own chunk arithmetic overflows past 2^64 elements: not a file.
    let cells = shape.iter().try_fold(1usize, |n, d| n.checked_mul(*d));
    if cells.is_none_or(|n| n > 1 << 60) {
        return Err("shape too large to create".into());
    }
    match cells {
        Some(cells) if cells <= 1 << 16 => {
            let ds = file.new_dataset::<T>().shape(shape.to_vec()).create(name)?;
            ds.write_raw(&vec![T::default(); cells])
        }
        _ => {
            let chunk: Vec<usize> = shape.iter().map(|d| (*d).clamp(1, 4)).collect();
            file.new_dataset::<T>()
                .shape(shape.to_vec())
                .chunk(chunk)
                .create(name)
                .map(|_| ())
        }
    }
}

fn write(path: &Path, s: &Session) -> hdf5::Result<()> {
    let file = File::create(path)?;
    write_attr(&file, "spike_height", &s.spike_height)?;
    write_attr(&file, "spike_width", &s.spike_width)?;
    for (name, data) in [("blur", &s.blur), ("sharp", &s.sharp), ("spike", &s.spike)] {
        match data {
            Data::Missing => {}
            Data::Array(Dtype::U8, shape) => write_array::<u8>(&file, name, shape)?,
            Data::Array(Dtype::I16, shape) => write_array::<i16>(&file, name, shape)?,
            Data::Array(Dtype::F32, shape) => write_array::<f32>(&file, name, shape)?,
        }
    }
    match s.names {
        Names::Missing => {}
        Names::Text(n) => {
            let names: Vec<VarLenUnicode> =
                (0..n).map(|i| format!("{i:06}").parse().unwrap()).collect();
            file.new_dataset_builder()
                .with_data(&names)
                .create("frame_names")?;
        }
        Names::Numbers(n) => {
            file.new_dataset_builder()
                .with_data(&vec![1i32; n])
                .create("frame_names")?;
        }
    }
    Ok(())
}

/// Opens `path` and reads every frame of an accepted session; a `pristine` one
/// must open and read. The probe child reads the file first, untimed (it has its own
/// time limit, and starting it is the machine's business: seconds when libtorch_cuda's
/// libraries are not in the page cache); then the open in this process is bounded.
fn open_and_read(path: &Path, pristine: bool) -> Result<(), TestCaseError> {
    let file_len = std::fs::metadata(path).unwrap().len() as usize;
    let _ = h5_probe::check(path);
    let start = Instant::now();
    let (opened, largest) = largest_allocation(|| h5_probe::open(path, 1));
    bounded_by_input(largest, file_len, 4)?;
    match opened {
        Ok(session) => {
            accepted();
            let mut record = vec![0u8; session.record_layout().byte_len()];
            for frame in 0..session.frame_names.len() {
                if let Err(err) = session.read_frame_into(frame, &mut record) {
                    prop_assert!(!pristine, "a valid session's frame fails: {err}");
                    names(&err.to_string(), "case.h5")?;
                }
            }
        }
        Err(err) => {
            prop_assert!(!pristine, "a valid session fails: {err}");
            names(&err.to_string(), "case.h5")?
        }
    }
    prop_assert!(start.elapsed() < crate::HANG_GUARD, "slow open");
    Ok(())
}

#[test]
fn wrong_attributes_shapes_and_types_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.h5");
    check("h5 structure", 800, session(), |(s, pristine)| {
        if write(&path, &s).is_err() {
            // HDF5 refused to write this one (e.g. a zero-sized chunk): nothing to read.
            return Ok(());
        }
        open_and_read(&path, pristine)
    });
}

/// A two-frame session as `synth --h5` writes it.
fn synth_file(path: &Path) -> Vec<u8> {
    use vrtspike::dataset::dat::SpikeStream;
    use vrtspike::dataset::image::RgbImage;
    use vrtspike::synth::SyntheticSequence;
    let image = |seed: u8| RgbImage {
        height: 8,
        width: 16,
        data: (0..8 * 16 * 3).map(|i| (i as u8) ^ seed).collect(),
    };
    let spikes = |seed: u8| SpikeStream {
        height: 8,
        width: 16,
        steps: 2,
        bits: (0..2 * 8 * 2).map(|i| (i as u8) ^ seed).collect(),
    };
    let seq = SyntheticSequence {
        name: "case".into(),
        subframes: 1,
        blur: vec![image(1), image(2)],
        sharp: vec![image(3), image(4)],
        spikes: vec![spikes(5), spikes(6)],
    };
    vrtspike::synth::h5::write_session(path, &seq).unwrap();
    std::fs::read(path).unwrap()
}

#[test]
fn truncated_sessions_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.h5");
    let valid = synth_file(&path);
    open_and_read(&path, true).unwrap();
    let len = valid.len();
    check("h5 truncation", 200, 0..len, |cut| {
        std::fs::write(&path, &valid[..cut]).unwrap();
        open_and_read(&path, false)
    });
}

/// Bytes changed anywhere in a session. The system libhdf5 (1.10.8) itself crashes
/// (SIGSEGV) inside `H5Fopen`/`H5Dopen` on some of these files; the probe child
/// (`dataset::h5_probe`) takes the crash and `open` returns an error naming the file.
#[test]
fn mutated_sessions_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.h5");
    let valid = synth_file(&path);
    check("h5 mutations", 300, super::mutated(valid), |bytes| {
        std::fs::write(&path, &bytes).unwrap();
        open_and_read(&path, false)
    });
}

/// One byte of the synthetic session that the system libhdf5 (1.10.8) segfaults on
/// inside `H5Fopen`/`H5Dopen` (found by the mutation property).
const CRASHING_EDIT: (usize, u8) = (13421, 108);

#[test]
fn a_file_that_crashes_libhdf5_is_a_named_error_and_good_files_still_open() {
    let dir = tempfile::tempdir().unwrap();
    let (good, bad) = (dir.path().join("good.h5"), dir.path().join("crashes.h5"));
    let mut bytes = synth_file(&good);
    bytes[CRASHING_EDIT.0] = CRASHING_EDIT.1;
    std::fs::write(&bad, &bytes).unwrap();
    // The file really crashes libhdf5 when read in-process (here in the probe
    // command's own file mode, so this test process survives it).
    let exe = env!("CARGO_BIN_EXE_vrtspike");
    let direct = std::process::Command::new(exe)
        .arg("h5-probe")
        .arg(&bad)
        .output()
        .unwrap();
    let signal = std::os::unix::process::ExitStatusExt::signal(&direct.status);
    println!("vrtspike h5-probe on the corrupt file: {:?}", direct.status);
    // Test binaries in target/*/deps/ find the vrtspike built beside them.
    let mode = h5_probe::global().mode().clone();
    let built = std::fs::canonicalize(exe).unwrap();
    assert!(
        matches!(&mode, ProbeMode::Child(p) if std::fs::canonicalize(p).ok() == Some(built.clone())),
        "{mode:?}"
    );
    let err = h5_probe::open(&bad, 1).unwrap_err().to_string();
    assert!(
        err.contains("crashes.h5") && err.contains("corrupt"),
        "{err}"
    );
    if signal.is_some() {
        assert!(err.contains("crashed") && err.contains("SIG"), "{err}");
    }
    let session = h5_probe::open(&good, 1).unwrap();
    // The crash killed a worker the child forked, not the child: one child served
    // both files.
    let prober = Prober::new(mode, Duration::from_secs(30));
    assert!(prober.check(&bad).is_err());
    prober.check(&good).unwrap();
    assert_eq!(
        prober.spawns(),
        1,
        "a crashing file cost a fresh probe child"
    );
    let mut record = vec![0u8; session.record_layout().byte_len()];
    for frame in 0..session.frame_names.len() {
        session.read_frame_into(frame, &mut record).unwrap();
    }
}
