//! The read orders' bookkeeping on its own: next uses over several read orders,
//! reads that use them up, paces of jobs, limits and the budget, and the
//! incremental next uses against a recomputation from scratch.

use std::collections::HashMap;

use super::super::super::table::MAX_KEY_BYTES;
use super::*;
use crate::util::rng::SplitMix64;

const SECOND: Micros = 1_000_000;

fn order(
    first_step: u64,
    keys: &[&str],
    steps: &[&[u32]],
    readers: &[ClientId],
) -> ReadOrderAnnouncement {
    ReadOrderAnnouncement {
        first_step,
        keys: keys.iter().map(|k| k.to_string()).collect(),
        steps: steps.iter().map(|s| s.to_vec()).collect(),
        readers: readers.to_vec(),
    }
}

fn announcer(client: ClientId, page: usize, job: &str) -> Announcer {
    Announcer {
        client,
        page,
        job: job.to_string(),
    }
}

fn nothing_cached(_: &str) -> Option<SlotIdx> {
    None
}

/// At the default rate (no rate known), a use `d` steps ahead is `d` seconds ahead.
fn needed_in(now: Micros, steps: u64) -> Standing {
    Standing::Needed {
        at: now + steps * SECOND,
    }
}

#[test]
fn the_nearest_use_over_orders_counts_and_reads_use_up_the_earliest() {
    let mut orders = ReadOrders::default();
    let mut index = EvictionIndex::default();
    // Read order of connection 1 (page 0): a at 10 and 13, b at 11; connection 2's
    // (page 1): b at 100.
    let one = order(10, &["a", "b"], &[&[0], &[1], &[], &[0]], &[5]);
    orders
        .announce(announcer(1, 0, ""), one, 10, 0, &nothing_cached, &mut index)
        .unwrap();
    let two = order(100, &["b"], &[&[0]], &[]);
    orders
        .announce(announcer(2, 1, ""), two, 99, 0, &nothing_cached, &mut index)
        .unwrap();
    let progress = |now: [u64; 2]| move |page: usize| now[page];
    orders.refresh(progress([10, 99]), 0, &mut index);
    assert_eq!(orders.standing("a"), needed_in(0, 0));
    assert_eq!(orders.standing("b"), needed_in(0, 1));
    assert_eq!(orders.standing("c"), Standing::Unneeded);
    orders.refresh(progress([12, 99]), 0, &mut index);
    assert_eq!(orders.standing("a"), needed_in(0, 1));
    assert_eq!(orders.standing("b"), needed_in(0, 1), "order 2's");
    // Reader 5's read of a at step 10, learnt only now: it uses up step 10's
    // use, not step 13's.
    orders.read(5, "a", &mut index);
    assert_eq!(orders.standing("a"), needed_in(0, 1));
    orders.read(5, "a", &mut index);
    assert_eq!(orders.standing("a"), Standing::Unneeded);
    // A read by a connection that reads for no read order changes nothing.
    orders.read(9, "b", &mut index);
    assert_eq!(orders.standing("b"), needed_in(0, 1));
    orders.forget(2, &mut index);
    assert_eq!(
        orders.standing("b"),
        Standing::Unneeded,
        "order 1's use at 11 is past"
    );
    assert_eq!(orders.len(), 1);
    assert_eq!(orders.pending_uses(), 1, "b's past use, within the grace");
    // Far past, a read drops it instead of using it up.
    orders.refresh(progress([12 + GRACE, 0]), 0, &mut index);
    orders.read(5, "b", &mut index);
    assert_eq!(orders.pending_uses(), 0);
}

#[test]
fn a_bad_read_order_is_refused_and_the_old_one_stays() {
    let mut orders = ReadOrders::default();
    let mut index = EvictionIndex::default();
    let mut announce = |orders: &mut ReadOrders, o| {
        orders.announce(announcer(1, 0, ""), o, 0, 0, &nothing_cached, &mut index)
    };
    announce(&mut orders, order(0, &["a"], &[&[0]], &[])).unwrap();
    let err = announce(&mut orders, order(7, &["a"], &[&[0, 1]], &[])).unwrap_err();
    assert!(
        err.to_string()
            .contains("step 7 names key 1 of a list of 1"),
        "{err}"
    );
    let long = "k".repeat(MAX_KEY_BYTES + 1);
    let err = announce(&mut orders, order(0, &[&long], &[&[0]], &[])).unwrap_err();
    assert!(err.to_string().contains("at most"), "{err}");
    let err = announce(&mut orders, order(0, &["x", "x"], &[&[0]], &[])).unwrap_err();
    assert!(err.to_string().contains("\"x\" is listed twice"), "{err}");
    assert_eq!(orders.standing("a"), needed_in(0, 0));
}

