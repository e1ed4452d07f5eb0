//! The per-rank loader on generated data: batches in sampler order and independent
//! of the worker count, the same samples from disk and through the cache (with the
//! hit rate reported), records of three sizes through a cache a third of their size,
//! reads the cache cannot take served from disk and counted as bypasses, exact
//! mid-epoch resume, and a clear error without a server; two loaders reading one
//! root differently (`DATA.USE_PRECOMPUTED_VOXELS` true and false) through one
//! server each get their own records, and a cached record of another layout than
//! the reader expects is read from disk and counted; workers the server has no
//! connection left for read from disk, and the loader starts and serves all.

use std::path::Path;
use std::sync::Arc;

use vrtspike::cache::{spawn_server, CacheClient, ServerConfig};
use vrtspike::config::{Augment, CachePolicy};
use vrtspike::dataset::index::{SpikeSource, Storage};
use vrtspike::dataset::{DatasetIndex, IndexOptions};
use vrtspike::pipeline::loader::{Batch, Loader, LoaderOptions};
use vrtspike::pipeline::sample::{ClipIndex, ClipWindows, CropMode, SampleSpec};
use vrtspike::pipeline::sampler::{DistributedSampler, Remainder, SamplerOptions};
use vrtspike::pipeline::BatchTensors;
use vrtspike::synth::{self, BlurLengths, SynthOptions};

fn tiny(dir: &Path) -> (Arc<DatasetIndex>, Arc<ClipIndex>) {
    let options = SynthOptions {
        train_seqs: 2,
        test_seqs: 0,
        frames: 8,
        height: 64,
        width: 96,
        seed: 1,
    };
    synth::generate_folder(dir, &options, &|_| {}).unwrap();
    let index = DatasetIndex::open_folder(dir, "train", IndexOptions::default()).unwrap();
    let clips = ClipIndex::new(&index, ClipWindows::sliding(4));
    (Arc::new(index), Arc::new(clips))
}

fn options(workers: usize, cache: Option<&str>) -> LoaderOptions {
    LoaderOptions {
        workers,
        prefetch_batches: 2 * workers,
        batch_size: 2,
        drop_last_batch: false,
        spec: SampleSpec {
            crop: CropMode::Random(32),
            augment: Augment::all(true),
            bins: 8,
        },
        seed: 11,
        rank: 0,
        cache_address: cache.map(str::to_owned),
        client_name: "test".into(),
        skip_bad: false,
        cache_policy: CachePolicy::Lru,
        cache_prefetch: false,
    }
}

fn epoch(loader: &mut Loader, epoch: u64) -> Vec<Batch> {
    loader.set_epoch(epoch);
    std::iter::from_fn(|| loader.next_batch())
        .map(|b| b.unwrap())
        .collect()
}

fn sampler(clips: &ClipIndex) -> DistributedSampler {
    let options = SamplerOptions {
        world: 1,
        rank: 0,
        shuffle: true,
        seed: 11,
        remainder: Remainder::Pad,
    };
    DistributedSampler::new(clips.clips.len(), options).unwrap()
}

/// Sequences of 7, 11, 7, 11 and 13 sharp frames a blur at 128x192: records of three
/// sizes (about 190, 215 and 227 KB), the largest in the last sequence only; clips of
/// 2 frames.
fn mixed(dir: &Path) -> (Arc<DatasetIndex>, Arc<ClipIndex>) {
    let options = SynthOptions {
        train_seqs: 5,
        test_seqs: 0,
        frames: 6,
        height: 128,
        width: 192,
        seed: 2,
    };
    let blur = BlurLengths::cycle(vec![7, 11, 7, 11, 13]).unwrap();
    synth::generate(dir, &options, &blur, &|_| {}, synth::Layout::Folder).unwrap();
    let index = DatasetIndex::open_folder(dir, "train", IndexOptions::default()).unwrap();
    let clips = ClipIndex::new(&index, ClipWindows::sliding(2));
    (Arc::new(index), Arc::new(clips))
}

/// Clips in order, sequence after sequence.
fn in_order(clips: &ClipIndex) -> DistributedSampler {
    let options = SamplerOptions {
        world: 1,
        rank: 0,
        shuffle: false,
        seed: 11,
        remainder: Remainder::Pad,
    };
    DistributedSampler::new(clips.clips.len(), options).unwrap()
}

/// The byte length of every record of sequence `seq`.
fn record_lens(index: &DatasetIndex, seq: usize) -> Vec<u64> {
    (0..index.sequences[seq].frames.len())
        .map(|f| index.record_layout(seq, f).byte_len() as u64)
        .collect()
}

