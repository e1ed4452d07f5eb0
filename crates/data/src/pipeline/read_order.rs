//! What a training rank will read, for the cache's planned policy
//! (`DATA.CACHE_POLICY: planned`). A rank's sample order is a pure function of the
//! seed, the epoch and the sampler's settings, so its loader can tell the cache
//! server what it will read: from any sampler position, the records of the rest of
//! that epoch and of the whole next one, step by step ([`ReadOrder`], made by
//! [`ReadOrderSource`]), and that order as the server takes it (records as keys, the
//! loader's worker connections as its readers). [`announce`](super::announce) sends
//! it; [`prefetch`](super::prefetch) fills it ahead of use.

use std::sync::Arc;

use crate::cache::protocol::{ClientId, ReadOrderAnnouncement};
use crate::dataset::index::DatasetIndex;

use super::sample::ClipIndex;
use super::sampler::DistributedSampler;

/// A record: (sequence, frame).
pub type Record = (usize, usize);

/// The records a rank reads, step by step, from one step on.
#[derive(Debug, Clone)]
pub struct ReadOrder {
    /// The step of `steps[0]`.
    pub first_step: u64,
    /// Per step (a sampler position), its records in the order they are read.
    pub steps: Vec<Vec<Record>>,
}

impl ReadOrder {
    /// The records of step `step`, if this order covers it.
    pub(super) fn at(&self, step: u64) -> Option<&[Record]> {
        let i = usize::try_from(step.checked_sub(self.first_step)?).ok()?;
        self.steps.get(i).map(Vec::as_slice)
    }

    /// The step after the last one covered.
    pub(super) fn end(&self) -> u64 {
        self.first_step + self.steps.len() as u64
    }
}

/// How a rank's sampler positions become read order steps and records.
pub struct ReadOrderSource {
    pub(super) index: Arc<DatasetIndex>,
    clips: Arc<ClipIndex>,
    sampler: DistributedSampler,
    /// The batch size when an incomplete last batch of an epoch is dropped (its
    /// positions are not read).
    dropped_batch: Option<usize>,
    /// Each record's cache key, by sequence and frame.
    keys: Vec<Vec<String>>,
}

impl ReadOrderSource {
    /// The read order of `sampler`'s rank over `clips` of `index` (as `sampler`
    /// stands: the head of its current epoch that an earlier world took is not
    /// read); with `dropped_batch`, an epoch's incomplete last batch of that size
    /// is not read.
    pub fn new(
        index: Arc<DatasetIndex>,
        clips: Arc<ClipIndex>,
        sampler: &DistributedSampler,
        dropped_batch: Option<usize>,
    ) -> ReadOrderSource {
        let keys = index
            .sequences
            .iter()
            .enumerate()
            .map(|(seq, s)| {
                (0..s.frames.len())
                    .map(|frame| index.record_key(seq, frame))
                    .collect()
            })
            .collect();
        ReadOrderSource {
            index,
            clips,
            sampler: sampler.clone(),
            dropped_batch,
            keys,
        }
    }

    /// The read order step of sampler position `position` of `epoch`: steps run on
    /// across epochs, the same on every rank (lockstep); an epoch whose head an
    /// earlier world took starts that many steps into it.
    pub fn step(&self, epoch: u64, position: usize) -> u64 {
        let whole = self.sampler.num_samples() as u64;
        let skipped = whole.saturating_sub(self.sampler.epoch_len(epoch) as u64);
        epoch * whole + skipped + position as u64
    }

    /// Positions of `epoch` that are read.
    fn read_in(&self, epoch: u64) -> usize {
        let len = self.sampler.epoch_len(epoch);
        match self.dropped_batch {
            Some(batch) => len - len % batch.max(1),
            None => len,
        }
    }

    /// The reads from `position` of `epoch` to the end of the next epoch.
    pub fn order_from(&self, epoch: u64, position: usize) -> ReadOrder {
        let mut steps = Vec::new();
        for (e, from) in [(epoch, position), (epoch + 1, 0)] {
            let order = self.sampler.epoch_indices(e);
            let read = order.len().min(self.read_in(e));
            for (p, &clip_no) in order.iter().enumerate().skip(from) {
                steps.push(match p < read {
                    true => self.clip_records(clip_no),
                    false => Vec::new(),
                });
            }
        }
        ReadOrder {
            first_step: self.step(epoch, position),
            steps,
        }
    }

    /// The records of clip `clip_no`, in the order a sample reads them.
    fn clip_records(&self, clip_no: usize) -> Vec<Record> {
        let clip = self.clips.clips[clip_no];
        (clip.start..clip.start + self.clips.len)
            .map(|frame| (clip.seq, frame))
            .collect()
    }

    /// `order` as the server takes it, with `readers` reading for it.
    pub fn announcement(&self, order: &ReadOrder, readers: &[ClientId]) -> ReadOrderAnnouncement {
        let mut ids: Vec<Vec<Option<u32>>> = self
            .keys
            .iter()
            .map(|frames| vec![None; frames.len()])
            .collect();
        let mut keys = Vec::new();
        let steps = order
            .steps
            .iter()
            .map(|records| {
                records
                    .iter()
                    .map(|&(seq, frame)| {
                        *ids[seq][frame].get_or_insert_with(|| {
                            keys.push(self.keys[seq][frame].clone());
                            keys.len() as u32 - 1
                        })
                    })
                    .collect()
            })
            .collect();
        ReadOrderAnnouncement {
            first_step: order.first_step,
            keys,
            steps,
            readers: readers.to_vec(),
        }
    }

    pub(super) fn key(&self, (seq, frame): Record) -> &str {
        &self.keys[seq][frame]
    }

    pub(super) fn record_len(&self, (seq, frame): Record) -> u64 {
        self.index.record_layout(seq, frame).byte_len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_covers_the_rest_of_the_epoch_and_the_next_one() {
        let order = ReadOrder {
            first_step: 10,
            steps: vec![vec![(0, 1)], vec![], vec![(1, 2), (1, 3)]],
        };
        assert_eq!(order.at(9), None);
        assert_eq!(order.at(10), Some(&[(0, 1)][..]));
        assert_eq!(order.at(12), Some(&[(1, 2), (1, 3)][..]));
        assert_eq!(order.at(13), None);
        assert_eq!(order.end(), 13);
    }
}
