//! The rank's sample order for Python: vrtspike's own distributed sampler
//! (`torch.utils.data.DistributedSampler` semantics: rank, world size, seed,
//! epoch, padding or `drop_last`), so a Python DataLoader reads the clips the Rust
//! loader reads, in its order, and a reader can announce that order to the cache.

use pyo3::prelude::*;

use vrtspike_data::pipeline::sampler::{DistributedSampler, Remainder, SamplerOptions};

use crate::errors::{guarded, Failure};

/// The sampler settings a read order is made from (what a sample's index carries
/// to the worker that reads it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderKey {
    /// Ranks sharing the dataset.
    pub world: usize,
    /// The rank.
    pub rank: usize,
    /// The shuffle's seed.
    pub seed: u64,
    /// Shuffled every epoch, or in dataset order.
    pub shuffle: bool,
    /// Drop the tail of an uneven split (else pad by wrapping around).
    pub drop_last: bool,
}

impl OrderKey {
    /// The sampler's options.
    pub fn options(self) -> SamplerOptions {
        SamplerOptions {
            world: self.world,
            rank: self.rank,
            shuffle: self.shuffle,
            seed: self.seed,
            remainder: match self.drop_last {
                true => Remainder::Drop,
                false => Remainder::Pad,
            },
        }
    }
}

/// vrtspike's distributed sampler over `length` clips.
#[pyclass(module = "vrtspike._native", frozen)]
pub struct NativeSampler {
    sampler: DistributedSampler,
}

#[pymethods]
impl NativeSampler {
    /// A sampler of `length` items for `rank` of `world` ranks.
    #[new]
    #[pyo3(signature = (length, world, rank, seed, shuffle=true, drop_last=false))]
    fn new(
        length: usize,
        world: usize,
        rank: usize,
        seed: u64,
        shuffle: bool,
        drop_last: bool,
    ) -> PyResult<NativeSampler> {
        let key = OrderKey {
            world,
            rank,
            seed,
            shuffle,
            drop_last,
        };
        guarded(
            "DistributedSampler",
            || {},
            || {
                let sampler = DistributedSampler::new(length, key.options())
                    .map_err(|e| Failure::Request(format!("DistributedSampler: {e}")))?;
                Ok(NativeSampler { sampler })
            },
        )
    }

    /// The items of this rank for `epoch`, in order.
    fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        self.sampler.epoch_indices(epoch)
    }

    /// Items of this rank per epoch.
    fn num_samples(&self) -> usize {
        self.sampler.num_samples()
    }
}
