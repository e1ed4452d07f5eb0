//! A sampler with `torch.utils.data.DistributedSampler` semantics: every rank
//! shuffles the same way from seed + epoch, pads by wrap-around (or drops the tail
//! with `drop_last`, or leaves the split uneven so every item is used exactly once)
//! and takes every world-th index from its rank on. Its cursor
//! (epoch, position) is saved in checkpoints so a resumed run continues mid-epoch,
//! in a world of another size too: the epoch's shuffled order is the same for
//! every world (seed and epoch), and what the old world's ranks had taken of it is
//! a prefix (`position` rows of `world` items), so the new world splits what is
//! left of that order ([`SamplerState::epoch_start`]) and no sample of the epoch
//! is seen twice or skipped (but the padding or dropped tail the remainder rule
//! adds to any epoch).

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
    /// Items at the head of this epoch's shuffled order that ranks of an earlier
    /// world took before this world's share began (0 unless the world changed
    /// mid-epoch); this world splits the rest. Absent in checkpoints written
    /// before worlds could change (read as 0).
    #[serde(default)]
    pub epoch_start: usize,
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
    /// Items of the current epoch's order an earlier world took.
    epoch_start: usize,
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
            epoch_start: 0,
            position: 0,
            order: Vec::new(),
        };
        sampler.order = sampler.epoch_indices(0);
        Ok(sampler)
    }

    /// Samples of this rank in a whole epoch.
    pub fn num_samples(&self) -> usize {
        self.share(self.len)
    }

    /// Samples of this rank in `epoch`: fewer than [`Self::num_samples`] in the
    /// current epoch when an earlier world took its head.
    pub fn epoch_len(&self, epoch: u64) -> usize {
        self.share(self.len - self.start_of(epoch))
    }

    /// This rank's share of `items` items split over the world.
    fn share(&self, items: usize) -> usize {
        match self.remainder {
            Remainder::Drop => items / self.world,
            Remainder::Pad => items.div_ceil(self.world),
            Remainder::Uneven => items / self.world + usize::from(self.rank < items % self.world),
        }
    }

    /// Items at the head of `epoch`'s order that an earlier world took.
    fn start_of(&self, epoch: u64) -> usize {
        if epoch == self.epoch {
            self.epoch_start
        } else {
            0
        }
    }

    /// This rank's indices for `epoch` (in the current epoch, of what an earlier
    /// world left).
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix64::from_parts(&[self.seed, epoch]);
            for i in (1..all.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                all.swap(i, j);
            }
        }
        all.drain(..self.start_of(epoch));
        let total = match self.remainder {
            Remainder::Uneven => all.len(),
            Remainder::Pad | Remainder::Drop => self.epoch_len(epoch) * self.world,
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
        self.epoch_start = 0;
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
            epoch_start: self.epoch_start,
        }
    }

    /// Continues from a saved state. A state of the same world continues at its
    /// position; one of another world continues the same epoch with what that
    /// world's ranks had not taken yet, split over this world (position 0 of
    /// the rest). A state made for another dataset length or seed, or for
    /// another rank of the same world, is an error naming what differs.
    pub fn restore(&mut self, state: &SamplerState) -> Result<()> {
        let checks = [
            ("dataset length", state.len as u64, self.len as u64),
            ("seed", state.seed, self.seed),
        ];
        for (what, saved, now) in checks {
            if saved != now {
                return Err(PipelineError::Request(format!(
                    "sampler state saved with {what} {saved}, but this run has {now}"
                )));
            }
        }
        if state.world == self.world {
            if state.rank != self.rank {
                return Err(PipelineError::Request(format!(
                    "sampler state saved with rank {}, but this run has {}",
                    state.rank, self.rank
                )));
            }
            return self.seek(state.epoch, state.epoch_start, state.position);
        }
        if self.remainder == Remainder::Uneven {
            return Err(PipelineError::Request(format!(
                "an uneven split (ranks at different positions) cannot continue in another \
                 world: saved with world size {}, this run has {}",
                state.world, self.world
            )));
        }
        let taken = state.taken()?;
        self.seek(state.epoch, taken.min(self.len), 0)
    }

    /// Moves to `position` of `epoch`, whose first `epoch_start` items an
    /// earlier world took.
    fn seek(&mut self, epoch: u64, epoch_start: usize, position: usize) -> Result<()> {
        if epoch_start > self.len {
            return Err(PipelineError::Request(format!(
                "sampler state starts its epoch at item {epoch_start} of {}",
                self.len
            )));
        }
        self.epoch = epoch;
        self.epoch_start = epoch_start;
        self.order = self.epoch_indices(epoch);
        if position > self.order.len() {
            return Err(PipelineError::Request(format!(
                "sampler state position {position} past the {} samples of an epoch",
                self.order.len()
            )));
        }
        self.position = position;
        Ok(())
    }
}