/// A loader of `data` with `workers` threads in `sampler`'s order, through the
/// cache at `cache` if given.
fn loader(
    data: &(Arc<DatasetIndex>, Arc<ClipIndex>),
    sampler: DistributedSampler,
    workers: usize,
    cache: Option<&str>,
) -> Loader {
    let (index, clips) = (data.0.clone(), data.1.clone());
    Loader::new(index, clips, sampler, options(workers, cache)).unwrap()
}

/// Fails unless `got` holds the samples of `expected`, batch by batch.
fn assert_same(expected: &[Batch], got: &[Batch], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: batches");
    for (a, b) in expected.iter().zip(got) {
        assert_eq!(a.samples, b.samples, "{what}");
    }
}

#[test]
fn records_of_three_sizes_are_all_served_through_a_cache_a_third_of_their_size() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed(dir.path());
    let (index, clips) = (&data.0, &data.1);
    let lens: Vec<Vec<u64>> = (0..5).map(|seq| record_lens(index, seq)).collect();
    let mut sizes: Vec<u64> = lens.iter().flatten().copied().collect();
    sizes.sort_unstable();
    sizes.dedup();
    assert_eq!(sizes.len(), 3, "record sizes {sizes:?}");
    let largest = sizes[2];
    assert!(lens[..4].iter().flatten().all(|&l| l < largest));
    let cap = lens.iter().flatten().sum::<u64>() / 3;
    // Read in order, the store is full long before the largest size comes.
    assert!(lens[..2].iter().flatten().sum::<u64>() > cap);

    let mut disk = loader(&data, in_order(clips), 2, None);
    let reference: Vec<Vec<Batch>> = (0..2).map(|e| epoch(&mut disk, e)).collect();
    let address = format!("vrtspike-test-loader-sizes-{}", std::process::id());
    let _server = spawn_server(ServerConfig::new(address.clone(), cap)).unwrap();
    let mut cached = loader(&data, in_order(clips), 2, Some(&address));
    for (e, expected) in reference.iter().enumerate() {
        let got = epoch(&mut cached, e as u64);
        assert_same(expected, &got, &format!("epoch {e}: through the cache"));
    }
    let s = cached.stats();
    assert_eq!(s.cache_bypass, 0, "{s:?}");
    assert_eq!(s.samples, 2 * 25);
    let server = CacheClient::connect(&address, "check")
        .unwrap()
        .stats()
        .unwrap();
    assert!(server.bytes_carved <= server.cap_bytes, "{server:?}");
    assert_eq!(
        server.full_refusals + server.reserve_refusals,
        0,
        "{server:?}"
    );
    assert!(server.evictions > 0, "{server:?}");
    assert!(
        server.bytes_live as f64 > 0.75 * server.cap_bytes as f64,
        "live records fill only {} of {} bytes",
        server.bytes_live,
        server.cap_bytes
    );
}

