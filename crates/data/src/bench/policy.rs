//! `vrtspike bench loader --policy-table`: one recorded access stream (the ranks'
//! sampler orders over the epochs, in lockstep) read by the loader under LRU and
//! under the planned policy at caps of a share of the dataset's compact size, with
//! the bound no online policy beats beside them: Belady's offline policy, computed
//! here from the stream (on a miss, evict the record whose next use is farthest;
//! keep the new one only if it is needed sooner than that). Hit rates and the bytes
//! read from disk count the epochs after the first (the cache warm).

use std::collections::{BTreeSet, HashMap, VecDeque};

use serde::Serialize;

use crate::cache::protocol::ReadOrderAnnouncement;
use crate::cache::store::pace::Clock;
use crate::cache::store::{extent_for, ClientLabel, GetOutcome, Store};
use crate::cache::RequestError;
use crate::config::CachePolicy;
use crate::dataset::{DatasetIndex, IndexOptions};
use crate::pipeline::sample::{ClipIndex, ClipWindows};

use super::loader::{self, shuffled, LoaderBenchError, LoaderWorkerOptions};
use crate::pipeline::sampler::DistributedSampler;

/// The records of a stream: what each takes of the cap (whole pages, as the store
/// places it) and what reading it from disk decodes.
#[derive(Debug, Clone, Default)]
struct Records {
    /// Bytes of the cap.
    extents: Vec<u64>,
    /// Bytes of the record.
    lens: Vec<u64>,
    /// The number of each (sequence, frame) seen.
    ids: HashMap<(usize, usize), usize>,
}

impl Records {
    /// The number of frame `frame` of sequence `seq`, a new one the first time.
    fn number(&mut self, index: &DatasetIndex, seq: usize, frame: usize) -> usize {
        *self.ids.entry((seq, frame)).or_insert_with(|| {
            let len = index.record_layout(seq, frame).byte_len() as u64;
            self.extents.push(extent_for(len).unwrap_or(len));
            self.lens.push(len);
            self.lens.len() - 1
        })
    }
}

/// One read of the recorded stream.
#[derive(Debug, Clone, Copy)]
struct Access {
    /// The record (an index into the sizes).
    record: usize,
    /// Whether it counts (an epoch after the first).
    counted: bool,
}

/// A policy's figures over the counted reads.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PolicyFigures {
    /// hits / reads.
    pub hit_rate: f64,
    /// Bytes read from disk (misses, bypasses and prefetches).
    pub disk_bytes: u64,
}

/// One row: a cap and a rank count.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    /// Ranks (loader processes, in lockstep).
    pub ranks: usize,
    /// The cap as a percentage of the dataset's compact size.
    pub cap_percent: f64,
    /// The cap in bytes.
    pub cap_bytes: u64,
    /// The loader under LRU.
    pub lru: PolicyFigures,
    /// The loader under the planned policy (no prefetch).
    pub planned: PolicyFigures,
    /// Belady's offline policy on the recorded stream.
    pub belady: PolicyFigures,
    /// LRU simulated on the recorded stream (what the live LRU should be near).
    pub lru_simulated: PolicyFigures,
}

/// The table.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyTable {
    /// `"vrtspike-loader-policy"`.
    pub bench: &'static str,
    /// Records of the split.
    pub records: usize,
    /// Their compact size, bytes.
    pub dataset_bytes: u64,
    /// Epochs run (the first fills the cache and is not counted).
    pub epochs: u64,
    /// Frames per clip.
    pub clip: usize,
    /// Loader threads per rank.
    pub workers_per_rank: usize,
    /// The rows.
    pub rows: Vec<PolicyRow>,
    /// Two jobs on the dataset at 1 and 3 steps a second, one cache, at each cap.
    pub two_jobs: Vec<TwoJobsRow>,
}

