//! A sampler with `torch.utils.data.DistributedSampler` semantics: every rank
//! shuffles the same way from seed + epoch, pads by wrap-around (or drops the tail
//! with `drop_last`, or leaves the split uneven so every item is used exactly once)
//! and takes every world-th index from its rank on. Its cursor
//! (epoch, position) is saved in checkpoints so a resumed run continues mid-epoch.

use serde::{Deserialize, Serialize};

use crate::util::rng::SplitMix64;

use super::error::{PipelineError, Result};

/// The saveable state of a [`DistributedSampler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Current epoch.
    pub epoch: u64,
    /// Indices of this epoch already handed out on this rank.
    pub position: usize,
    /// Dataset length it was made for (checked on restore).
    pub len: usize,
    /// World size it was made for (checked on restore).
    pub world: usize,
    /// Rank it was made for (checked on restore).
    pub rank: usize,
    /// Shuffle seed (checked on restore).
    pub seed: u64,
}

/// What happens to the items left over when the dataset does not split evenly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remainder {
    /// Pad by wrap-around so every rank gets as many (torch's default).
    Pad,
    /// Drop the tail so every rank gets as many (torch's `drop_last`).
    Drop,
    /// Neither: the first `len % world` ranks get one more, every item is used
    /// exactly once over the ranks (validation).
    Uneven,
}

/// How a [`DistributedSampler`] splits and orders a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplerOptions {
    /// Ranks sharing the dataset.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Shuffle every epoch (from `seed` and the epoch), or keep the dataset order.
    pub shuffle: bool,
    /// Shuffle seed.
    pub seed: u64,
    /// The items left over by an uneven split.
    pub remainder: Remainder,
}

/// Hands each rank its share of a dataset, epoch after epoch.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    remainder: Remainder,
    epoch: u64,
    position: usize,
    order: Vec<usize>,
}

impl DistributedSampler {
    /// A sampler over `len` items as `options` say, at epoch 0.
    pub fn new(len: usize, options: SamplerOptions) -> Result<Self> {
        let SamplerOptions {
            world,
            rank,
            shuffle,
            seed,
            remainder,
        } = options;
        if world == 0 || rank >= world {
            return Err(PipelineError::Request(format!(
                "sampler: rank {rank} of a world of {world}"
            )));
        }
        if len == 0 {
            return Err(PipelineError::Request(
                "sampler: the dataset has no sample".into(),
            ));
        }
        let mut sampler = DistributedSampler {
            len,
            world,
            rank,
            shuffle,
            seed,
            remainder,
            epoch: 0,
            position: 0,
            order: Vec::new(),
        };
        sampler.order = sampler.epoch_indices(0);
        Ok(sampler)
    }

    /// Samples of this rank per epoch.
    pub fn num_samples(&self) -> usize {
        match self.remainder {
            Remainder::Drop => self.len / self.world,
            Remainder::Pad => self.len.div_ceil(self.world),
            Remainder::Uneven => {
                self.len / self.world + usize::from(self.rank < self.len % self.world)
            }
        }
    }

