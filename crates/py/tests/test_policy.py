"""The planned policy from Python: DistributedSampler's indices make the workers
announce the rank's read order, so a cache smaller than the data evicts by next
use and hits more often than LRU."""

from __future__ import annotations

from pathlib import Path

import pytest

from vrtspike.data import Dataset, DistributedSampler

from conftest import servers_of, synth, wait_until

EPOCHS = 3


@pytest.fixture(scope="module")
def larger_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 sequences of 30 frames (60 records of ~48 KB)."""
    root = tmp_path_factory.mktemp("policy") / "root"
    return synth(root, "--seqs", "2", "--test-seqs", "0", "--frames", "30", "--blur-frames", "7,7")


def hit_rate(root: Path, policy: str, cap_gb: float, leaves_nothing) -> float:
    """The main process's hit rate over epochs 1 and 2 (epoch 0 fills the cache)."""
    dataset = Dataset(root, "train", overrides={
        "DATA.CLIP_LEN": 4, "DATA.CROP_SIZE": 32, "DATA.SPIKE_BINS": 4, "TRAIN.SEED": 1,
        "DATA.CACHE_POLICY": policy, "DATA.CACHE_PREFETCH": False, "DATA.CACHE_SIZE_GB": cap_gb,
    })
    address = dataset.cache_address
    leaves_nothing.add(address)
    assert dataset.cache_how == "started (node-shared)", dataset.cache_how
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    counted = {"hits": 0, "misses": 0}
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        before = dataset.reader_stats()
        for index in sampler:
            dataset[index]
        after = dataset.reader_stats()
        if epoch > 0:
            for key in counted:
                counted[key] += after[key] - before[key]
    stats = dataset.cache_stats()
    assert stats["evictions"] > 0, "the cap holds the whole set: nothing tested"
    if policy == "planned":
        assert stats["read_orders"], "no read order was announced"
    dataset.close()
    wait_until(f"the server at {address} exits", lambda: not servers_of(address))
    return counted["hits"] / max(1, counted["hits"] + counted["misses"])


def test_planned_order_hits_more_than_lru(larger_root: Path, leaves_nothing) -> None:
    record = 64 * 96 * 3 + 32 * 48 * 7  # roughly: a blurred frame and its spikes
    cap_gb = 0.1 * 60 * record / 2**30
    planned = hit_rate(larger_root, "planned", cap_gb, leaves_nothing)
    lru = hit_rate(larger_root, "lru", cap_gb, leaves_nothing)
    print(f"hit rate at a 10% cap: planned {planned:.3f}, LRU {lru:.3f}")
    assert planned > lru, f"planned {planned:.3f} vs LRU {lru:.3f}"
