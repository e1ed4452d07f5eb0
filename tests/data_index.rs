//! The folder-layout index on generated data: ordering, records decoded from disk,
//! and every kind of bad input (error naming the file, or a counted skip).

use std::path::Path;

use vrtspike::config::BlurDir;
use vrtspike::dataset::dat;
use vrtspike::dataset::image;
use vrtspike::dataset::{DatasetIndex, IndexOptions, RecordView, SpikePayload};
use vrtspike::synth::{self, SynthOptions};

fn tiny(dir: &Path) -> SynthOptions {
    let options = SynthOptions {
        train_seqs: 2,
        test_seqs: 1,
        frames: 8,
        height: 64,
        width: 96,
        seed: 3,
    };
    synth::generate_folder(dir, &options, &|_| {}).unwrap();
    options
}

fn open(dir: &Path, skip_bad: bool) -> Result<DatasetIndex, vrtspike::dataset::DataError> {
    DatasetIndex::open_folder(
        dir,
        "train",
        IndexOptions {
            blur_dir: BlurDir::Blur,
            skip_bad,
            ..IndexOptions::default()
        },
    )
}

#[test]
fn index_lists_sorted_frames_and_records_match_files() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let index = open(dir.path(), false).unwrap();
    assert_eq!(index.sequences.len(), 2);
    assert_eq!(index.frame_count(), 16);
    let test = DatasetIndex::open_folder(dir.path(), "test", IndexOptions::default()).unwrap();
    assert_eq!(test.sequences.len(), 1);
    for seq in &index.sequences {
        assert_eq!((seq.height, seq.width), (64, 96));
        let names: Vec<&str> = seq.frames.iter().map(|f| f.name.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        let n = index.meta.blur_frames[&seq.name];
        assert!(seq.frames.iter().all(|f| f.spike_steps == 8 * n));
    }
    // A record decoded from disk holds exactly the files' pixels and top-down spikes.
    let layout = index.record_layout(1, 3);
    let mut record = vec![0u8; layout.byte_len()];
    index.encode_into(1, 3, &mut record).unwrap();
    let view = RecordView::parse(&record, "k").unwrap();
    let (blur, sharp, spike) = index.frame_paths(1, 3);
    assert_eq!(
        view.blur(),
        image::read_png_rgb(&blur).unwrap().data.as_slice()
    );
    assert_eq!(
        view.sharp(),
        image::read_png_rgb(&sharp).unwrap().data.as_slice()
    );
    let stream = dat::read_dat(&spike, 32, 48, true).unwrap();
    assert_eq!(view.spike(), stream.bits.as_slice());
    assert!(matches!(layout.payload, SpikePayload::Bits { steps } if steps == stream.steps));
    // Keys are distinct per frame and stable.
    assert_ne!(index.record_key(1, 3), index.record_key(1, 4));
    assert_eq!(index.record_key(0, 0), index.record_key(0, 0));
    assert!(index.record_key(1, 3).ends_with("/train/SYN03_001/000004"));
}

#[test]
fn blur_dir_picks_blur_gamma() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let seq = dir.path().join("train/SYN03_000");
    let options = IndexOptions {
        blur_dir: BlurDir::BlurGamma,
        skip_bad: false,
        ..IndexOptions::default()
    };
    let err = DatasetIndex::open_folder(dir.path(), "train", options)
        .unwrap_err()
        .to_string();
    assert!(err.contains("blur_gamma"), "{err}");
    for s in ["SYN03_000", "SYN03_001"] {
        let d = dir.path().join("train").join(s);
        std::fs::create_dir(d.join("blur_gamma")).unwrap();
        for e in std::fs::read_dir(d.join("sharp")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join("blur_gamma").join(e.file_name())).unwrap();
        }
    }
    let index = DatasetIndex::open_folder(dir.path(), "train", options).unwrap();
    let (blur, _, _) = index.frame_paths(0, 0);
    assert!(blur.starts_with(seq.join("blur_gamma")));
    assert_ne!(
        index.record_key(0, 0),
        open(dir.path(), false).unwrap().record_key(0, 0)
    );
}

#[test]
fn bad_inputs_name_the_file_or_are_counted_skips() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let seq = dir.path().join("train/SYN03_000");
    // Missing partner file.
    std::fs::remove_file(seq.join("sharp/000002.png")).unwrap();
    let err = open(dir.path(), false).unwrap_err().to_string();
    assert!(
        err.contains("sharp/000002.png") && err.contains("missing"),
        "{err}"
    );
    // Corrupt .dat size.
    std::fs::write(seq.join("spike/000005.dat"), [0u8; 100]).unwrap();
    // PNG of another size than its sequence.
    let small = image::RgbImage {
        height: 32,
        width: 96,
        data: vec![9; 32 * 96 * 3],
    };
    image::write_png_rgb(&seq.join("blur/000007.png"), &small).unwrap();
    image::write_png_rgb(&seq.join("sharp/000007.png"), &small).unwrap();
    // A PNG that does not decode.
    std::fs::write(seq.join("blur/000008.png"), b"junk").unwrap();

    let index = open(dir.path(), true).unwrap();
    assert_eq!(index.skipped.len(), 4, "{:?}", index.skipped);
    assert_eq!(index.frame_count(), 16 - 4);
    let reasons: Vec<String> = index.skipped.iter().map(|s| s.reason.clone()).collect();
    assert!(reasons
        .iter()
        .any(|r| r.contains("000005.dat") && r.contains("100 bytes")));
    assert!(reasons
        .iter()
        .any(|r| r.contains("000007.png") && r.contains("32x96")));
    assert!(reasons
        .iter()
        .any(|r| r.contains("000008.png") && r.contains("decode")));

    // Without skipping, the first bad file is the error.
    std::fs::copy(seq.join("blur/000002.png"), seq.join("sharp/000002.png")).ok();
    std::fs::copy(seq.join("blur/000001.png"), seq.join("sharp/000002.png")).unwrap();
    let err = open(dir.path(), false).unwrap_err().to_string();
    assert!(err.contains("000005.dat"), "{err}");

    // Missing dataset.yaml.
    std::fs::remove_file(dir.path().join("dataset.yaml")).unwrap();
    let err = open(dir.path(), false).unwrap_err().to_string();
    assert!(err.contains("dataset.yaml"), "{err}");
}

#[test]
fn synth_is_deterministic_for_a_seed() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    tiny(a.path());
    tiny(b.path());
    for rel in [
        "dataset.yaml",
        "train/SYN03_001/blur/000008.png",
        "test/SYN03_T000/spike/000003.dat",
    ] {
        assert_eq!(
            std::fs::read(a.path().join(rel)).unwrap(),
            std::fs::read(b.path().join(rel)).unwrap(),
            "{rel}"
        );
    }
}
