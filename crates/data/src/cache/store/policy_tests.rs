//! The planned policy against a brute-force Belady, and its fallbacks: stale read
//! orders, prefetches that would evict a record needed sooner, reads no read order
//! names.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::super::super::protocol::{ReadOrderAnnouncement, RequestError};
use super::super::arena::SlotUse;
use super::super::pace::Clock;
use super::super::{ClientLabel, GetOutcome, Store, SLOT_ALIGN};
use super::PrefetchOutcome;
use crate::util::rng::SplitMix64;

const P: u64 = SLOT_ALIGN;

/// A store of `records` one-page records, an announcer connection and a reader,
/// on a clock that moves only when a test moves it.
struct Rig {
    store: Store,
    announcer: u64,
    announcer_page: usize,
    reader: u64,
    clock: Arc<AtomicU64>,
}

impl Rig {
    fn new(records: u64) -> Rig {
        let mut store = Store::on_heap(1, records * P, Some(P));
        let (clock, handle) = Clock::manual();
        store.set_clock(clock);
        let (announcer, announcer_page) = store.connect("read order".into(), 1).unwrap();
        let reader = store.connect("reader".into(), 1).unwrap().0;
        Rig {
            store,
            announcer,
            announcer_page,
            reader,
            clock: handle,
        }
    }

    /// Announces `steps` (keys per step from `first_step`) with `readers`.
    fn announce(&mut self, announcer: u64, first_step: u64, steps: &[Vec<&str>], readers: &[u64]) {
        let mut keys: Vec<String> = Vec::new();
        let mut ids: HashMap<&str, u32> = HashMap::new();
        let steps = steps
            .iter()
            .map(|step| {
                step.iter()
                    .map(|&k| {
                        *ids.entry(k).or_insert_with(|| {
                            keys.push(k.to_string());
                            keys.len() as u32 - 1
                        })
                    })
                    .collect()
            })
            .collect();
        let order = ReadOrderAnnouncement {
            first_step,
            keys,
            steps,
            readers: readers.to_vec(),
        };
        self.store.announce_read_order(announcer, order).unwrap();
    }

    fn progress(&self, page: usize, step: u64) {
        self.store.pin_page(page).set_progress(step);
    }

    /// `client` reads `key`: true on a hit; a miss is filled and committed.
    fn read(&mut self, client: u64, key: &str) -> bool {
        let grant = match self.store.get(client, key).unwrap() {
            GetOutcome::Hit(grant) => {
                self.store.release(client, grant.lease).unwrap();
                return true;
            }
            GetOutcome::Miss(ticket) => {
                self.store.reserve(client, ticket, P).unwrap();
                self.store.commit(client, ticket).unwrap()
            }
            GetOutcome::Wait { .. } => panic!("no other filler"),
        };
        self.store.release(client, grant.lease).unwrap();
        false
    }

    /// `client` fills `key` (a miss expected).
    fn fill(&mut self, client: u64, key: &str) {
        assert!(!self.read(client, key), "{key} was cached");
    }

    /// The keys of the committed records.
    fn cached(&self) -> HashSet<String> {
        let ready = |(_, used, _): (_, &SlotUse, _)| match used {
            SlotUse::Ready { key, .. } => Some(key.clone()),
            _ => None,
        };
        self.store.arena.in_use().filter_map(ready).collect()
    }
}

/// What a brute-force Belady does on `stream` with room for `records`: per
/// access, a hit, or the key it evicted (`None`: there was room). The record
/// evicted is the one whose next use is farthest; among records never used again,
/// the least recently used.
fn brute_force_belady(stream: &[&str], records: usize) -> Vec<Result<(), Option<String>>> {
    let mut cached: Vec<&str> = Vec::new();
    let mut last_use: HashMap<&str, usize> = HashMap::new();
    let mut out = Vec::new();
    for (i, &key) in stream.iter().enumerate() {
        if cached.contains(&key) {
            out.push(Ok(()));
        } else if cached.len() < records {
            cached.push(key);
            out.push(Err(None));
        } else {
            let next_use = |k: &str| {
                (i + 1..stream.len())
                    .find(|&j| stream[j] == k)
                    .unwrap_or(usize::MAX)
            };
            let victim = *cached
                .iter()
                .max_by_key(|&&k| (next_use(k), std::cmp::Reverse(last_use[k])))
                .unwrap();
            cached.retain(|&k| k != victim);
            cached.push(key);
            out.push(Err(Some(victim.to_string())));
        }
        last_use.insert(key, i);
    }
    out
}