/// Two jobs at different step rates sharing one cache: the store (driven on a
/// simulated clock, in this process) against LRU and Belady's bound on the
/// jobs' merged, time-ordered stream.
#[derive(Debug, Clone, Serialize)]
pub struct TwoJobsRow {
    /// The cap as a percentage of the dataset's compact size.
    pub cap_percent: f64,
    /// Steps a second of each job.
    pub rates: [f64; 2],
    /// LRU on the merged stream.
    pub lru: PolicyFigures,
    /// The store's planned policy.
    pub planned: PolicyFigures,
    /// Belady's offline policy on the merged stream.
    pub belady: PolicyFigures,
}

/// The ranks' reads over the epochs as training reads them: position by position,
/// rank after rank, each clip's frames in order.
fn recorded_stream(
    index: &DatasetIndex,
    clips: &ClipIndex,
    template: &LoaderWorkerOptions,
    ranks: usize,
) -> Result<(Vec<Access>, Records), LoaderBenchError> {
    let mut records = Records::default();
    let samplers = (0..ranks)
        .map(|rank| {
            DistributedSampler::new(clips.clips.len(), shuffled(ranks, rank, template.seed))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut stream = Vec::new();
    for epoch in 0..template.epochs {
        let orders: Vec<Vec<usize>> = samplers.iter().map(|s| s.epoch_indices(epoch)).collect();
        let per_rank = orders.first().map_or(0, Vec::len);
        let read = per_rank - per_rank % template.batch.max(1);
        for position in 0..read {
            for order in &orders {
                let clip = clips.clips[order[position]];
                for frame in clip.start..clip.start + clips.len {
                    stream.push(Access {
                        record: records.number(index, clip.seq, frame),
                        counted: epoch > 0 || template.epochs == 1,
                    });
                }
            }
        }
    }
    Ok((stream, records))
}

/// Tallies a simulated policy's counted reads.
#[derive(Default)]
struct Tally {
    hits: u64,
    reads: u64,
    disk_bytes: u64,
}

impl Tally {
    fn read(&mut self, access: Access, hit: bool, bytes: u64) {
        if access.counted {
            self.reads += 1;
            self.hits += u64::from(hit);
            self.disk_bytes += if hit { 0 } else { bytes };
        }
    }

    fn figures(&self) -> PolicyFigures {
        PolicyFigures {
            hit_rate: self.hits as f64 / self.reads.max(1) as f64,
            disk_bytes: self.disk_bytes,
        }
    }
}

/// LRU over `cap` bytes.
fn simulate_lru(stream: &[Access], records: &Records, cap: u64) -> PolicyFigures {
    let sizes = &records.extents;
    let mut tally = Tally::default();
    let mut last_use = vec![None; sizes.len()];
    let mut order = BTreeSet::new();
    let mut used = 0;
    for (time, &access) in stream.iter().enumerate() {
        let size = sizes[access.record];
        let hit = match last_use[access.record] {
            Some(t) => {
                order.remove(&(t, access.record));
                true
            }
            None => {
                while used + size > cap {
                    let Some((_, victim)) = order.pop_first() else {
                        break;
                    };
                    last_use[victim] = None;
                    used -= sizes[victim];
                }
                used += size;
                false
            }
        };
        tally.read(access, hit, records.lens[access.record]);
        if used <= cap {
            last_use[access.record] = Some(time);
            order.insert((time, access.record));
        } else {
            used -= size;
        }
    }
    tally.figures()
}

/// Belady's offline policy over `cap` bytes: on a miss, the records whose next use
/// is farthest go until the new one fits, unless the new one is needed later than
/// all of them (then it is read past the cache).
fn simulate_belady(stream: &[Access], records: &Records, cap: u64) -> PolicyFigures {
    let sizes = &records.extents;
    let never = usize::MAX;
    let mut uses: Vec<VecDeque<usize>> = vec![VecDeque::new(); sizes.len()];
    for (time, access) in stream.iter().enumerate() {
        uses[access.record].push_back(time);
    }
    let mut tally = Tally::default();
    // (next use, record) of every cached record.
    let mut cached: BTreeSet<(usize, usize)> = BTreeSet::new();
    let mut next_of = vec![None; sizes.len()];
    let mut used = 0;
    for &access in stream {
        let record = access.record;
        uses[record].pop_front();
        let next = uses[record].front().copied().unwrap_or(never);
        let size = sizes[record];
        let len = records.lens[record];
        if let Some(old) = next_of[record].take() {
            cached.remove(&(old, record));
            tally.read(access, true, len);
        } else {
            tally.read(access, false, len);
            let mut keep = size <= cap;
            while keep && used + size > cap {
                match cached.last().copied() {
                    Some((far, victim)) if far > next => {
                        cached.remove(&(far, victim));
                        next_of[victim] = None;
                        used -= sizes[victim];
                    }
                    _ => keep = false,
                }
            }
            if !keep {
                continue;
            }
            used += size;
        }
        next_of[record] = Some(next);
        cached.insert((next, record));
    }
    tally.figures()
}

/// Runs the table: for each rank count and cap, the loader under LRU and the
/// planned policy (live: a server, the rank processes in lockstep, no prefetch)
/// and the simulations on the recorded stream.
pub fn run(
    exe: &std::path::Path,
    template: &LoaderWorkerOptions,
    rank_counts: &[usize],
    cap_percents: &[f64],
    progress: &dyn Fn(&str),
) -> Result<PolicyTable, LoaderBenchError> {
    let index = DatasetIndex::open(&template.root, &template.split, IndexOptions::default())?;
    let clips = ClipIndex::new(&index, ClipWindows::sliding(template.clip));
    let dataset_bytes = index.compact_bytes();
    let mut rows = Vec::new();
    for &ranks in rank_counts {
        let (stream, records) = recorded_stream(&index, &clips, template, ranks)?;
        for &percent in cap_percents {
            let cap = (dataset_bytes as f64 * percent / 100.0) as u64;
            let live = |policy: CachePolicy| -> Result<PolicyFigures, LoaderBenchError> {
                progress(&format!("{ranks} ranks, cap {percent}%: {policy:?}"));
                let o = LoaderWorkerOptions {
                    ranks,
                    policy,
                    cache_prefetch: false,
                    lockstep: true,
                    ..template.clone()
                };
                let report = loader::run(exe, &o, Some(cap))?;
                Ok(PolicyFigures {
                    hit_rate: report.warm_hit_rate,
                    disk_bytes: report.warm.disk_bytes,
                })
            };
            rows.push(PolicyRow {
                ranks,
                cap_percent: percent,
                cap_bytes: cap,
                lru: live(CachePolicy::Lru)?,
                planned: live(CachePolicy::Planned)?,
                belady: simulate_belady(&stream, &records, cap),
                lru_simulated: simulate_lru(&stream, &records, cap),
            });
        }
    }
    let mut two_jobs = Vec::new();
    for &percent in cap_percents {
        progress(&format!(
            "two jobs at 1 and 3 steps a second, cap {percent}%"
        ));
        let cap = (dataset_bytes as f64 * percent / 100.0) as u64;
        two_jobs.push(two_jobs_row(&index, &clips, template, cap, percent)?);
    }
    Ok(PolicyTable {
        bench: "vrtspike-loader-policy",
        records: index.frame_count(),
        dataset_bytes,
        epochs: template.epochs,
        clip: template.clip,
        workers_per_rank: template.workers,
        rows,
        two_jobs,
    })
}

/// One job's reads, step by step (a step: a sample's clip, frame by frame), in
/// its own shuffled order over `epochs` epochs; records numbered in `records`.
fn job_steps(
    index: &DatasetIndex,
    clips: &ClipIndex,
    seed: u64,
    epochs: u64,
    records: &mut Records,
) -> Result<Vec<Vec<usize>>, LoaderBenchError> {
    let sampler = DistributedSampler::new(clips.clips.len(), shuffled(1, 0, seed))?;
    let mut steps = Vec::new();
    for epoch in 0..epochs {
        for position in sampler.epoch_indices(epoch) {
            let clip = clips.clips[position];
            let frames = clip.start..clip.start + clips.len;
            steps.push(frames.map(|f| records.number(index, clip.seq, f)).collect());
        }
    }
    Ok(steps)
}

/// [`TwoJobsRow`] at `cap`: job 0 reads `template.epochs` epochs at 1 step a
/// second, job 1 three times as many at 3; reads of job 0's first epoch's time
/// are not counted (the cache warm).
fn two_jobs_row(
    index: &DatasetIndex,
    clips: &ClipIndex,
    template: &LoaderWorkerOptions,
    cap: u64,
    cap_percent: f64,
) -> Result<TwoJobsRow, LoaderBenchError> {
    let rates = [1.0, 3.0];
    let mut records = Records::default();
    let epochs = template.epochs.max(2);
    let (seed, r) = (template.seed, &mut records);
    let jobs = [
        job_steps(index, clips, seed, epochs, r)?,
        job_steps(index, clips, seed + 1, 3 * epochs, r)?,
    ];
    let warm_us = (jobs[0].len() as u64 / epochs) * 1_000_000;
    // The merged stream: (time, job, step), soonest first.
    let mut events: Vec<(u64, usize, usize)> = Vec::new();
    for (job, steps) in jobs.iter().enumerate() {
        for step in 0..steps.len() {
            events.push(((step as f64 / rates[job] * 1e6) as u64, job, step));
        }
    }
    events.sort_unstable();
    let mut stream = Vec::new();
    for &(at, job, step) in &events {
        for &record in &jobs[job][step] {
            stream.push(Access {
                record,
                counted: at >= warm_us,
            });
        }
    }
    let planned = simulate_store(&jobs, &events, &records, cap, warm_us)?;
    Ok(TwoJobsRow {
        cap_percent,
        rates,
        lru: simulate_lru(&stream, &records, cap),
        planned,
        belady: simulate_belady(&stream, &records, cap),
    })
}

/// The store's planned policy on the merged stream of `jobs`' `events`, on a
/// simulated clock: each job announces its whole order and reads it.
fn simulate_store(
    jobs: &[Vec<Vec<usize>>; 2],
    events: &[(u64, usize, usize)],
    records: &Records,
    cap: u64,
    warm_us: u64,
) -> Result<PolicyFigures, LoaderBenchError> {
    let bad = |e: RequestError| LoaderBenchError::Store(e.to_string());
    let smallest = records.extents.iter().copied().min().unwrap_or(4096);
    let mut store = Store::on_heap(1, cap.max(smallest), Some(smallest));
    let (clock, now) = Clock::manual();
    store.set_clock(clock);
    store.set_read_order_budget(u64::MAX);
    let key = |record: usize| format!("r{record}");
    let mut readers = Vec::new();
    for (job, steps) in jobs.iter().enumerate() {
        let label = ClientLabel {
            name: format!("job {job}"),
            job: format!("job{job}"),
            pid: 1,
            uid: 0,
        };
        let (client, page) = store.connect_as(label).map_err(bad)?;
        let announcement = ReadOrderAnnouncement {
            first_step: 0,
            keys: (0..records.lens.len()).map(key).collect(),
            steps: steps
                .iter()
                .map(|s| s.iter().map(|&r| r as u32).collect())
                .collect(),
            readers: vec![client],
        };
        store
            .announce_read_order(client, announcement)
            .map_err(bad)?;
        readers.push((client, page));
    }
    let mut tally = Tally::default();
    for &(at, job, step) in events {
        now.store(at, std::sync::atomic::Ordering::Relaxed);
        let (client, page) = readers[job];
        store.pin_page(page).set_progress(step as u64);
        for &record in &jobs[job][step] {
            let access = Access {
                record,
                counted: at >= warm_us,
            };
            let len = records.lens[record];
            let hit = match store.get(client, &key(record)).map_err(bad)? {
                GetOutcome::Hit(grant) => {
                    store.release(client, grant.lease).map_err(bad)?;
                    true
                }
                GetOutcome::Miss(ticket) => {
                    match store.reserve(client, ticket, len) {
                        Ok(_) => {
                            let grant = store.commit(client, ticket).map_err(bad)?;
                            store.release(client, grant.lease).map_err(bad)?;
                        }
                        Err(_) => store.abort(client, ticket).map_err(bad)?,
                    }
                    false
                }
                GetOutcome::Wait { .. } => false,
            };
            tally.read(access, hit, len);
        }
    }
    Ok(tally.figures())
}

impl std::fmt::Display for PolicyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |b: u64| b as f64 / 1e6;
        writeln!(
            f,
            "policy table: {} records, {:.1} MB compact, clips of {}, {} epochs (hit rate and disk reads of epochs 2..{}), {} loader threads a rank, ranks in lockstep",
            self.records,
            mb(self.dataset_bytes),
            self.clip,
            self.epochs,
            self.epochs,
            self.workers_per_rank
        )?;
        writeln!(
            f,
            "| ranks | cap | LRU hit / disk MB | planned hit / disk MB | Belady hit / disk MB | planned / Belady | planned / LRU | LRU simulated |"
        )?;
        writeln!(f, "| --- | --- | --- | --- | --- | --- | --- | --- |")?;
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
        for r in &self.rows {
            writeln!(
                f,
                "| {} | {}% ({:.1} MB) | {:.3} / {:.0} | {:.3} / {:.0} | {:.3} / {:.0} | {:.2}x | {:.1}x | {:.3} |",
                r.ranks,
                r.cap_percent,
                mb(r.cap_bytes),
                r.lru.hit_rate,
                mb(r.lru.disk_bytes),
                r.planned.hit_rate,
                mb(r.planned.disk_bytes),
                r.belady.hit_rate,
                mb(r.belady.disk_bytes),
                ratio(r.planned.hit_rate, r.belady.hit_rate),
                ratio(r.planned.hit_rate, r.lru.hit_rate),
                r.lru_simulated.hit_rate
            )?;
        }
        if self.two_jobs.is_empty() {
            return Ok(());
        }
        writeln!(
            f,
            "two jobs on one cache at 1 and 3 steps a second (the store on a simulated clock; LRU and Belady on the merged, time-ordered stream):"
        )?;
        writeln!(
            f,
            "| cap | LRU hit | planned hit | Belady hit | planned / Belady | planned / LRU |"
        )?;
        writeln!(f, "| --- | --- | --- | --- | --- | --- |")?;
        for r in &self.two_jobs {
            writeln!(
                f,
                "| {}% | {:.3} | {:.3} | {:.3} | {:.2}x | {:.1}x |",
                r.cap_percent,
                r.lru.hit_rate,
                r.planned.hit_rate,
                r.belady.hit_rate,
                ratio(r.planned.hit_rate, r.belady.hit_rate),
                ratio(r.planned.hit_rate, r.lru.hit_rate)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(records: &[usize]) -> Vec<Access> {
        records
            .iter()
            .map(|&record| Access {
                record,
                counted: true,
            })
            .collect()
    }

    #[test]
    fn belady_keeps_what_is_needed_soonest_and_lru_what_was_used_last() {
        // Room for 2 of 3 records used in a loop: LRU always misses, Belady hits
        // once every other time after the first pass.
        let s = stream(&[0, 1, 2, 0, 1, 2, 0, 1, 2]);
        let sizes = Records {
            extents: vec![10, 10, 10],
            lens: vec![9, 9, 9],
            ids: HashMap::new(),
        };
        let lru = simulate_lru(&s, &sizes, 20);
        assert_eq!(lru.hit_rate, 0.0);
        assert_eq!(lru.disk_bytes, 81);
        let belady = simulate_belady(&s, &sizes, 20);
        // 0 1 2 (kept out: needed after 0 and 1), 0 and 1 hit, 2 kept out again...
        assert!((belady.hit_rate - 4.0 / 9.0).abs() < 1e-9, "{belady:?}");
        assert_eq!(belady.disk_bytes, 45);
        // A record larger than the cap is never kept.
        let big = Records {
            extents: vec![30],
            lens: vec![30],
            ids: HashMap::new(),
        };
        let big = simulate_belady(&stream(&[0, 0]), &big, 20);
        assert_eq!(big.hit_rate, 0.0);
    }
}
