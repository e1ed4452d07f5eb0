"""vrtspike for PyTorch trainers: a GoPro-Spike ``torch.utils.data.Dataset`` that
reads through the node's shared-memory cache server (one RAM copy of the data per
node, shared by every rank, DataLoader worker and job) and returns the samples
vrtspike's own loader returns for the same config keys.

    from vrtspike.data import DistributedSampler, from_config
    dataset = from_config("configs/deblur/vrt_spike_baseline.yaml", "train")
    sampler = DistributedSampler(dataset)

See docs/pytorch.md ("Use the cache from PyTorch").
"""

from ._native import BUILD_ID, CacheError, ConfigError, DataError, VrtspikeError
from . import data
from .data import Dataset, DistributedSampler, Sample, SampleIndex, SampleInfo, from_config

__all__ = [
    "BUILD_ID",
    "CacheError",
    "ConfigError",
    "DataError",
    "Dataset",
    "DistributedSampler",
    "Sample",
    "SampleIndex",
    "SampleInfo",
    "VrtspikeError",
    "data",
    "from_config",
]