impl SamplerState {
    /// Items of its epoch's order that its world's ranks had taken (all of them
    /// at the same position, as training ranks step together): what a world of
    /// another size starts the rest of the epoch from.
    pub fn taken(&self) -> Result<usize> {
        if self.world == 0 {
            return Err(PipelineError::Request(
                "sampler state saved with world size 0".into(),
            ));
        }
        Ok(self.epoch_start + self.position * self.world)
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

    /// Takes `steps` positions on every rank of a world of `world` from `state`
    /// (a fresh sampler of epoch 2 when `None`); what they took, and rank 0's state.
    fn run_world(
        len: usize,
        world: usize,
        remainder: Remainder,
        state: Option<&SamplerState>,
        steps: Option<usize>,
    ) -> (Vec<usize>, SamplerState) {
        let mut taken = Vec::new();
        let mut rank0 = None;
        let mut samplers: Vec<DistributedSampler> = (0..world)
            .map(|rank| {
                let mut s = DistributedSampler::new(len, options(world, rank, 11, remainder))
                    .unwrap_or_else(|e| panic!("{e}"));
                match state {
                    Some(state) => {
                        let mut mine = *state;
                        mine.rank = rank;
                        s.restore(&mine).unwrap_or_else(|e| panic!("{e}"));
                    }
                    None => s.set_epoch(2),
                }
                s
            })
            .collect();
        let per_rank = samplers[0].epoch_len(2);
        assert!(
            samplers.iter().all(|s| s.epoch_len(2) == per_rank),
            "lockstep"
        );
        for _ in 0..steps.unwrap_or(per_rank) {
            for s in samplers.iter_mut() {
                let (_, index) = s
                    .next_index()
                    .unwrap_or_else(|| panic!("epoch ended early"));
                taken.push(index);
            }
        }
        for s in samplers.iter_mut() {
            if steps.is_none() {
                assert_eq!(s.next_index(), None, "the epoch ends together");
            }
            rank0.get_or_insert(s.state());
        }
        let state = rank0.unwrap_or_else(|| panic!("no rank"));
        (taken, state)
    }

    #[test]
    fn resume_in_another_world_takes_every_sample_of_the_epoch_once() {
        for remainder in [Remainder::Pad, Remainder::Drop] {
            // 4 ranks take 5 steps, 2 ranks take 4 more, then 3 ranks end the epoch.
            let len = 60;
            let (first, saved) = run_world(len, 4, remainder, None, Some(5));
            let (second, saved) = run_world(len, 2, remainder, Some(&saved), Some(4));
            assert_eq!(saved.epoch_start, 20, "{saved:?}");
            assert_eq!(saved.taken().ok(), Some(28));
            let (third, end) = run_world(len, 3, remainder, Some(&saved), None);
            assert_eq!((end.epoch, end.epoch_start), (2, 28));
            let all: Vec<usize> = [first, second, third].concat();
            // 60 items: 28 taken, 32 left over 3 ranks: 33 padded or 30 kept.
            let (expected_len, extra) = match remainder {
                Remainder::Pad => (61, 1),
                _ => (58, 0),
            };
            assert_eq!(all.len(), expected_len, "{remainder:?}");
            let distinct: HashSet<usize> = all.iter().copied().collect();
            assert_eq!(
                distinct.len(),
                all.len() - extra,
                "{remainder:?}: a sample seen twice beyond the padding"
            );
            // The same order as one world would have walked (before its padding or
            // dropped tail): the epoch's shuffle, in turn.
            let reference = DistributedSampler::new(len, options(1, 0, 11, Remainder::Pad))
                .unwrap_or_else(|e| panic!("{e}"))
                .epoch_indices(2);
            let mut by_row = Vec::new();
            for (chunk, world) in [(&all[..20], 4), (&all[20..28], 2), (&all[28..], 3)] {
                for row in chunk.chunks(world) {
                    by_row.extend_from_slice(row);
                }
            }
            assert_eq!(by_row[..58], reference[..58], "{remainder:?}");
            // The next epoch is a whole one for the new world.
            let mut next = DistributedSampler::new(len, options(3, 1, 11, remainder))
                .unwrap_or_else(|e| panic!("{e}"));
            let mut state = end;
            state.rank = 1;
            next.restore(&state).unwrap_or_else(|e| panic!("{e}"));
            next.set_epoch(3);
            assert_eq!(next.epoch_len(3), 20);
            let fresh = DistributedSampler::new(len, options(3, 1, 11, remainder))
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(next.epoch_indices(3), fresh.epoch_indices(3));
        }
    }

    #[test]
    fn an_ended_epoch_resumes_empty_and_an_uneven_split_keeps_its_world() {
        let (_, end) = run_world(10, 3, Remainder::Pad, None, None);
        assert_eq!(end.position, 4, "10 items padded to 12");
        let mut other = DistributedSampler::new(10, options(2, 0, 11, Remainder::Pad))
            .unwrap_or_else(|e| panic!("{e}"));
        other.restore(&end).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(other.next_index(), None, "nothing left of epoch 2");
        let uneven = SamplerOptions {
            shuffle: false,
            ..options(2, 0, 11, Remainder::Uneven)
        };
        let mut uneven = DistributedSampler::new(10, uneven).unwrap_or_else(|e| panic!("{e}"));
        let err = uneven.restore(&end).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("uneven")),
            "{err:?}"
        );
        let mut bad = end;
        bad.seed = 12;
        assert!(other.restore(&bad).is_err());
    }
}