#[test]
fn the_budget_refuses_a_read_order_that_would_pass_it_and_counts_what_they_hold() {
    let mut orders = ReadOrders::default();
    let mut index = EvictionIndex::default();
    let keys: Vec<String> = (0..1000).map(|i| format!("seq/{i:05}")).collect();
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    let steps: Vec<Vec<u32>> = (0..1000u32).map(|i| vec![i]).collect();
    let steps: Vec<&[u32]> = steps.iter().map(Vec::as_slice).collect();
    let big = order(0, &names, &steps, &[]);
    orders
        .announce(
            announcer(1, 0, "j"),
            big.clone(),
            0,
            0,
            &nothing_cached,
            &mut index,
        )
        .unwrap();
    let one = orders.bytes();
    // Uses, names and per-record entries: about 100 bytes a record here.
    assert!((90_000..130_000).contains(&one), "{one} bytes");
    // A second read order of the same records shares their entries: it costs
    // about a third of the first.
    orders.set_budget(one * 5 / 4);
    let err = orders
        .announce(
            announcer(2, 1, "j"),
            big.clone(),
            0,
            0,
            &nothing_cached,
            &mut index,
        )
        .unwrap_err();
    assert!(err.to_string().contains("--read-order-budget"), "{err}");
    assert_eq!(orders.len(), 1);
    // Replacing its own read order counts what it replaces.
    orders
        .announce(
            announcer(1, 0, "j"),
            big.clone(),
            0,
            0,
            &nothing_cached,
            &mut index,
        )
        .unwrap();
    assert_eq!(orders.bytes(), one);
    orders.set_budget(one * 3 / 2);
    orders
        .announce(announcer(2, 1, "j"), big, 0, 0, &nothing_cached, &mut index)
        .unwrap();
    let two = orders.bytes();
    assert!(two - one < one / 2, "{one} then {two}");
    let stats = orders.stats();
    assert_eq!((stats.bytes, stats.budget_bytes), (two, one * 3 / 2));
    orders.forget(2, &mut index);
    orders.forget(1, &mut index);
    assert_eq!(
        orders.bytes(),
        0,
        "the records' entries go with the last read order"
    );
}

#[test]
fn a_reader_moved_to_another_read_order_reads_for_that_one() {
    let mut orders = ReadOrders::default();
    let mut index = EvictionIndex::default();
    orders
        .announce(
            announcer(1, 0, ""),
            order(0, &["a"], &[&[0]], &[7]),
            0,
            0,
            &nothing_cached,
            &mut index,
        )
        .unwrap();
    let two = order(0, &["a"], &[&[], &[0]], &[7]);
    orders
        .announce(announcer(2, 1, ""), two, 0, 0, &nothing_cached, &mut index)
        .unwrap();
    orders.read(7, "a", &mut index);
    // Order 2's use went; order 1's stays.
    assert_eq!(orders.standing("a"), needed_in(0, 0));
    orders.forget(1, &mut index);
    assert_eq!(orders.standing("a"), Standing::Unneeded);
    orders.forget(7, &mut index);
    orders.forget(2, &mut index);
    assert!(orders.is_empty());
}

#[test]
fn jobs_at_different_rates_compare_by_time() {
    let mut orders = ReadOrders::default();
    let mut index = EvictionIndex::default();
    // Job "slow" reads "s<i>" at step i, job "fast" "f<i>" at step i.
    let keys = |p: &str| (0..400).map(|i| format!("{p}{i}")).collect::<Vec<_>>();
    let (slow, fast) = (keys("s"), keys("f"));
    let steps: Vec<Vec<u32>> = (0..400u32).map(|i| vec![i]).collect();
    let steps: Vec<&[u32]> = steps.iter().map(Vec::as_slice).collect();
    let names = |k: &[String]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let announce =
        |orders: &mut ReadOrders, index: &mut EvictionIndex, who, page, job, k: &[String]| {
            let o = ReadOrderAnnouncement {
                first_step: 0,
                keys: names(k),
                steps: steps.iter().map(|s| s.to_vec()).collect(),
                readers: vec![],
            };
            orders
                .announce(announcer(who, page, job), o, 0, 0, &nothing_cached, index)
                .unwrap();
        };
    announce(&mut orders, &mut index, 1, 0, "slow", &slow);
    announce(&mut orders, &mut index, 2, 1, "fast", &fast);
    // Ten seconds: the slow job takes 1 step a second, the fast one 3.
    for tenth in 0..=100u64 {
        let now = tenth * SECOND / 10;
        let progress = [tenth / 10, 3 * tenth / 10];
        orders.refresh(move |page| progress[page], now, &mut index);
    }
    let at = |key: &str| match orders.standing(key) {
        Standing::Needed { at } => at,
        Standing::Unneeded => panic!("{key} unneeded"),
    };
    // 20 steps ahead of the slow job is 20 s away; 45 ahead of the fast one 15 s.
    let (slow_20, fast_45) = (at("s30"), at("f75"));
    assert!(fast_45 < slow_20, "{fast_45} vs {slow_20}");
    assert!(
        (slow_20 as i64 - 30 * SECOND as i64).abs() < SECOND as i64 / 2,
        "{slow_20}"
    );
    assert!(
        (fast_45 as i64 - 25 * SECOND as i64).abs() < SECOND as i64 / 2,
        "{fast_45}"
    );
}