#[test]
fn reads_the_cache_cannot_take_are_served_from_disk_as_bypasses() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed(dir.path());
    let reference = epoch(&mut loader(&data, in_order(&data.1), 2, None), 0);
    // Room for one record, and another client pins a record that takes most of it.
    let address = format!("vrtspike-test-loader-pinned-{}", std::process::id());
    let _server = spawn_server(ServerConfig::new(address.clone(), 256 << 10)).unwrap();
    let holder = CacheClient::connect(&address, "holder").unwrap();
    let pinned = holder
        .get_or_fill("pinned", 200 << 10, |slot| {
            slot.fill(7);
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap();
    let mut cached = loader(&data, in_order(&data.1), 2, Some(&address));
    let got = epoch(&mut cached, 0);
    assert_same(&reference, &got, "a bypassed read gave another sample");
    let s = cached.stats();
    assert_eq!(s.cache_hits, 0, "{s:?}");
    assert_eq!(s.cache_bypass, s.cache_misses, "{s:?}");
    assert_eq!(
        s.cache_bypass, 50,
        "every read of 25 clips of 2 frames: {s:?}"
    );
    let server = holder.stats().unwrap();
    assert_eq!(server.full_refusals, 50, "{server:?}");
    assert_eq!(server.records, 1);
    drop(pinned);
}

#[test]
fn disk_and_cache_give_identical_ordered_batches() {
    let dir = tempfile::tempdir().unwrap();
    let (index, clips) = tiny(dir.path());
    assert_eq!(clips.clips.len(), 10);
    let mut one = Loader::new(
        index.clone(),
        clips.clone(),
        sampler(&clips),
        options(1, None),
    )
    .unwrap();
    let reference = epoch(&mut one, 3);
    assert_eq!(reference.len(), 5);
    assert_eq!(
        reference.iter().map(|b| b.end_position).collect::<Vec<_>>(),
        vec![2, 4, 6, 8, 10]
    );
    let mut three = Loader::new(
        index.clone(),
        clips.clone(),
        sampler(&clips),
        options(3, None),
    )
    .unwrap();
    let disk = epoch(&mut three, 3);
    for (a, b) in reference.iter().zip(&disk) {
        assert_eq!(a.samples, b.samples, "worker count does not change samples");
    }
    assert_ne!(epoch(&mut three, 4)[0].samples, reference[0].samples);
    assert_eq!(three.stats().hit_rate, 0.0);

    let address = format!("vrtspike-test-loader-{}", std::process::id());
    let _server = spawn_server(ServerConfig::new(address.clone(), 64 << 20)).unwrap();
    let mut cached = Loader::new(
        index.clone(),
        clips.clone(),
        sampler(&clips),
        options(2, Some(&address)),
    )
    .unwrap();
    let first = epoch(&mut cached, 3);
    for (a, b) in reference.iter().zip(&first) {
        assert_eq!(a.samples, b.samples, "cache and disk give the same samples");
    }
    let s = cached.stats();
    // 10 clips x 4 frames = 40 reads of 16 distinct records (one of them may be
    // waited on by two workers at once, which counts as a miss for both).
    assert_eq!(s.cache_hits + s.cache_misses, 40);
    assert!(s.cache_misses >= 16 && s.cache_misses <= 18, "{s:?}");
    epoch(&mut cached, 5);
    let s2 = cached.stats();
    assert_eq!(
        s2.cache_misses, s.cache_misses,
        "warm cache: no more misses"
    );
    assert_eq!(s2.cache_hits, s.cache_hits + 40);
    assert!(s2.hit_rate > 0.7);
    assert_eq!(s2.batches, 10);
    assert!(s2.data_time_s > 0.0);
    let t = first[0].to_tensors(tch::Device::Cpu).unwrap();
    assert_eq!(t.0.size(), vec![2, 4, 3, 32, 32]);
    assert_eq!(t.2.size(), vec![2, 4, 8, 16, 16]);
}

#[test]
fn the_planned_policy_and_its_prefetch_give_the_same_batches() {
    // 5 sequences of 6 frames (about 200 KB a record), 25 clips of 2 frames, in a
    // shuffled order, through a cache a third of the data: the loader announces each
    // epoch's reads and prefetches ahead; the batches are the disk's, a resume
    // mid-epoch included.
    let dir = tempfile::tempdir().unwrap();
    let data = mixed(dir.path());
    let (index, clips) = (&data.0, &data.1);
    let cap = (0..5).flat_map(|s| record_lens(index, s)).sum::<u64>() / 3;
    let mut disk = loader(&data, sampler(clips), 2, None);
    let reference: Vec<Vec<Batch>> = (0..3).map(|e| epoch(&mut disk, e)).collect();
    let address = format!("vrtspike-test-loader-planned-{}", std::process::id());
    let _server = spawn_server(ServerConfig::new(address.clone(), cap)).unwrap();
    let planned = LoaderOptions {
        cache_policy: CachePolicy::Planned,
        cache_prefetch: true,
        ..options(2, Some(&address))
    };
    let mut cached = Loader::new(
        index.clone(),
        clips.clone(),
        sampler(clips),
        planned.clone(),
    )
    .unwrap();
    for (e, expected) in reference.iter().enumerate() {
        let got = epoch(&mut cached, e as u64);
        assert_same(
            expected,
            &got,
            &format!("epoch {e}: planned, through the cache"),
        );
    }
    let s = cached.stats();
    assert_eq!(s.samples, 3 * 25, "{s:?}");
    assert!(s.disk_bytes > 0, "{s:?}");
    let check = CacheClient::connect(&address, "check").unwrap();
    let server = check.stats().unwrap();
    assert_eq!(server.read_orders.live, 1, "{:?}", server.read_orders);
    assert_eq!(
        server.read_orders.announced, 3,
        "one read order an epoch: {:?}",
        server.read_orders
    );
    assert!(
        server.read_orders.prefetched + server.read_orders.prefetch_declined > 0,
        "the prefetch thread asked: {:?}",
        server.read_orders
    );
    assert!(server.evictions > 0, "{server:?}");
    // A rank that resumes mid-epoch announces from there and reads the same.
    cached.set_epoch(1);
    let _ = cached.next_batch().unwrap().unwrap();
    let state = cached.state();
    drop(cached);
    let mut resumed = Loader::new(index.clone(), clips.clone(), sampler(clips), planned).unwrap();
    resumed.restore(&state).unwrap();
    let rest: Vec<Batch> = std::iter::from_fn(|| resumed.next_batch())
        .map(|b| b.unwrap())
        .collect();
    let done = reference[1].len() - rest.len();
    assert_same(&reference[1][done..], &rest, "resumed mid-epoch, planned");
}

#[test]
fn a_node_without_memory_for_slots_still_serves_every_sample() {
    let dir = tempfile::tempdir().unwrap();
    let data = tiny(dir.path());
    let reference = epoch(&mut loader(&data, sampler(&data.1), 2, None), 3);
    let address = format!("vrtspike-test-loader-oom-{}", std::process::id());
    let mut config = ServerConfig::new(address.clone(), 64 << 20);
    // Headroom no machine has: every reservation is refused for memory.
    config.reserve_headroom = u64::MAX / 4;
    let _server = spawn_server(config).unwrap();
    let mut cached = loader(&data, sampler(&data.1), 2, Some(&address));
    let got = epoch(&mut cached, 3);
    assert_same(&reference, &got, "uncached records give the same samples");
    let s = cached.stats();
    assert_eq!(s.cache_hits, 0, "{s:?}");
    assert_eq!(s.cache_bypass, s.cache_misses, "{s:?}");
    assert!(s.cache_misses >= 40, "{s:?}");
}

#[test]
fn resume_mid_epoch_continues_with_the_same_samples() {
    let dir = tempfile::tempdir().unwrap();
    let (index, clips) = tiny(dir.path());
    let mut full = Loader::new(
        index.clone(),
        clips.clone(),
        sampler(&clips),
        options(2, None),
    )
    .unwrap();
    let all = epoch(&mut full, 2);
    let mut first = Loader::new(
        index.clone(),
        clips.clone(),
        sampler(&clips),
        options(2, None),
    )
    .unwrap();
    first.set_epoch(2);
    let _ = first.next_batch().unwrap().unwrap();
    let _ = first.next_batch().unwrap().unwrap();
    // Batches are prefetched ahead, but the saved cursor counts consumed ones only.
    let state = first.state();
    assert_eq!((state.epoch, state.position), (2, 4));
    drop(first);
    let mut resumed = Loader::new(index, clips.clone(), sampler(&clips), options(3, None)).unwrap();
    resumed.restore(&state).unwrap();
    let rest: Vec<Batch> = std::iter::from_fn(|| resumed.next_batch())
        .map(|b| b.unwrap())
        .collect();
    assert_eq!(rest.len(), 3);
    for (a, b) in all[2..].iter().zip(&rest) {
        assert_eq!(a.samples, b.samples);
    }
}

#[test]
fn missing_server_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (index, clips) = tiny(dir.path());
    let err = Loader::new(
        index,
        clips.clone(),
        sampler(&clips),
        options(1, Some("vrtspike-test-nobody-here")),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("vrtspike-test-nobody-here"), "{err}");
}