/// The store's outcome of each access: a hit, or the key the fill evicted.
fn store_outcomes(
    rig: &mut Rig,
    stream: &[&str],
    reader_of: impl Fn(usize) -> u64,
) -> Vec<Result<(), Option<String>>> {
    let mut out = Vec::new();
    for (i, &key) in stream.iter().enumerate() {
        rig.progress(rig.announcer_page, i as u64);
        let before = rig.cached();
        if rig.read(reader_of(i), key) {
            out.push(Ok(()));
            continue;
        }
        let gone: Vec<String> = before.difference(&rig.cached()).cloned().collect();
        assert!(gone.len() <= 1, "one record goes for one: {gone:?}");
        out.push(Err(gone.into_iter().next()));
    }
    out
}

/// A random stream over `keys` keys.
fn random_stream(seed: u64, len: usize, keys: u64) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| format!("k{}", rng.below(keys))).collect()
}

#[test]
fn eviction_follows_a_brute_force_belady_on_random_streams() {
    for seed in 0..200 {
        let records = 2 + seed % 4;
        let stream = random_stream(seed, 60, 3 + seed % 7);
        let stream: Vec<&str> = stream.iter().map(String::as_str).collect();
        let mut rig = Rig::new(records);
        let steps: Vec<Vec<&str>> = stream.iter().map(|&k| vec![k]).collect();
        let (announcer, reader) = (rig.announcer, rig.reader);
        rig.announce(announcer, 0, &steps, &[reader]);
        let got = store_outcomes(&mut rig, &stream, |_| reader);
        let want = brute_force_belady(&stream, records as usize);
        assert_eq!(
            got, want,
            "seed {seed}, {records} records, stream {stream:?}"
        );
    }
}

#[test]
fn eviction_follows_belady_over_two_lockstep_orders() {
    // Two readers with read orders of their own, taking turns (one even steps, the
    // other odd ones): the store's choice is Belady's on the merged stream.
    two_orders_in_turn_follow_belady(1000, 0);
}

#[test]
fn plans_of_two_jobs_at_different_steps_merge_by_distance_ahead() {
    // Two jobs on one node-shared server: job b is 1000 steps further into its run
    // than job a (its read order and progress count from there). The store compares
    // uses by how far ahead of each job's own progress they lie, so its choice is
    // still Belady's on the merged stream.
    two_orders_in_turn_follow_belady(5000, 1000);
}

/// Two announcers with a reader each take turns over 100 random streams (seeded
/// from `seed_base`), the second one's steps counted from `b_first_step`; the
/// store's outcomes are a brute-force Belady's on the merged stream.
fn two_orders_in_turn_follow_belady(seed_base: u64, b_first_step: u64) {
    for seed in 0..100 {
        let records = 3;
        let stream = random_stream(seed_base + seed, 50, 6);
        let stream: Vec<&str> = stream.iter().map(String::as_str).collect();
        let mut rig = Rig::new(records);
        let (announcer_b, page_b) = rig.store.connect("read order b".into(), 2).unwrap();
        let reader_b = rig.store.connect("reader b".into(), 2).unwrap().0;
        let turn = |parity: usize| -> Vec<Vec<&str>> {
            let mut steps = vec![Vec::new(); stream.len()];
            for (i, &key) in stream.iter().enumerate().filter(|(i, _)| i % 2 == parity) {
                steps[i].push(key);
            }
            steps
        };
        let (announcer_a, reader_a) = (rig.announcer, rig.reader);
        rig.announce(announcer_a, 0, &turn(0), &[reader_a]);
        rig.announce(announcer_b, b_first_step, &turn(1), &[reader_b]);
        let mut got = Vec::new();
        for (i, &key) in stream.iter().enumerate() {
            rig.progress(page_b, b_first_step + i as u64);
            let one = store_outcomes_from(&mut rig, i, key, [reader_a, reader_b][i % 2]);
            got.push(one);
        }
        let want = brute_force_belady(&stream, records as usize);
        assert_eq!(got, want, "seed {seed}, stream {stream:?}");
    }
}

/// One access of [`store_outcomes`] at step `i`.
fn store_outcomes_from(
    rig: &mut Rig,
    i: usize,
    key: &str,
    reader: u64,
) -> Result<(), Option<String>> {
    rig.progress(rig.announcer_page, i as u64);
    let before = rig.cached();
    if rig.read(reader, key) {
        return Ok(());
    }
    let gone: Vec<String> = before.difference(&rig.cached()).cloned().collect();
    Err(gone.into_iter().next())
}

