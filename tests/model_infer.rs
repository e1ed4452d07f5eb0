//! `vrtspike infer` end to end on a synthetic dataset and a tiny `unet_spike`: one
//! PNG per frame, tiled+clipped output equal to a whole-frame whole-sequence run,
//! reported PSNR equal to PSNR recomputed from the PNGs, bad inputs named.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use tch::{nn, Device, Kind, Tensor};
use vrtspike::config::Config;
use vrtspike::dataset::image::read_png_rgb;
use vrtspike::eval::quality::psnr_u8;
use vrtspike::model;

const FRAMES: usize = 8;
const HEIGHT: u32 = 128;
const WIDTH: u32 = 160;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_vrtspike")
}

fn tiny_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny/unet_spike_tiny.yaml")
}

fn run(args: &[&str]) -> Output {
    Command::new(exe())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run vrtspike")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Synthetic dataset (1 train, 2 test sequences of FRAMES frames) and tiny weights.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let root = dir.join("data");
    let out = run(&[
        "synth",
        "--out",
        root.to_str().unwrap(),
        "--seqs",
        "1",
        "--test-seqs",
        "2",
        "--frames",
        &FRAMES.to_string(),
        "--height",
        &HEIGHT.to_string(),
        "--width",
        &WIDTH.to_string(),
    ]);
    assert!(out.status.success(), "synth: {}", stderr(&out));
    let cfg = Config::load(&tiny_config()).unwrap().model;
    tch::manual_seed(11);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = model::build(&vs.root(), &cfg).unwrap();
    let weights = dir.join("tiny.safetensors");
    model::save_safetensors(&vs, &weights).unwrap();
    (root, weights)
}

fn infer(root: &Path, weights: &Path, out: &Path, clip: [usize; 2], tile: [i64; 2]) -> Value {
    let result = run(&[
        "infer",
        "--checkpoint",
        weights.to_str().unwrap(),
        "--config",
        tiny_config().to_str().unwrap(),
        "--input",
        root.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--clip",
        &clip[0].to_string(),
        "--clip-overlap",
        &clip[1].to_string(),
        "--tile",
        &tile[0].to_string(),
        "--tile-overlap",
        &tile[1].to_string(),
        "--json",
    ]);
    assert!(result.status.success(), "infer: {}", stderr(&result));
    serde_json::from_slice(&result.stdout).expect("one JSON object on stdout")
}

/// Sorted `.png` files of a folder.
fn pngs(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "png"))
        .collect();
    files.sort();
    files
}

fn levels(path: &Path) -> Tensor {
    let img = read_png_rgb(path).unwrap();
    Tensor::from_slice(&img.data)
        .view([img.height as i64, img.width as i64, 3])
        .permute([2, 0, 1])
        .to_kind(Kind::Double)
}

