"""The Dataset under DataLoader worker processes that die, a server that dies, and
two trainer processes sharing one server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling

import vrtspike
from vrtspike.data import Dataset, DistributedSampler

from conftest import servers_of, wait_until

KEYS = {"DATA.CLIP_LEN": 3, "DATA.CROP_SIZE": 32, "DATA.SPIKE_BINS": 4, "TRAIN.SEED": 3}


def from_disk(root: Path) -> Dataset:
    return Dataset(root, "train", overrides={**KEYS, "DATA.USE_RAM_CACHE": False})


def test_a_killed_worker_leaves_the_server_serving(dataset_root: Path, leaves_nothing) -> None:
    dataset = Dataset(dataset_root, "train", overrides=KEYS)
    leaves_nothing.add(dataset.cache_address)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=2)
    batches = iter(loader)
    try:
        next(batches)
        victim = batches._workers[0].pid
        # DataLoader's SIGCHLD handler may raise as soon as the kill lands.
        with pytest.raises((RuntimeError, ConnectionError, EOFError)) as died:
            os.kill(victim, signal.SIGKILL)
            for _ in batches:
                pass
        # The DataLoader names the killed worker, or, when it died handing a batch
        # over, fails to fetch the batch's shared memory from it (its socket reset
        # or closed).
        handover = isinstance(died.value, (ConnectionError, EOFError))
        assert str(victim) in str(died.value) or handover, died.value
    finally:
        # Its workers off DataLoader's SIGCHLD handler first, which would otherwise
        # raise for the killed one at any later point of the run (the other
        # worker's exit included), then the other worker stopped.
        if batches._worker_pids_set:
            signal_handling._remove_worker_pids(id(batches))
            batches._worker_pids_set = False
        batches._shutdown_workers()
    # The server let the killed worker's connection go and serves the next epoch.
    wait_until("the killed worker's leases are released", lambda: dataset.cache_stats()["leases_held"] == 0)
    disk = from_disk(dataset_root)
    sampler.set_epoch(1)
    indices = list(sampler)
    for position, batch in enumerate(DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=2)):
        assert torch.equal(batch.blur[0], disk[indices[position]].blur)
    assert servers_of(dataset.cache_address)
    dataset.close()


def test_a_killed_server_falls_back_to_disk(dataset_root: Path, leaves_nothing) -> None:
    dataset = Dataset(dataset_root, "train", overrides=KEYS)
    leaves_nothing.add(dataset.cache_address)
    disk = from_disk(dataset_root)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    indices = list(sampler)
    loader = DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=2)
    server = dataset.cache_stats()["server_pid"]
    for position, batch in enumerate(loader):
        if position == 3:
            os.kill(server, signal.SIGKILL)
            wait_until("the killed server is gone", lambda: not servers_of(dataset.cache_address))
        assert torch.equal(batch.blur[0], disk[indices[position]].blur), position
        assert torch.equal(batch.voxel[0], disk[indices[position]].voxel), position
    with pytest.raises(vrtspike.CacheError, match=dataset.cache_address):
        dataset.cache_stats()
    dataset.close()


RANK_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from torch.utils.data import DataLoader
    from vrtspike.data import Dataset, DistributedSampler
    root, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dataset = Dataset(root, "train", overrides=json.loads(sys.argv[4]))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank)
    digests = [hashlib.sha256(b.blur.numpy().tobytes() + b.voxel.numpy().tobytes()).hexdigest()
               for b in DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=2)]
    json.dump({"address": dataset.cache_address, "how": dataset.cache_how, "digests": digests}, open(out, "w"))
    dataset.close()
    """
)


def test_two_processes_of_two_workers_share_one_server(dataset_root: Path, tmp_path: Path, leaves_nothing) -> None:
    import hashlib

    dataset = Dataset(dataset_root, "train", overrides=KEYS)
    leaves_nothing.add(dataset.cache_address)
    before = dataset.cache_stats()["totals"]
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(dataset_root), str(rank), str(tmp_path / f"{rank}.json"),
                          json.dumps(KEYS)])
        for rank in (0, 1)
    ]
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    disk = from_disk(dataset_root)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert report["address"] == dataset.cache_address
        assert report["how"] == "attached (node-shared)"
        sampler = DistributedSampler(disk, num_replicas=2, rank=rank)
        expected = [hashlib.sha256(s.blur.numpy().tobytes() + s.voxel.numpy().tobytes()).hexdigest()
                    for s in (disk[i] for i in sampler)]
        assert report["digests"] == expected
    # Every record read of both ranks' workers went through this one server.
    after = dataset.cache_stats()["totals"]
    reads = sum(len(DistributedSampler(disk, num_replicas=2, rank=r)) for r in (0, 1)) * KEYS["DATA.CLIP_LEN"]
    served = sum(after[k] - before[k] for k in ("hits", "misses", "waits"))
    assert served >= reads, (before, after, reads)
    assert after["hits"] > before["hits"]
    dataset.close()


def test_no_server_to_be_had_reads_from_disk_with_a_warning(
    dataset_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vrtspike._native.SERVER_ENV, str(tmp_path / "no-such-vrtspike-cache"))
    with pytest.warns(RuntimeWarning, match="no-such-vrtspike-cache") as warned:
        dataset = Dataset(dataset_root, "train", overrides=KEYS)
    assert any("reads every record from disk" in str(w.message) for w in warned)
    assert dataset.cache_address is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Dataset that wants no server hears nothing of one
        disk = from_disk(dataset_root)
    for index in DistributedSampler(dataset, num_replicas=1, rank=0):
        assert torch.equal(dataset[index].blur, disk[index].blur)


def test_the_jobs_own_server_stops_with_close(dataset_root: Path, leaves_nothing) -> None:
    """`DATA.CACHE_SHARING: job`: local rank 0 (this process, with no rank
    environment) starts the job's own server as its child; close() stops it."""
    dataset = Dataset(dataset_root, "train", overrides={**KEYS, "DATA.CACHE_SHARING": "job"})
    leaves_nothing.add(dataset.cache_address)
    assert dataset.cache_how == "started (job's)", dataset.cache_how
    assert "-ds" not in dataset.cache_address, dataset.cache_address
    disk = from_disk(dataset_root)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    for batch, index in zip(DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=2), sampler):
        assert torch.equal(batch.blur, disk[index].blur)
    assert servers_of(dataset.cache_address)
    dataset.close()
    wait_until("the job's server stops with close()", lambda: not servers_of(dataset.cache_address))