/// The tiny dataset of [`tiny`] with `spike_vox/` grids of 8 bins beside its
/// `spike/` streams, indexed twice: reading the streams
/// (`DATA.USE_PRECOMPUTED_VOXELS: false`) and reading the grids (`true`).
fn both_spike_sources(dir: &Path) -> [(Arc<DatasetIndex>, Arc<ClipIndex>); 2] {
    tiny(dir);
    synth::write_precomputed_voxels(dir, 8).unwrap();
    [false, true].map(|voxels| {
        let options = IndexOptions {
            spike_source: SpikeSource::from_flag(Some(voxels)),
            ..IndexOptions::default()
        };
        let index = DatasetIndex::open_folder(dir, "train", options).unwrap();
        let clips = ClipIndex::new(&index, ClipWindows::sliding(4));
        (Arc::new(index), Arc::new(clips))
    })
}

#[test]
fn two_loaders_reading_one_root_differently_never_share_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let [raw, vox] = both_spike_sources(dir.path());
    assert!(matches!(
        vox.0.sequences[0].storage,
        Storage::FolderVoxels { bins: 8 }
    ));
    assert_eq!(raw.0.sequences[0].storage, Storage::Folder);
    let (raw_key, vox_key) = (raw.0.record_key(0, 0), vox.0.record_key(0, 0));
    assert_ne!(raw_key, vox_key);
    assert!(raw_key.contains("/dat/train/") && vox_key.contains("/vox8/train/"));
    // Each one's first batch from disk alone.
    let first_from_disk = |data: &(Arc<DatasetIndex>, Arc<ClipIndex>)| {
        let mut alone = loader(data, sampler(&data.1), 1, None);
        epoch(&mut alone, 0).swap_remove(0)
    };
    let (raw_disk, vox_disk) = (first_from_disk(&raw), first_from_disk(&vox));
    // The two encodings give different voxels (f16 grids against the streams'
    // own voxelization): a record of one read as the other's would show.
    assert_ne!(raw_disk.samples, vox_disk.samples);
    let address = format!("vrtspike-test-two-sources-{}", std::process::id());
    let _server = spawn_server(ServerConfig::new(address.clone(), 64 << 20)).unwrap();
    // The grids' reader fills the cache first, then the streams' reader reads the
    // same frames through it; then the grids' reader again, from a warm cache.
    for (data, disk) in [(&vox, &vox_disk), (&raw, &raw_disk), (&vox, &vox_disk)] {
        let mut shared = loader(data, sampler(&data.1), 2, Some(&address));
        let first = epoch(&mut shared, 0).swap_remove(0);
        assert_eq!(
            first.samples, disk.samples,
            "a first batch through the cache"
        );
    }
    let client = CacheClient::connect(&address, "test").unwrap();
    let stats = client.stats().unwrap();
    assert_eq!(stats.totals.layout_mismatches, 0, "{stats:?}");
    // Every frame was read by both, each into a record of its own.
    assert_eq!(stats.records, 2 * raw.0.frame_count(), "{stats}");
}

