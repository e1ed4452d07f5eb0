//! The three guide presets (`configs/deblur/vrt_spike_{opt,fast,lowmem}.yaml`) load
//! through `BASE: vrt_spike_baseline.yaml` and build the architecture they claim:
//! blocks per stage, the attention window, the chunking and the parameter counts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tch::{nn, Device};
use vrtspike::config::{Config, Source, Workers};
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
