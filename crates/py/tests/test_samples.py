"""The Dataset's samples are `vrtspike bench loader`'s, bit for bit; its extension
maps no libtorch; bad input raises exceptions that name what is at fault."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import vrtspike
from vrtspike.data import Dataset, DistributedSampler

from conftest import synth

SEED = 7
KEYS = {"DATA.CLIP_LEN": 3, "DATA.CROP_SIZE": 32, "DATA.SPIKE_BINS": 4, "DATA.AUGMENT": True, "TRAIN.SEED": SEED}


def dumped(root: Path, out: Path) -> list:
    """The samples 2 loader ranks x 2 workers hand out over 2 epochs (the
    loader benchmark of the package's own vrtspike-cache, which `vrtspike bench
    loader` is)."""
    subprocess.run(
        [str(vrtspike.data.server_binary()), "bench", "loader", "--json", "--root", str(root), "--ranks", "2", "--workers", "2",
         "--clip", "3", "--crop", "32", "--bins", "4", "--epochs", "2", "--augment", "--seed", str(SEED),
         "--no-cache", "--dump-samples", str(out)],
        check=True, stdout=subprocess.DEVNULL,
    )
    lines = []
    for rank in (0, 1):
        lines += [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    return lines


def test_samples_equal_the_loaders(dataset_root: Path, tmp_path: Path, leaves_nothing) -> None:
    lines = dumped(dataset_root, tmp_path / "dump")
    assert len(lines) > 8
    dataset = Dataset(dataset_root, "train", overrides=KEYS)
    leaves_nothing.add(dataset.cache_address)
    assert dataset.cache_how == "started (node-shared)"
    samplers = {r: DistributedSampler(dataset, num_replicas=2, rank=r, drop_last=True) for r in (0, 1)}
    orders = {}
    for line in lines:
        key = (line["rank"], line["epoch"])
        if key not in orders:
            samplers[line["rank"]].set_epoch(line["epoch"])
            orders[key] = list(samplers[line["rank"]])
        index = orders[key][line["position"]]
        sample, info = dataset.item(index)
        assert info.sequence == line["sequence"] and info.frames == line["frames"], line
        assert list(info.crop) == line["crop"] and list(info.transform) == line["transform"], line
        values = np.fromfile(tmp_path / "dump" / line["file"], dtype="<f4")
        ours = torch.cat([sample.blur.flatten(), sample.sharp.flatten(), sample.voxel.flatten()]).numpy()
        assert list(sample.blur.shape) == line["rgb_shape"] and list(sample.voxel.shape) == line["voxel_shape"]
        assert np.array_equal(values.view(np.uint32), ours.view(np.uint32)), f"sample {line['file']} differs"
    assert dataset.reader_stats()["connected"]
    dataset.close()


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_dataloader_workers_give_the_same_samples(dataset_root: Path, leaves_nothing, start: str) -> None:
    """2 workers (forked, or spawned: they rebuild the Dataset from the main
    process's choice of server) with persistent_workers and pin_memory, 2 epochs:
    each batch holds the samples the main process draws at the same places."""
    dataset = Dataset(dataset_root, "train", overrides=KEYS)
    leaves_nothing.add(dataset.cache_address)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, persistent_workers=True,
                        pin_memory=True, multiprocessing_context=start)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        seen = 0
        for batch_no, batch in enumerate(loader):
            for j in range(batch.blur.shape[0]):
                expected = dataset[indices[2 * batch_no + j]]
                assert torch.equal(batch.blur[j], expected.blur)
                assert torch.equal(batch.voxel[j], expected.voxel)
                seen += 1
        assert seen == len(indices)
    stats = dataset.cache_stats()
    assert stats["totals"]["hits"] > 0, stats["totals"]
    del loader
    dataset.close()


def test_extension_maps_no_libtorch() -> None:
    native = vrtspike._native.__file__
    linked = subprocess.run(["ldd", native], check=True, capture_output=True, text=True).stdout
    assert "libhdf5" in linked, linked
    for library in ("libtorch", "libc10"):
        assert library not in linked, f"{native} links {library}:\n{linked}"


def test_config_errors_name_the_key(dataset_root: Path) -> None:
    with pytest.raises(vrtspike.ConfigError, match="DATA.CROP_SZ"):
        Dataset(dataset_root, "train", overrides={"DATA.CROP_SZ": 32})
    with pytest.raises(vrtspike.ConfigError, match="nowhere"):
        Dataset(dataset_root / "nowhere", "train")
    with pytest.raises(vrtspike.ConfigError, match="missing.yaml"):
        vrtspike.data.from_config(dataset_root / "missing.yaml", "train")
    with pytest.raises(vrtspike.ConfigError, match="DATA.CLIP_LEN"):
        Dataset(dataset_root, "train", overrides={"DATA.CLIP_LEN": 50, "DATA.USE_RAM_CACHE": False})


def test_bad_index_is_an_exception(dataset_root: Path) -> None:
    dataset = Dataset(dataset_root, "train", overrides={**KEYS, "DATA.USE_RAM_CACHE": False})
    assert dataset.cache_address is None
    with pytest.raises(vrtspike.VrtspikeError, match="clip"):
        dataset[len(dataset) + 5]
    with pytest.raises(TypeError):
        dataset["0"]


def test_from_config_reads_the_base_chain(dataset_root: Path, tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(f"DATA:\n  ROOT: {dataset_root}\n  CLIP_LEN: 4\n  USE_RAM_CACHE: false\n")
    (tmp_path / "run.yaml").write_text("BASE: base.yaml\nDATA:\n  CROP_SIZE: 16\n")
    dataset = vrtspike.data.from_config(tmp_path / "run.yaml", "train")
    sample = dataset[0]
    assert sample.blur.shape == (4, 3, 16, 16)
    assert dataset.cache_address is None


def test_hdf5_sessions_give_the_folder_layouts_samples(dataset_root: Path, tmp_path: Path, leaves_nothing) -> None:
    """`vrtspike synth --h5` writes the same data as HDF5 sessions (probed in a
    child of the package's vrtspike-cache): the same samples, through the cache."""
    h5_root = synth(tmp_path / "h5", "--h5", "--seqs", "2", "--test-seqs", "1", "--frames", "10")
    sessions = Dataset(h5_root, "train", overrides=KEYS)
    leaves_nothing.add(sessions.cache_address)
    folders = Dataset(dataset_root, "train", overrides={**KEYS, "DATA.USE_RAM_CACHE": False})
    assert len(sessions) == len(folders)
    for index in DistributedSampler(folders, num_replicas=1, rank=0):
        ours, theirs = sessions[index], folders[index]
        for name in ("blur", "sharp", "voxel"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), (index, name)
    assert sessions.reader_stats()["misses"] > 0
    sessions.close()