#[test]
fn overlapping_clips_in_shuffled_order_follow_belady() {
    // The sampler's pattern: clips of 3 overlapping frames of 4 sequences of 8,
    // shuffled, two epochs, a cap of a sixth of the frames; the read order names each
    // frame read at a step of its own (so no two uses tie).
    let mut clips: Vec<(usize, usize)> = (0..4).flat_map(|s| (0..6).map(move |f| (s, f))).collect();
    let mut rng = SplitMix64::new(7);
    let mut steps: Vec<Vec<String>> = Vec::new();
    for _epoch in 0..2 {
        for i in (1..clips.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            clips.swap(i, j);
        }
        for &(s, f) in &clips {
            steps.push((f..f + 3).map(|g| format!("seq{s}/{g:03}")).collect());
        }
    }
    let records = 32 / 6;
    let mut rig = Rig::new(records);
    let stream: Vec<&str> = steps.iter().flatten().map(String::as_str).collect();
    let by_step: Vec<Vec<&str>> = stream.iter().map(|&k| vec![k]).collect();
    let (announcer, reader) = (rig.announcer, rig.reader);
    rig.announce(announcer, 0, &by_step, &[reader]);
    let got = store_outcomes(&mut rig, &stream, |_| reader);
    let hits = got.iter().filter(|o| o.is_ok()).count();
    assert_eq!(got, brute_force_belady(&stream, records as usize));
    assert!(hits > stream.len() / 4, "{hits} hits of {}", stream.len());
}

#[test]
fn a_read_order_that_goes_stale_leaves_lru() {
    // Room for 3. Filled c, b, a: c is the least recently used, but the read order
    // needs c and b soon and a never.
    let mut rig = Rig::new(3);
    let (announcer, reader) = (rig.announcer, rig.reader);
    for key in ["c", "b", "a"] {
        rig.fill(reader, key);
    }
    let order = vec![vec!["d"], vec!["c"], vec!["b"], vec!["e"]];
    rig.announce(announcer, 10, &order, &[reader]);
    rig.progress(rig.announcer_page, 10);
    rig.fill(reader, "d");
    assert!(
        !rig.cached().contains("a"),
        "planned: a, never needed, went"
    );
    // The read order's reader moves past its last step (a new epoch nobody announced):
    // every record is unneeded and the least recently used goes.
    rig.progress(rig.announcer_page, 14);
    rig.fill(reader, "x");
    assert!(
        !rig.cached().contains("c"),
        "past the read order: LRU, c went"
    );
    // A new read order (the next epoch's) replaces the old; then the rank restarts: its
    // connection ends, its read order goes with it, and eviction is LRU again.
    rig.announce(announcer, 14, &[vec!["b"], vec!["d"]], &[reader]);
    rig.progress(rig.announcer_page, 14);
    rig.fill(reader, "y");
    assert_eq!(
        rig.cached(),
        HashSet::from(["b".into(), "d".into(), "y".into()]),
        "planned: x, unneeded, went"
    );
    rig.store.disconnect(announcer);
    rig.store.forget(announcer);
    rig.fill(reader, "z");
    assert!(!rig.cached().contains("b"), "no read order: LRU, b went");
    assert_eq!(rig.store.stats(0).read_orders.live, 0);
}

#[test]
fn a_prefetch_never_evicts_a_record_needed_sooner() {
    let mut rig = Rig::new(2);
    let (announcer, reader) = (rig.announcer, rig.reader);
    let order = vec![vec!["a"], vec!["c"], vec!["b"], vec!["d"]];
    rig.announce(announcer, 1, &order, &[reader]);
    rig.progress(rig.announcer_page, 0);
    // Filled by a connection that reads for no read order: no use is used up.
    rig.fill(announcer, "a");
    rig.fill(announcer, "b");
    // c (needed at 2) may push out b (needed at 3).
    let prefetch = |rig: &mut Rig, key: &str| rig.store.prefetch(announcer, key, P).unwrap();
    let PrefetchOutcome::Reserved { ticket, .. } = prefetch(&mut rig, "c") else {
        panic!("expected room for c");
    };
    let grant = rig.store.commit(announcer, ticket).unwrap();
    rig.store.release(announcer, grant.lease).unwrap();
    assert_eq!(rig.cached(), HashSet::from(["a".into(), "c".into()]));
    // d (needed at 4) would push out a or c, both needed sooner: declined, and the
    // store is as it was.
    assert_eq!(prefetch(&mut rig, "d"), PrefetchOutcome::Declined);
    assert_eq!(prefetch(&mut rig, "c"), PrefetchOutcome::Present);
    assert_eq!(
        prefetch(&mut rig, "nobody-needs-it"),
        PrefetchOutcome::Declined
    );
    assert_eq!(rig.cached(), HashSet::from(["a".into(), "c".into()]));
    // The prefetcher's own commit used up no use: the reader's read of c is a hit
    // and uses it up.
    rig.progress(rig.announcer_page, 2);
    assert!(rig.read(reader, "c"));
    // Now a and c are needed no more: d may push one of them out.
    assert!(matches!(
        prefetch(&mut rig, "d"),
        PrefetchOutcome::Reserved { .. }
    ));
    let s = rig.store.stats(0).read_orders;
    assert_eq!((s.prefetched, s.prefetch_declined), (2, 2));
}

