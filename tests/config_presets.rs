//! The three guide presets (`configs/deblur/vrt_spike_{opt,fast,lowmem}.yaml`) load
//! through `BASE: vrt_spike_baseline.yaml` and build the architecture they claim:
//! blocks per stage, the attention window, the chunking and the parameter counts.
//! The user's own files of each preset (`tests/fixtures/guide/`: only the guide's keys,
//! no `MODEL.ARCH`) build a VRT-Spike of exactly the preset's size, and a U-Net file
//! with a VRT key is refused naming the key and the architecture.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use tch::{nn, Device};
use vrtspike::config::{Arch, Config, Source, Workers};
use vrtspike::model;

fn preset(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs/deblur")
        .join(name)
}

/// Blocks per stage as built: 7 U-stages (both TMSA groups), then the stage-8 groups.
fn built_depths(vs: &nn::VarStore) -> Vec<usize> {
    let names: Vec<String> = vs.variables().into_keys().collect();
    let blocks = |prefix: &str| {
        names
            .iter()
            .filter_map(|n| n.strip_prefix(prefix))
            .filter_map(|rest| rest.split('.').next().map(str::to_string))
            .collect::<BTreeSet<_>>()
            .len()
    };
    let mut depths: Vec<usize> = (1..=7)
        .map(|i| {
            blocks(&format!("stage{i}.residual_group1.blocks."))
                + blocks(&format!("stage{i}.residual_group2.blocks."))
        })
        .collect();
    let mut g = 1;
    while names
        .iter()
        .any(|n| n.starts_with(&format!("stage8.{g}.residual_group.")))
    {
        depths.push(blocks(&format!("stage8.{g}.residual_group.blocks.")));
        g += 1;
    }
    depths
}

/// Built parameters (all trainable) and the per-stage depths and window of the model.
fn build(config: &Config) -> (i64, Vec<usize>, Vec<i64>) {
    let vs = nn::VarStore::new(Device::Cpu);
    model::build(&vs.root(), &config.model).unwrap();
    let params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    let table =
        vs.variables()["stage1.residual_group2.blocks.0.attn.relative_position_bias_table"].size();
    (params, built_depths(&vs), table)
}

/// Rows of the relative position bias table of a (T, H, W) window.
fn table_rows(w: [i64; 3]) -> i64 {
    (2 * w[0] - 1) * (2 * w[1] - 1) * (2 * w[2] - 1)
}

#[test]
fn presets_load_and_build_what_they_claim() {
    let base = Config::load(&preset("vrt_spike_baseline.yaml")).unwrap();
    let (base_params, base_depths, base_table) = build(&base);
    assert_eq!(base_depths, vec![8, 8, 8, 8, 4, 4, 4, 8]);
    assert_eq!(base_table[0], table_rows([6, 8, 8]));

    let opt = Config::resolve(&preset("vrt_spike_opt.yaml"), &[]).unwrap();
    assert_eq!(
        opt.origin("MODEL.EMBED_DIMS").source,
        Source::Base(
            preset("vrt_spike_opt.yaml")
                .parent()
                .unwrap()
                .join("vrt_spike_baseline.yaml")
        )
    );
    let opt = opt.config;
    assert_eq!(opt.model.window_size, [6, 7, 7]);
    assert_eq!(opt.model.tsa_chunking().chunk_size, 80);
    assert!(!opt.model.tsa_chunking().adaptive_chunk);
    assert_eq!(opt.model.fuse.chunk_size, 80);
    let (opt_params, opt_depths, opt_table) = build(&opt);
    assert_eq!(opt_depths, vec![8, 7, 8, 8, 4, 4, 4, 6]);
    assert_eq!(opt_table[0], table_rows([6, 7, 7]));

    let fast = Config::load(&preset("vrt_spike_fast.yaml")).unwrap();
    assert_eq!(fast.model.window_size, [6, 6, 6]);
    assert_eq!(fast.data.crop_size, 128);
    assert_eq!(fast.train.batch_size, 2);
    assert_eq!(fast.dataloader.train_prefetch_factor, 6);
    let (fast_params, fast_depths, fast_table) = build(&fast);
    assert_eq!(fast_depths, vec![8, 6, 6, 8, 4, 4, 4, 4]);
    assert_eq!(fast_table[0], table_rows([6, 6, 6]));

    let low = Config::load(&preset("vrt_spike_lowmem.yaml")).unwrap();
    assert_eq!(low.data.cache_size_gb, 20.0);
    assert_eq!(low.dataloader.total_workers, Workers::Count(8));
    assert_eq!(low.dataloader.train_prefetch_factor, 2);
    assert_eq!(low.train.gradient_accumulation_steps, 4);
    let (low_params, low_depths, _) = build(&low);
    assert_eq!(low_depths, base_depths);
    assert_eq!(low_params, base_params);

    eprintln!(
        "parameters: baseline {base_params}, opt {opt_params}, fast {fast_params}, lowmem {low_params}"
    );
    assert_eq!(
        [base_params, opt_params, fast_params],
        [18_412_647, 17_862_129, 17_075_319]
    );
}