    /// This rank's indices for `epoch`.
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix64::from_parts(&[self.seed, epoch]);
            for i in (1..all.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                all.swap(i, j);
            }
        }
        let total = match self.remainder {
            Remainder::Uneven => all.len(),
            Remainder::Pad | Remainder::Drop => self.num_samples() * self.world,
        };
        if total > all.len() {
            // Pad by wrapping around the (shuffled) list, as many times as needed.
            let base = all.clone();
            all.extend(base.iter().cycle().take(total - base.len()));
        } else {
            all.truncate(total);
        }
        all.into_iter()
            .skip(self.rank)
            .step_by(self.world)
            .collect()
    }

    /// Starts `epoch` from its beginning.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.position = 0;
        self.order = self.epoch_indices(epoch);
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Indices handed out so far this epoch.
    pub fn position(&self) -> usize {
        self.position
    }

    /// The next index of this epoch with its position in the epoch, or None at its end.
    pub fn next_index(&mut self) -> Option<(usize, usize)> {
        let index = *self.order.get(self.position)?;
        self.position += 1;
        Some((self.position - 1, index))
    }

    /// The state to save in a checkpoint.
    pub fn state(&self) -> SamplerState {
        SamplerState {
            epoch: self.epoch,
            position: self.position,
            len: self.len,
            world: self.world,
            rank: self.rank,
            seed: self.seed,
        }
    }

    /// Continues from a saved state; a state made for another dataset length, world,
    /// rank or seed is an error naming what differs.
    pub fn restore(&mut self, state: &SamplerState) -> Result<()> {
        let checks = [
            ("dataset length", state.len as u64, self.len as u64),
            ("world size", state.world as u64, self.world as u64),
            ("rank", state.rank as u64, self.rank as u64),
            ("seed", state.seed, self.seed),
        ];
        for (what, saved, now) in checks {
            if saved != now {
                return Err(PipelineError::Request(format!(
                    "sampler state saved with {what} {saved}, but this run has {now}"
                )));
            }
        }
        self.set_epoch(state.epoch);
        if state.position > self.order.len() {
            return Err(PipelineError::Request(format!(
                "sampler state position {} past the {} samples of an epoch",
                state.position,
                self.order.len()
            )));
        }
        self.position = state.position;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn options(world: usize, rank: usize, seed: u64, remainder: Remainder) -> SamplerOptions {
        SamplerOptions {
            world,
            rank,
            shuffle: true,
            seed,
            remainder,
        }
    }

    fn all_ranks(len: usize, world: usize, remainder: Remainder, epoch: u64) -> Vec<Vec<usize>> {
        (0..world)
            .map(|r| {
                DistributedSampler::new(len, options(world, r, 7, remainder))
                    .unwrap()
                    .epoch_indices(epoch)
            })
            .collect()
    }

    #[test]
    fn ranks_partition_the_shuffle_with_padding() {
        let ranks = all_ranks(10, 3, Remainder::Pad, 0);
        assert!(ranks.iter().all(|r| r.len() == 4));
        let seen: HashSet<usize> = ranks.iter().flatten().copied().collect();
        assert_eq!(seen.len(), 10, "every index is used");
        // 12 slots for 10 items: exactly 2 repeats, the first two of the shuffle.
        let all: Vec<usize> = ranks.iter().flatten().copied().collect();
        assert_eq!(all.len(), 12);
        // Interleaving the ranks gives back the padded shuffled list.
        let mut interleaved = Vec::new();
        for i in 0..4 {
            for r in &ranks {
                interleaved.push(r[i]);
            }
        }
        assert_eq!(interleaved[10..], interleaved[..2]);
        // Padding wraps more than once when the world exceeds the dataset.
        let tiny = all_ranks(2, 5, Remainder::Pad, 0);
        assert!(tiny.iter().all(|r| r.len() == 1));
    }

    #[test]
    fn drop_last_truncates_and_epochs_reshuffle() {
        let ranks = all_ranks(10, 3, Remainder::Drop, 0);
        assert!(ranks.iter().all(|r| r.len() == 3));
        let seen: HashSet<usize> = ranks.iter().flatten().copied().collect();
        assert_eq!(seen.len(), 9, "no repeats");
        assert_eq!(
            all_ranks(10, 3, Remainder::Drop, 0),
            ranks,
            "same seed and epoch, same order on every call"
        );
        assert_ne!(
            all_ranks(10, 3, Remainder::Drop, 1),
            ranks,
            "another epoch reshuffles"
        );
        let in_order = SamplerOptions {
            shuffle: false,
            ..options(1, 0, 0, Remainder::Pad)
        };
        let plain = DistributedSampler::new(5, in_order).unwrap();
        assert_eq!(plain.epoch_indices(3), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn uneven_split_uses_every_item_exactly_once() {
        let split = |len: usize, world: usize| -> Vec<Vec<usize>> {
            (0..world)
                .map(|rank| {
                    let options = SamplerOptions {
                        shuffle: false,
                        ..options(world, rank, 0, Remainder::Uneven)
                    };
                    let sampler = DistributedSampler::new(len, options).unwrap();
                    let indices = sampler.epoch_indices(0);
                    assert_eq!(indices.len(), sampler.num_samples());
                    indices
                })
                .collect()
        };
        // Clip i on rank i % world, in order, nothing padded or dropped.
        assert_eq!(split(5, 2), vec![vec![0, 2, 4], vec![1, 3]]);
        assert_eq!(split(3, 2), vec![vec![0, 2], vec![1]]);
        // More ranks than items: the last ones get none.
        assert_eq!(split(2, 3), vec![vec![0], vec![1], vec![]]);
    }

    #[test]
    fn restore_continues_mid_epoch() {
        let mut a = DistributedSampler::new(50, options(2, 1, 3, Remainder::Pad)).unwrap();
        a.set_epoch(4);
        for _ in 0..7 {
            a.next_index();
        }
        let saved = serde_json::to_string(&a.state()).unwrap();
        let rest: Vec<_> = std::iter::from_fn(|| a.next_index()).collect();
        let mut b = DistributedSampler::new(50, options(2, 1, 3, Remainder::Pad)).unwrap();
        b.restore(&serde_json::from_str(&saved).unwrap()).unwrap();
        assert_eq!(b.epoch(), 4);
        let resumed: Vec<_> = std::iter::from_fn(|| b.next_index()).collect();
        assert_eq!(resumed, rest);
        assert_eq!(resumed.len(), 25 - 7);
        let mut other = DistributedSampler::new(51, options(2, 1, 3, Remainder::Pad)).unwrap();
        let err = other
            .restore(&serde_json::from_str(&saved).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("dataset length 50"), "{err}");
        assert!(DistributedSampler::new(5, options(2, 2, 0, Remainder::Pad)).is_err());
    }
}