#[test]
fn an_unannounced_read_evicts_only_records_no_read_order_needs() {
    let mut rig = Rig::new(2);
    let (announcer, reader) = (rig.announcer, rig.reader);
    rig.announce(announcer, 0, &[vec!["a"], vec!["b"]], &[]);
    rig.fill(reader, "a");
    rig.fill(reader, "b");
    // Validation reads v: a and b are both needed, so v gets no room.
    let GetOutcome::Miss(ticket) = rig.store.get(reader, "v").unwrap() else {
        panic!("expected a miss");
    };
    let err = rig.store.reserve(reader, ticket, P).unwrap_err();
    assert!(
        matches!(err, RequestError::Declined { ref key } if key == "v"),
        "{err:?}"
    );
    rig.store.abort(reader, ticket).unwrap();
    assert_eq!(rig.cached(), HashSet::from(["a".into(), "b".into()]));
    // Past a's step, a is needed no more: v takes its room.
    rig.progress(rig.announcer_page, 1);
    rig.fill(reader, "v");
    assert_eq!(rig.cached(), HashSet::from(["b".into(), "v".into()]));
    assert_eq!(rig.store.stats(0).read_orders.unannounced_declined, 1);
}

#[test]
fn reads_learnt_after_the_reader_moved_on_use_up_their_own_step() {
    // Hits taken in shared memory reach the store only at the next eviction, when
    // the reader's progress has moved past them: each must use up the use of its
    // own step, not one to come. Clips of 3 frames of 8 sequences of 12 in a
    // shuffled order, 3 epochs, each announced with the next (if any) at its
    // start, a read a step; the store's choices are a brute-force Belady's.
    let clips: Vec<(usize, usize)> = (0..8).flat_map(|s| (0..10).map(move |f| (s, f))).collect();
    let order_of = |epoch: u64| {
        let mut order: Vec<(usize, usize)> = clips.clone();
        let mut rng = SplitMix64::from_parts(&[3, epoch]);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        order
            .into_iter()
            .flat_map(|(s, f)| (f..f + 3).map(move |g| format!("seq{s}/{g:03}")))
            .collect::<Vec<String>>()
    };
    let per_epoch = clips.len() as u64 * 3;
    let records = 10;
    let mut rig = Rig::new(records);
    let reader_page = 1;
    assert_eq!(
        rig.store.connections.get(rig.reader).unwrap().page,
        reader_page
    );
    let (announcer, reader) = (rig.announcer, rig.reader);
    let mut stream = Vec::new();
    let mut got = Vec::new();
    for epoch in 0..3 {
        let this = order_of(epoch);
        let next = if epoch < 2 {
            order_of(epoch + 1)
        } else {
            Vec::new()
        };
        let steps: Vec<Vec<&str>> = this.iter().chain(&next).map(|k| vec![k.as_str()]).collect();
        rig.announce(announcer, epoch * per_epoch, &steps, &[reader]);
        for (i, key) in this.iter().enumerate() {
            rig.progress(rig.announcer_page, epoch * per_epoch + i as u64);
            let before = rig.cached();
            if before.contains(key) {
                // A hit in shared memory: recorded in the reader's page only.
                let slot = rig.store.index.get(key).unwrap();
                rig.store.pin_page(reader_page).record_read(slot);
                got.push(Ok(()));
            } else {
                rig.fill(reader, key);
                let gone: Vec<String> = before.difference(&rig.cached()).cloned().collect();
                got.push(Err(gone.into_iter().next()));
            }
            stream.push(key.clone());
        }
    }
    let stream: Vec<&str> = stream.iter().map(String::as_str).collect();
    let want = brute_force_belady(&stream, records as usize);
    let first_difference = got.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(first_difference, None, "got {got:?}, want {want:?}");
    assert!(got.iter().filter(|o| o.is_ok()).count() > stream.len() / 4);
}

