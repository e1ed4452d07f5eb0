//! `vrtspike synth` and `vrtspike inspect` end to end: the binary writes a dataset
//! and a safetensors file whose tensors equal what the library builds for the model.

use std::process::Command;

use vrtspike::config::Augment;
use vrtspike::dataset::{DatasetIndex, IndexOptions};
use vrtspike::pipeline::sample::{build_sample, ClipRef, CropMode, SampleSpec};
use vrtspike::pipeline::DiskSource;
use vrtspike::util::rng::SplitMix64;

fn vrtspike(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vrtspike"))
        .args(args)
        .output()
        .expect("run vrtspike")
}

fn floats(t: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn synth_then_inspect() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ds");
    let root_s = root.to_str().unwrap();
    let out = vrtspike(&[
        "synth",
        "--out",
        root_s,
        "--seqs",
        "1",
        "--test-seqs",
        "0",
        "--frames",
        "3",
        "--height",
        "64",
        "--width",
        "96",
        "--seed",
        "5",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let index = DatasetIndex::open_folder(&root, "train", IndexOptions::default()).unwrap();
    let seq = index.sequences[0].name.clone();

    let file = dir.path().join("f.safetensors");
    let out = vrtspike(&[
        "inspect",
        "--root",
        root_s,
        "--seq",
        &seq,
        "--frame",
        "000002",
        "--crop",
        "16,32,32",
        "--bins",
        "8",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let spec = SampleSpec {
        crop: CropMode::Fixed {
            y: 16,
            x: 32,
            size: 32,
        },
        augment: Augment::all(false),
        bins: 8,
    };
    let want = build_sample(
        &index,
        ClipRef { seq: 0, start: 1 },
        1,
        &spec,
        &mut SplitMix64::new(0),
        &mut DiskSource::default(),
    )
    .unwrap();
    let blur = st.tensor("blur").unwrap();
    assert_eq!(blur.shape(), &[3, 32, 32]);
    assert_eq!(floats(&blur), want.blur);
    assert_eq!(floats(&st.tensor("sharp").unwrap()), want.sharp);
    let voxel = st.tensor("voxel").unwrap();
    assert_eq!(voxel.shape(), &[8, 16, 16]);
    assert_eq!(floats(&voxel), want.voxel);

    // Whole frame without --crop; a misaligned crop and an unknown frame are clear errors.
    let out = vrtspike(&[
        "inspect",
        "--root",
        root_s,
        "--seq",
        &seq,
        "--frame",
        "000001",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("voxel").unwrap().shape(), &[32, 32, 48]);
    let out = vrtspike(&[
        "inspect",
        "--root",
        root_s,
        "--seq",
        &seq,
        "--frame",
        "000001",
        "--crop",
        "1,0,16",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("multiples of 2"));
    let out = vrtspike(&[
        "inspect",
        "--root",
        root_s,
        "--seq",
        &seq,
        "--frame",
        "999999",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("999999"));
}

#[test]
fn synth_h5_then_inspect_matches_the_folder_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = Vec::new();
    for (name, extra) in [("folder", None), ("h5", Some("--h5"))] {
        let root = dir.path().join(name);
        let root_s = root.to_str().unwrap();
        let mut args = vec![
            "synth",
            "--out",
            root_s,
            "--seqs",
            "1",
            "--test-seqs",
            "0",
            "--frames",
            "2",
            "--height",
            "32",
            "--width",
            "48",
            "--seed",
            "7",
        ];
        args.extend(extra);
        let out = vrtspike(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(root.join("train/SYN07_000.h5").is_file(), extra.is_some());
        let file = dir.path().join(format!("{name}.safetensors"));
        let out = vrtspike(&[
            "inspect",
            "--root",
            root_s,
            "--seq",
            "SYN07_000",
            "--frame",
            "000002",
            "--bins",
            "4",
            "--out",
            file.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        tensors.push(["blur", "sharp", "voxel"].map(|t| floats(&st.tensor(t).unwrap())));
    }
    assert!(tensors[0][2].iter().any(|v| *v > 0.0));
    assert_eq!(tensors[0], tensors[1]);
}

/// A reader that stops early (`vrtspike config show ... | head`) ends the printing
/// subcommand quietly, not with a panic on the closed pipe.
#[test]
fn a_closed_stdout_is_not_a_panic() {
    use std::io::Read;
    use std::process::Stdio;
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/demo/unet_spike_demo.yaml"
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_vrtspike"))
        .args(["config", "show", "--json", "--config", config])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vrtspike");
    drop(child.stdout.take());
    let mut stderr = String::new();
    if let Some(mut err) = child.stderr.take() {
        err.read_to_string(&mut stderr).expect("read stderr");
    }
    let status = child.wait().expect("wait for vrtspike");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_ne!(status.code(), Some(101), "{stderr}");
}
