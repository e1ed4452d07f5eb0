"""A GoPro-Spike split as a ``torch.utils.data.Dataset``, read through the node's
shared-memory cache server, returning the samples vrtspike's own loader returns.

``Dataset`` opens a split of the dataset that a vrtspike run config names
(``from_config(path, split)`` reads the same YAML files ``vrtspike train`` reads,
``BASE`` chains included) and cuts each sample as the trainer does: a clip of
``DATA.CLIP_LEN`` frames, a random ``DATA.CROP_SIZE`` crop aligned between the RGB
frames and the spike grid, ``DATA.SPIKE_BINS`` voxel bins, ``DATA.AUGMENT``'s
flips and rotations, all drawn from ``TRAIN.SEED``, the epoch, the rank and the
sample's position. With ``DistributedSampler`` (vrtspike's order, with
``torch.utils.data.DistributedSampler``'s arguments) a DataLoader gets the very
samples, bit for bit, that the Rust loader gives the same rank.

Records are read through the node's cache server of this user and dataset
(``DATA.CACHE_SHARING``): the process that makes the Dataset attaches to it, or
starts it when none runs, and every DataLoader worker connects to it on its own
after the fork. Where no server can be had the Dataset reads from disk and says so
with a ``RuntimeWarning``. See docs/pytorch.md.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed
from torch.utils.data import Sampler, get_worker_info
from torch.utils.data import Dataset as _TorchDataset

from . import _native

__all__ = [
    "Dataset",
    "DistributedSampler",
    "Order",
    "Sample",
    "SampleIndex",
    "SampleInfo",
    "from_config",
    "server_binary",
]

Overrides = Union[Mapping[str, Any], Sequence[str], None]


class Sample(NamedTuple):
    """One sample: float32 tensors in (L, C, h, w) order."""

    blur: torch.Tensor
    """The blurred clip, (L, 3, h, w), values in [0, 1]."""
    sharp: torch.Tensor
    """The sharp clip, (L, 3, h, w), values in [0, 1]."""
    voxel: torch.Tensor
    """The spike voxels, (L, K, h_s, w_s), at the spike grid's resolution."""


class SampleInfo(NamedTuple):
    """What a sample is (``Dataset.item``)."""

    sequence: str
    frames: List[str]
    crop: Tuple[int, int, int, int]
    """(y, x, h, w) of the crop in the original frame, before augmentation."""
    transform: Tuple[bool, bool, bool]
    """(transpose, vflip, hflip) applied after cropping."""
    replaced: int
    """Clips replaced under ``DATA.SKIP_BAD_FRAMES`` before this one."""
    clip: int
    epoch: int
    rank: int
    position: int


class Order(NamedTuple):
    """The sampler settings of a rank's order (carried by each ``SampleIndex``)."""

    world: int
    seed: int
    shuffle: bool
    drop_last: bool


class SampleIndex(NamedTuple):
    """An index ``DistributedSampler`` yields: the clip and where it sits in the
    rank's epoch, which the sample's crop and augmentation are drawn from."""

    clip: int
    epoch: int
    rank: int
    position: int
    order: Optional[Order] = None


def server_binary() -> Optional[Path]:
    """The ``vrtspike-cache`` binary the Dataset starts servers with:
    ``$VRTSPIKE_CACHE_SERVER``, else the one the wheel ships in ``vrtspike/_bin/``."""
    named = os.environ.get(_native.SERVER_ENV)
    if named:
        return Path(named)
    shipped = Path(__file__).resolve().parent / "_bin" / "vrtspike-cache"
    return shipped if shipped.is_file() else None


def _override_specs(root: Union[str, os.PathLike, None], overrides: Overrides) -> List[str]:
    """``KEY.PATH=VALUE`` strings: strings as given, other values as JSON (a YAML
    subset: ``true``, ``null``, numbers, lists, mappings); ``root`` last."""
    specs: List[str] = []
    if overrides is None:
        pass
    elif isinstance(overrides, Mapping):
        for key, value in overrides.items():
            text = value if isinstance(value, str) else json.dumps(value)
            specs.append(f"{key}={text}")
    elif isinstance(overrides, (str, bytes)):
        raise TypeError("overrides: give a mapping or a list of 'KEY.PATH=VALUE' strings, not one string")
    else:
        specs.extend(str(spec) for spec in overrides)
    if root is not None:
        specs.append(f"DATA.ROOT={os.fspath(root)}")
    return specs