#[test]
fn tiled_clipped_inference_matches_a_whole_run_and_reports_png_psnr() {
    let dir = tempfile::tempdir().unwrap();
    let (root, weights) = setup(dir.path());
    let tiled_out = dir.path().join("tiled");
    let whole_out = dir.path().join("whole");
    // Clips of 6 frames overlapping 4 (starts 0, 2; kept frames at least two frames
    // from an inner clip edge: the temporal receptive field is 2 frames); tiles of
    // 96 overlapping 64 (2 x 3 tiles; kept pixels at least 32 from an inner tile
    // edge, beyond the U-Net's spatial receptive field).
    let report = infer(&root, &weights, &tiled_out, [6, 4], [96, 64]);
    infer(&root, &weights, &whole_out, [100, 0], [512, 0]);

    let sequences = report["sequences"].as_array().unwrap();
    assert_eq!(sequences.len(), 2);
    let mut seq_psnrs = Vec::new();
    let mut changed = 0;
    for seq in sequences {
        let name = seq["name"].as_str().unwrap();
        let src = root.join("test").join(name);
        let inputs = pngs(&src.join("blur"));
        let outputs = pngs(&tiled_out.join(name));
        assert_eq!(inputs.len(), FRAMES);
        assert_eq!(outputs.len(), FRAMES, "one PNG per input frame");
        assert_eq!(seq["frames"].as_u64(), Some(FRAMES as u64));
        let (mut psnr, mut input_psnr) = (0.0, 0.0);
        for (input, output) in inputs.iter().zip(&outputs) {
            assert_eq!(input.file_name(), output.file_name());
            let img = read_png_rgb(output).unwrap();
            assert_eq!((img.height, img.width), (HEIGHT, WIDTH));
            let (out_l, blur_l) = (levels(output), levels(input));
            let sharp = levels(&src.join("sharp").join(input.file_name().unwrap()));
            let whole = levels(&whole_out.join(name).join(output.file_name().unwrap()));
            let diff = (&out_l - &whole).abs().max().double_value(&[]);
            assert!(
                diff <= 1.0,
                "{}: tiled vs whole differ by {diff} levels",
                output.display()
            );
            // The model is not the identity (the comparison above is not vacuous).
            if (&out_l - &blur_l).abs().max().double_value(&[]) > 1.0 {
                changed += 1;
            }
            psnr += psnr_u8(&out_l, &sharp).unwrap();
            input_psnr += psnr_u8(&blur_l, &sharp).unwrap();
        }
        psnr /= FRAMES as f64;
        input_psnr /= FRAMES as f64;
        let reported = seq["psnr"].as_f64().unwrap();
        assert!(
            (reported - psnr).abs() < 1e-9,
            "{name}: reported {reported}, PNGs {psnr}"
        );
        let reported_input = seq["input_psnr"].as_f64().unwrap();
        assert!((reported_input - input_psnr).abs() < 1e-9);
        let ssim = seq["ssim"].as_f64().unwrap();
        assert!(ssim > 0.0 && ssim <= 1.0, "{ssim}");
        seq_psnrs.push(psnr);
    }
    assert_eq!(changed, 2 * FRAMES, "the output differs from the input");
    let overall = report["overall"]["psnr"].as_f64().unwrap();
    let mean = seq_psnrs.iter().sum::<f64>() / seq_psnrs.len() as f64;
    assert!((overall - mean).abs() < 1e-9);
    assert_eq!(
        report["overall"]["frames"].as_u64(),
        Some(2 * FRAMES as u64)
    );
}

#[test]
fn bad_inputs_are_errors_naming_the_path_or_option() {
    let dir = tempfile::tempdir().unwrap();
    let (root, weights) = setup(dir.path());
    let out = dir.path().join("out");
    let config = tiny_config();
    let base = |ckpt: &Path, cfg: &Path, input: &Path| -> Vec<String> {
        [
            "infer",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let fails = |args: Vec<String>, needle: &str| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let result = run(&refs);
        assert!(!result.status.success(), "{args:?} succeeded");
        let err = stderr(&result);
        assert!(
            err.contains(needle),
            "{args:?}: {err:?} does not name {needle:?}"
        );
    };
    let missing = dir.path().join("no_such_checkpoint");
    fails(base(&missing, &config, &root), missing.to_str().unwrap());
    // A run directory without checkpoints.
    let run_dir = dir.path().join("run");
    std::fs::create_dir_all(run_dir.join("checkpoints")).unwrap();
    fails(base(&run_dir, &config, &root), run_dir.to_str().unwrap());
    // Weights of another model.
    let vrt = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny/vrt_spike_tiny.yaml");
    fails(base(&weights, &vrt, &root), weights.to_str().unwrap());
    // An empty input folder.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    fails(base(&weights, &config, &empty), empty.to_str().unwrap());
    // Tiles smaller than the U-Net's 4-pixel multiple.
    let mut small = base(&weights, &config, &root);
    small.extend(["--tile", "2", "--tile-overlap", "0"].map(String::from));
    fails(small, "--tile");
    // A sequence with a single frame.
    let test = root.join("test");
    let seq = std::fs::read_dir(&test)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    for sub in ["blur", "sharp", "spike"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(seq.join(sub))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for file in files.iter().skip(1) {
            std::fs::remove_file(file).unwrap();
        }
    }
    fails(base(&weights, &config, &root), seq.to_str().unwrap());
    fails(base(&weights, &config, &root), "at least 2");
}