fn guide_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/guide")
        .join(name)
}

#[test]
fn the_default_model_is_the_baseline_vrt_spike() {
    let base = Config::load(&preset("vrt_spike_baseline.yaml")).unwrap();
    let default = Config::default();
    assert_eq!(default.model.arch, Arch::VrtSpike);
    assert_eq!(
        serde_json::to_value(&default.model).unwrap(),
        serde_json::to_value(&base.model).unwrap()
    );
}

#[test]
fn the_users_guide_files_build_their_preset() {
    for (guide, shipped) in [
        ("baseline.yaml", "vrt_spike_baseline.yaml"),
        ("opt.yaml", "vrt_spike_opt.yaml"),
        ("fast.yaml", "vrt_spike_fast.yaml"),
        ("lowmem.yaml", "vrt_spike_lowmem.yaml"),
    ] {
        let user = Config::resolve(&guide_file(guide), &[]).unwrap();
        assert_eq!(user.origin("MODEL.ARCH").source, Source::Default, "{guide}");
        assert_eq!(user.config.model.arch, Arch::VrtSpike, "{guide}");
        let preset = Config::load(&preset(shipped)).unwrap();
        let (user_params, user_depths, user_table) = build(&user.config);
        let (preset_params, preset_depths, preset_table) = build(&preset);
        assert_eq!(user_params, preset_params, "{guide} against {shipped}");
        assert_eq!(user_depths, preset_depths, "{guide} against {shipped}");
        assert_eq!(user_table, preset_table, "{guide} against {shipped}");
        // The run settings the guide gives are the preset's too.
        let (u, p) = (&user.config, &preset);
        assert_eq!(
            (
                u.data.crop_size,
                u.train.batch_size,
                u.train.gradient_accumulation_steps
            ),
            (
                p.data.crop_size,
                p.train.batch_size,
                p.train.gradient_accumulation_steps
            ),
            "{guide} against {shipped}"
        );
    }
}

fn vrtspike(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vrtspike"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

#[test]
fn the_issues_summary_of_the_guide_file_is_a_vrt_spike() {
    let guide = guide_file("opt.yaml");
    let out = vrtspike(&[
        "model",
        "summary",
        "--json",
        "--config",
        guide.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["arch"], "vrt_spike");
    assert_eq!(summary["total_params"], 17_862_129);
}

#[test]
fn a_unet_file_with_a_vrt_key_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("unet.yaml");
    std::fs::write(
        &path,
        "MODEL:\n  ARCH: unet_spike\n  UNET: {CHANNELS: 16}\n  VRT_DEPTHS: [8, 7, 8, 8, 4, 4, 4, 6]\n",
    )
    .unwrap();
    let shown = path.display().to_string();
    for args in [
        vec!["model", "summary", "--config", &shown],
        vec!["config", "show", "--config", &shown],
        vec!["plan", "--config", &shown],
    ] {
        let out = vrtspike(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "config {shown}: MODEL.VRT_DEPTHS is not used by MODEL.ARCH unet_spike"
            )),
            "{args:?}: {stderr}"
        );
    }
    // The same key through --set on a U-Net file names the override.
    std::fs::write(&path, "MODEL:\n  ARCH: unet_spike\n").unwrap();
    let out = vrtspike(&[
        "config",
        "show",
        "--config",
        &shown,
        "--set",
        "MODEL.WINDOW_SIZE=7",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("override --set MODEL.WINDOW_SIZE=7: MODEL.WINDOW_SIZE is not used"),
        "{stderr}"
    );
}