def _worker() -> Optional[Tuple[int, int]]:
    info = get_worker_info()
    return None if info is None else (info.id, info.num_workers)


class Dataset(_TorchDataset):
    """A split of a GoPro-Spike dataset (the folder layout or HDF5 sessions), as
    vrtspike's loader reads it.

    Args:
        root: the dataset root (``DATA.ROOT``); ``None`` takes the config's.
        split: the split folder, ``train`` or ``test``.
        config: a vrtspike run config (YAML, with its ``BASE`` chain); ``None``
            starts from the defaults.
        overrides: config keys over the file: a mapping ``{"DATA.CLIP_LEN": 6}``
            or ``["DATA.CLIP_LEN=6"]``, as ``vrtspike train --set``.
        train: training samples (random crops, augmentation, sliding clips) or
            validation samples (``DATA.VAL_CROP_SIZE`` centre or full-frame crops,
            no augmentation, clips that cover every frame); default: ``split ==
            "train"``.

    Indexing with a ``SampleIndex`` (what ``DistributedSampler`` yields) gives the
    Rust loader's sample at that place; with an int ``i``, the sample of clip
    ``i`` at position ``i`` of rank 0 in the epoch ``set_epoch`` set.

    Raises:
        vrtspike.ConfigError: a config file, key or override that cannot be used.
        vrtspike.DataError: a dataset file that cannot be read.
    """

    def __init__(
        self,
        root: Union[str, os.PathLike, None] = None,
        split: str = "train",
        *,
        config: Union[str, os.PathLike, None] = None,
        overrides: Overrides = None,
        train: Optional[bool] = None,
    ) -> None:
        binary = server_binary()
        self._args = {
            "split": split,
            "config": None if config is None else os.fspath(config),
            "overrides": _override_specs(root, overrides),
            "train": train,
            "server_binary": None if binary is None else os.fspath(binary),
        }
        self._native = _native.NativeDataset(**self._args)
        self._epoch = 0
        for warning in self._native.warnings:
            warnings.warn(warning, RuntimeWarning, stacklevel=2)

    def __len__(self) -> int:
        return len(self._native)

    def __getitem__(self, index: Union[SampleIndex, int]) -> Sample:
        return self.item(index)[0]

    def item(self, index: Union[SampleIndex, int]) -> Tuple[Sample, SampleInfo]:
        """The sample at ``index`` and what it is."""
        if isinstance(index, SampleIndex):
            place = index
        elif isinstance(index, int) and not isinstance(index, bool):
            place = SampleIndex(clip=index, epoch=self._epoch, rank=0, position=index)
        else:
            raise TypeError(f"index {index!r}: give an int or a vrtspike.data.SampleIndex")
        order = None if place.order is None else tuple(place.order)
        blur, sharp, voxel, info = self._native.sample(
            place.clip, place.epoch, place.rank, place.position, order, _worker()
        )
        sample = Sample(torch.from_numpy(blur), torch.from_numpy(sharp), torch.from_numpy(voxel))
        return sample, SampleInfo(**info)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose draws plain int indices get (``DistributedSampler``'s
        indices carry their own)."""
        self._epoch = int(epoch)

    @property
    def seed(self) -> int:
        """``TRAIN.SEED``."""
        return self._native.seed

    @property
    def drop_last(self) -> bool:
        """``DATALOADER.DROP_LAST``."""
        return self._native.drop_last

    @property
    def train(self) -> bool:
        """Whether it cuts training samples (else validation samples)."""
        return self._native.train

    @property
    def cache_address(self) -> Optional[str]:
        """The cache server's address; ``None`` when every read goes to disk."""
        return self._native.cache_address

    @property
    def cache_how(self) -> str:
        """How the cache server was had (``attached (node-shared)``, ``started
        (node-shared)``, ``started (job's)``, or why there is none)."""
        return self._native.cache_how

    def cache_stats(self) -> Optional[dict]:
        """The cache server's live statistics (``vrtspike cache stats --json``),
        ``None`` without a server."""
        text = self._native.cache_stats_json()
        return None if text is None else json.loads(text)

    def reader_stats(self) -> dict:
        """This process's reads: hits, misses, bypass (from disk), prefetched,
        disk_bytes, replaced, connected."""
        return self._native.reader_stats()

    def config_yaml(self) -> str:
        """The resolved run config, as YAML."""
        return self._native.config_yaml()

    def close(self) -> None:
        """Closes this process's cache connection and its hold on the server (the
        server of its own job, ``DATA.CACHE_SHARING: job``, stops)."""
        self._native.close()

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # A worker started by `spawn` or `forkserver` rebuilds the Dataset, using
        # the server this process chose (it never starts one of its own).
        state = dict(self._args)
        state["decided"] = (self._native.cache_address, self._native.job)
        return {"args": state, "epoch": self._epoch}

    def __setstate__(self, state: dict) -> None:
        self._args = {k: v for k, v in state["args"].items() if k != "decided"}
        self._native = _native.NativeDataset(**state["args"])
        self._epoch = state["epoch"]


