"""Type stubs of the extension module vrtspike._native (crates/py/src). Use it
through vrtspike.data; these names are its foundation."""

from os import PathLike
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

BUILD_ID: str
"""The build of the sources this extension (and the vrtspike-cache it starts) came from."""
SERVER_ENV: str
"""The environment variable naming another vrtspike-cache binary."""

class VrtspikeError(Exception):
    """Base of every error of the vrtspike package."""

class ConfigError(VrtspikeError):
    """A config file, key or override that cannot be used (the message names them)."""

class DataError(VrtspikeError):
    """A dataset file that cannot be read or decoded (the message names the file)."""

class CacheError(VrtspikeError):
    """The node's cache server failed in a way a read cannot go around."""

_F32 = npt.NDArray[np.float32]
_Info = Dict[str, object]

class NativeDataset:
    def __init__(
        self,
        split: str,
        config: Union[str, PathLike[str], None] = None,
        overrides: Sequence[str] = ...,
        train: Optional[bool] = None,
        server_binary: Union[str, PathLike[str], None] = None,
        decided: Optional[Tuple[Optional[str], str]] = None,
    ) -> None: ...
    def __len__(self) -> int: ...
    def sample(
        self,
        clip: int,
        epoch: int,
        rank: int,
        position: int,
        order: Optional[Tuple[int, int, bool, bool]] = None,
        worker: Optional[Tuple[int, int]] = None,
    ) -> Tuple[_F32, _F32, _F32, _Info]: ...
    def reader_stats(self) -> Dict[str, Union[int, bool]]: ...
    def cache_stats_json(self) -> Optional[str]: ...
    def close(self) -> None: ...
    def config_yaml(self) -> str: ...
    @property
    def cache_address(self) -> Optional[str]: ...
    @property
    def cache_how(self) -> str: ...
    @property
    def job(self) -> str: ...
    @property
    def warnings(self) -> List[str]: ...
    @property
    def seed(self) -> int: ...
    @property
    def drop_last(self) -> bool: ...
    @property
    def train(self) -> bool: ...

class NativeSampler:
    def __init__(
        self, length: int, world: int, rank: int, seed: int, shuffle: bool = True, drop_last: bool = False
    ) -> None: ...
    def epoch_indices(self, epoch: int) -> List[int]: ...
    def num_samples(self) -> int: ...