/// Hits of a brute-force Belady on `stream` with room for `records`.
fn belady_hits(stream: &[&str], records: usize) -> usize {
    let outcomes = brute_force_belady(stream, records);
    outcomes.iter().filter(|o| o.is_ok()).count()
}

/// `len` steps of epochs of `keys` keys, each epoch a fresh shuffle of its own.
fn shuffled_epochs(seed: u64, keys: usize, len: usize) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(len);
    let mut order: Vec<usize> = (0..keys).collect();
    while out.len() < len {
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        out.extend(order.iter().map(|k| format!("k{k}")));
    }
    out.truncate(len);
    out
}

/// Two jobs read one dataset at 1 and 3 steps a second for `seconds`, each in a
/// shuffled order of its own announced whole; returns the store's hits and
/// Belady's on the merged, time-ordered stream.
fn two_jobs_at_rates(seconds: usize, keys: usize, records: u64) -> (usize, usize) {
    let mut rig = Rig::new(records);
    let connect = |store: &mut Store, name: &str, job: &str| {
        let label = ClientLabel {
            name: name.into(),
            job: job.into(),
            pid: 1,
            uid: 0,
        };
        store.connect_as(label).unwrap()
    };
    let (slow, slow_page) = connect(&mut rig.store, "slow order", "slow");
    let slow_reader = connect(&mut rig.store, "slow reader", "slow").0;
    let (fast, fast_page) = connect(&mut rig.store, "fast order", "fast");
    let fast_reader = connect(&mut rig.store, "fast reader", "fast").0;
    let slow_keys = shuffled_epochs(1, keys, seconds);
    let fast_keys = shuffled_epochs(2, keys, 3 * seconds);
    rig.announce(slow, 0, &by_step(&slow_keys), &[slow_reader]);
    rig.announce(fast, 0, &by_step(&fast_keys), &[fast_reader]);
    fn by_step(keys: &[String]) -> Vec<Vec<&str>> {
        keys.iter().map(|k| vec![k.as_str()]).collect()
    }
    let mut merged: Vec<&str> = Vec::new();
    let mut hits = 0;
    for third in 0..3 * seconds {
        rig.clock
            .store(third as u64 * 1_000_000 / 3, Ordering::Relaxed);
        // The slow job's step at whole seconds, then the fast job's.
        let mut reads = Vec::new();
        if third % 3 == 0 {
            reads.push((
                slow_page,
                slow_reader,
                third / 3,
                slow_keys[third / 3].as_str(),
            ));
        }
        reads.push((fast_page, fast_reader, third, fast_keys[third].as_str()));
        for (page, reader, step, key) in reads {
            rig.progress(page, step as u64);
            hits += usize::from(rig.read(reader, key));
            merged.push(key);
        }
    }
    (hits, belady_hits(&merged, records as usize))
}

#[test]
fn two_jobs_at_different_rates_merge_by_time_near_belady() {
    // 40 records, room for 12; the slow job reads 1 step a second, the fast one 3.
    let (hits, belady) = two_jobs_at_rates(240, 40, 12);
    eprintln!("two jobs at 1 and 3 steps a second: {hits} hits, Belady {belady}");
    assert!(
        hits as f64 >= 0.95 * belady as f64,
        "{hits} hits, Belady {belady} on the merged stream"
    );
}

#[test]
fn a_read_order_naming_another_jobs_reader_is_refused() {
    let mut rig = Rig::new(4);
    let label = |job: &str| ClientLabel {
        name: "other".into(),
        job: job.into(),
        pid: 2,
        uid: 0,
    };
    let (mine, _) = rig.store.connect_as(label("mine")).unwrap();
    let (theirs, _) = rig.store.connect_as(label("theirs")).unwrap();
    let (my_reader, _) = rig.store.connect_as(label("mine")).unwrap();
    let order = |readers: Vec<u64>| ReadOrderAnnouncement {
        first_step: 0,
        keys: vec!["a".into()],
        steps: vec![vec![0]],
        readers,
    };
    let err = rig
        .store
        .announce_read_order(mine, order(vec![my_reader, theirs]))
        .unwrap_err();
    assert!(err.to_string().contains("is of job \"theirs\""), "{err}");
    // Its own reader, and one that has gone (left out), are fine.
    rig.store
        .announce_read_order(mine, order(vec![my_reader, 999]))
        .unwrap();
    assert_eq!(rig.store.read_orders.len(), 1);
}