def from_config(
    path: Union[str, os.PathLike],
    split: str = "train",
    *,
    overrides: Overrides = None,
    train: Optional[bool] = None,
) -> Dataset:
    """The Dataset of ``split`` of the dataset a vrtspike run config names (the
    YAML ``vrtspike train --config`` reads, ``BASE`` chain included), with its
    ``DATA`` keys, ``TRAIN.SEED`` and cache settings."""
    return Dataset(None, split, config=path, overrides=overrides, train=train)


def _default_world() -> Tuple[int, int]:
    """(world size, rank): the process group's, else ``WORLD_SIZE`` and ``RANK``,
    else one rank."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class DistributedSampler(Sampler[SampleIndex]):
    """vrtspike's sampler of a rank's share of a ``Dataset``: the order of
    ``vrtspike train``'s sampler for the same settings (shuffled from ``seed`` and
    the epoch, padded by wrapping around or, with ``drop_last``, cut so every rank
    gets as many), with ``torch.utils.data.DistributedSampler``'s arguments.

    It yields ``SampleIndex`` values, which carry the epoch, the rank, the position
    and the order's settings, so each sample is the Rust loader's and, under
    ``DATA.CACHE_POLICY: planned``, the workers announce the rank's order to the
    cache, which then evicts the record needed last. Call ``set_epoch`` before each
    epoch.

    Args:
        dataset: the ``vrtspike.data.Dataset``.
        num_replicas: ranks (default: the process group's size, else
            ``WORLD_SIZE``, else 1).
        rank: this rank (default: the process group's, else ``RANK``, else 0).
        shuffle: shuffle every epoch.
        seed: the shuffle's seed (default: the dataset's ``TRAIN.SEED``).
        drop_last: drop the tail of an uneven split, else pad by wrapping around
            (default: the dataset's ``DATALOADER.DROP_LAST``, as the trainer).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: Optional[int] = None,
        drop_last: Optional[bool] = None,
    ) -> None:
        world, own = _default_world()
        self.num_replicas = world if num_replicas is None else int(num_replicas)
        self.rank = own if rank is None else int(rank)
        self.shuffle = bool(shuffle)
        self.seed = dataset.seed if seed is None else int(seed)
        self.drop_last = dataset.drop_last if drop_last is None else bool(drop_last)
        self.epoch = 0
        self._native = _native.NativeSampler(
            len(dataset), self.num_replicas, self.rank, self.seed, self.shuffle, self.drop_last
        )
        self._order = Order(self.num_replicas, self.seed, self.shuffle, self.drop_last)

    def __iter__(self) -> Iterator[SampleIndex]:
        epoch, order = self.epoch, self._order
        for position, clip in enumerate(self._native.epoch_indices(epoch)):
            yield SampleIndex(clip, epoch, self.rank, position, order)

    def __len__(self) -> int:
        return self._native.num_samples()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields (its shuffle and its draws)."""
        self.epoch = int(epoch)