/// One use of a record not used up yet in a model read order.
#[derive(Debug, Clone)]
struct ModelOrder {
    page: usize,
    /// Steps of each record, ascending.
    uses: HashMap<String, Vec<u64>>,
    readers: Vec<ClientId>,
    now: u64,
}

impl ModelOrder {
    fn consume(&mut self, key: &str) {
        let horizon = self.now.saturating_sub(GRACE);
        if let Some(steps) = self.uses.get_mut(key) {
            steps.retain(|&s| s >= horizon);
            if !steps.is_empty() {
                steps.remove(0);
            }
        }
    }

    fn next_use(&self, key: &str) -> Option<u64> {
        let steps = self.uses.get(key)?;
        steps.iter().copied().find(|&s| s >= self.now)
    }
}

#[test]
fn next_uses_follow_a_recomputation_from_scratch_on_random_changes() {
    let mut rng = SplitMix64::new(11);
    let mut orders = ReadOrders::default();
    let mut index = EvictionIndex::default();
    let mut model: HashMap<ClientId, ModelOrder> = HashMap::new();
    let mut cached: HashMap<String, SlotIdx> = HashMap::new();
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    let mut progress = [0u64; 4];
    for round in 0..3000 {
        match rng.below(10) {
            0 => {
                // Connection 1..=4 announces: pages 0..4, readers 11..=14.
                let who = 1 + rng.below(4);
                let page = (who - 1) as usize;
                let first_step = progress[page].saturating_sub(rng.below(3));
                let names: Vec<&str> = keys.iter().map(String::as_str).collect();
                let steps: Vec<Vec<u32>> = (0..40)
                    .map(|_| (0..rng.below(3)).map(|_| rng.below(30) as u32).collect())
                    .collect();
                let steps_ref: Vec<&[u32]> = steps.iter().map(Vec::as_slice).collect();
                let o = order(first_step, &names, &steps_ref, &[10 + who]);
                let lookup = |k: &str| cached.get(k).copied();
                orders
                    .announce(
                        announcer(who, page, ""),
                        o.clone(),
                        progress[page],
                        0,
                        &lookup,
                        &mut index,
                    )
                    .unwrap();
                let mut uses: HashMap<String, Vec<u64>> = HashMap::new();
                for (i, step) in o.steps.iter().enumerate() {
                    for &k in step {
                        let list = uses.entry(keys[k as usize].clone()).or_default();
                        if list.last() != Some(&(first_step + i as u64)) {
                            list.push(first_step + i as u64);
                        }
                    }
                }
                for m in model.values_mut() {
                    m.readers.retain(|&r| r != 10 + who);
                }
                model.insert(
                    who,
                    ModelOrder {
                        page,
                        uses,
                        readers: vec![10 + who],
                        now: progress[page],
                    },
                );
            }
            1 | 2 => {
                let page = rng.below(4) as usize;
                progress[page] += rng.below(3);
                if rng.below(20) == 0 {
                    progress[page] = progress[page].saturating_sub(5);
                }
                orders.refresh(|p| progress[p], 0, &mut index);
                for m in model.values_mut() {
                    m.now = progress[m.page];
                }
            }
            3..=5 => {
                let reader = 11 + rng.below(4);
                let key = &keys[rng.below(30) as usize];
                orders.read(reader, key, &mut index);
                if let Some(m) = model.values_mut().find(|m| m.readers.contains(&reader)) {
                    m.consume(key);
                }
            }
            6 => {
                let key = keys[rng.below(30) as usize].clone();
                if !cached.contains_key(&key) {
                    let slot = (0..30).find(|s| !cached.values().any(|v| v == s)).unwrap();
                    let next = orders.cached(&key, slot);
                    index.enter(slot, 4096, next);
                    cached.insert(key, slot);
                }
            }
            7 => {
                let key = keys[rng.below(30) as usize].clone();
                if let Some(slot) = cached.remove(&key) {
                    index.remove(slot);
                    orders.uncached(slot);
                }
            }
            8 => {
                let who = 1 + rng.below(4);
                orders.forget(who, &mut index);
                model.remove(&who);
            }
            _ => {}
        }
        // Every record's standing, and every cached one's place in the index.
        for key in &keys {
            let distance = model
                .values()
                .filter_map(|m| m.next_use(key).map(|s| s - m.now))
                .min();
            let expected = match distance {
                Some(d) => {
                    // The unknown rates follow every step: the nearest use is d
                    // seconds from the reader that makes it.
                    Standing::Needed { at: d * SECOND }
                }
                None => Standing::Unneeded,
            };
            let got = orders.standing(key);
            let rel = |s: Standing| match s {
                Standing::Needed { at } => Some(at),
                Standing::Unneeded => None,
            };
            // The paces are anchored at each reader's progress at time 0.
            let got_steps = rel(got).map(|at| at / SECOND);
            assert_eq!(
                got_steps,
                rel(expected).map(|at| at / SECOND),
                "round {round}, {key}"
            );
            if let Some(&slot) = cached.get(key) {
                assert_eq!(
                    index.next_use(slot),
                    Some(rel(got)),
                    "round {round}, {key} in the index"
                );
            }
        }
    }
}
