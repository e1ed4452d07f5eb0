//! Training is unchanged by the cache's eviction policy: two CPU ranks of
//! `vrtspike train` on a synthetic set four times the cache, once with
//! `DATA.CACHE_POLICY: planned` (the ranks announce their reads; the loader
//! prefetches) and once with `lru`, end with byte-identical weights, while the
//! server shows the read orders were there (or not) and that records were evicted.

use std::path::{Path, PathBuf};
use std::time::Duration;

mod ranks_support;

use ranks_support::{start_ranks, wait_all};
use vrtspike::cache::{spawn_server, CacheClient, ServerConfig, StatsReport};
use vrtspike::synth::{self, SynthOptions};

/// How long both ranks may take.
const RANKS_LIMIT: Duration = Duration::from_secs(300);

fn write_config(dir: &Path, data: &Path, policy: &str) -> PathBuf {
    let path = dir.join(format!("{policy}.yaml"));
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: 32\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  CACHE_POLICY: {policy}\n\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 2\n  TOTAL_STEPS: 12\n  LR: 1.0e-3\n  SEED: 5\n  PARAM_CHECK_EVERY: 4\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 4\n  VAL_EVERY_STEPS: 6\n  CKPT_EVERY_STEPS: 1000\n  MEM_EVERY_STEPS: 1000\n\
         DIST:\n  TIMEOUT_S: 60\n",
        data.display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Trains with `policy` on a fresh server of `cap` bytes: the final weights' bytes
/// and the server's figures.
fn train(tmp: &Path, data: &Path, policy: &str, cap: u64) -> (Vec<u8>, StatsReport) {
    let address = format!("vrtspike-test-policy-{policy}-{}", std::process::id());
    let server = spawn_server(ServerConfig::new(address.clone(), cap)).unwrap();
    let run = tmp.join(policy);
    std::fs::create_dir_all(&run).unwrap();
    let config = write_config(tmp, data, policy);
    let mut ranks = start_ranks(&config, &run, Some(server.address()));
    wait_all(&mut ranks, &run, RANKS_LIMIT);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("result.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "completed", "{summary}");
    let weights = run.join("checkpoints/step_00000012/model.safetensors");
    let bytes = std::fs::read(&weights).unwrap_or_else(|e| panic!("{}: {e}", weights.display()));
    let stats = CacheClient::connect(&address, "check")
        .unwrap()
        .stats()
        .unwrap();
    (bytes, stats)
}

#[test]
fn planned_and_lru_train_the_same_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let options = SynthOptions {
        train_seqs: 3,
        test_seqs: 1,
        frames: 8,
        height: 64,
        width: 96,
        seed: 4,
    };
    synth::generate_folder(&data, &options, &|_| {}).unwrap();
    let index = vrtspike::dataset::DatasetIndex::open(&data, "train", Default::default()).unwrap();
    let bytes: u64 = (0..3)
        .flat_map(|s| (0..8).map(move |f| (s, f)))
        .map(|(s, f)| index.record_layout(s, f).byte_len() as u64)
        .sum();
    let cap = bytes / 4;

    let (planned, with_orders) = train(tmp.path(), &data, "planned", cap);
    let (lru, without) = train(tmp.path(), &data, "lru", cap);
    assert!(
        planned == lru,
        "the weights differ between the planned policy and LRU"
    );
    // Both ranks announced each epoch they started (12 steps of 2 x 2 samples over
    // 21 clips: 3 epochs), and the cache was too small for the data.
    assert!(
        with_orders.read_orders.announced >= 4,
        "{:?}",
        with_orders.read_orders
    );
    assert!(
        with_orders.read_orders.prefetched + with_orders.read_orders.prefetch_declined > 0,
        "the loaders prefetched: {:?}",
        with_orders.read_orders
    );
    assert!(with_orders.evictions > 0 && without.evictions > 0);
    assert_eq!(
        without.read_orders.announced, 0,
        "{:?}",
        without.read_orders
    );
}