#[test]
fn a_cached_record_of_another_layout_is_read_from_disk_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let [raw, vox] = both_spike_sources(dir.path());
    let mut alone = loader(&raw, sampler(&raw.1), 1, None);
    let from_disk = epoch(&mut alone, 0);
    let address = format!("vrtspike-test-foreign-layout-{}", std::process::id());
    let _server = spawn_server(ServerConfig::new(address.clone(), 64 << 20)).unwrap();
    // Every key the streams' reader uses holds the grids' record of that frame (as
    // a build that keyed records by their frame alone left them).
    let client = CacheClient::connect(&address, "planter").unwrap();
    let (raw_index, vox_index) = (&raw.0, &vox.0);
    for (s, seq) in raw_index.sequences.iter().enumerate() {
        for f in 0..seq.frames.len() {
            let len = vox_index.record_layout(s, f).byte_len();
            let planted = client.get_or_fill(&raw_index.record_key(s, f), len, |slot| {
                vox_index.encode_into(s, f, slot)
            });
            drop(planted.unwrap());
        }
    }
    let mut shared = loader(&raw, sampler(&raw.1), 2, Some(&address));
    let through_cache = epoch(&mut shared, 0);
    assert_same(&from_disk, &through_cache, "records of another layout");
    let read = shared.stats();
    drop(shared);
    assert_eq!((read.cache_hits, read.cache_misses), (0, 0), "{read:?}");
    assert!(read.cache_bypass > 0, "{read:?}");
    let stats = client.stats().unwrap();
    assert_eq!(
        stats.totals.layout_mismatches, read.cache_bypass,
        "every record read from disk was a mismatch, counted by the server"
    );
    assert!(
        stats
            .to_string()
            .contains(&format!("layout mismatches {}", read.cache_bypass)),
        "{stats}"
    );
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["totals"]["layout_mismatches"], read.cache_bypass);
}

#[test]
fn workers_the_server_has_no_connection_for_read_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let data = mixed(dir.path());
    let reference = epoch(&mut loader(&data, in_order(&data.1), 4, None), 0);
    // Three connections in all: the holder's, then two of the four workers'.
    let address = format!("vrtspike-test-loader-no-page-{}", std::process::id());
    let mut config = ServerConfig::new(address.clone(), 64 << 20);
    config.connections = 3;
    let _server = spawn_server(config).unwrap();
    let holder = CacheClient::connect(&address, "holder").unwrap();
    let mut cached = Loader::new(
        data.0.clone(),
        data.1.clone(),
        in_order(&data.1),
        options(4, Some(&address)),
    )
    .expect("a loader whose workers the server refused must still start");
    let got = epoch(&mut cached, 0);
    assert_same(&reference, &got, "workers without a connection");
    let server = holder.stats().unwrap();
    assert_eq!(server.clients.len(), 3, "two workers refused: {server}");
    let s = cached.stats();
    assert!(
        s.cache_misses > 0,
        "the connected workers read through the cache: {s:?}"
    );
}
