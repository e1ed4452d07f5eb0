"""Fixtures of the vrtspike package's tests: a small synthetic GoPro-Spike set made
by `vrtspike synth` (``VRTSPIKE_TEST_BIN``, else the repository's debug build),
servers that never linger, and after every test the check that nothing is left
behind: no cache server of the test's addresses alive, no socket of theirs, no new
file in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Iterator, List

import pytest

REPO = Path(__file__).resolve().parents[3]


def vrtspike_bin() -> Path:
    """The `vrtspike` binary (synth, bench loader)."""
    named = os.environ.get("VRTSPIKE_TEST_BIN")
    path = Path(named) if named else REPO / "target" / "debug" / "vrtspike"
    if not path.is_file():
        pytest.fail(f"{path}: no vrtspike binary (run `make test-python`, or set VRTSPIKE_TEST_BIN)")
    return path


def synth(out: Path, *extra: str) -> Path:
    """A synthetic dataset at 64x96 in `out`."""
    subprocess.run(
        [str(vrtspike_bin()), "synth", "--out", str(out), "--height", "64", "--width", "96", *extra],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


@pytest.fixture(scope="session")
def dataset_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 training sequences of 10 frames."""
    return synth(tmp_path_factory.mktemp("ds") / "root", "--seqs", "2", "--test-seqs", "1", "--frames", "10")


def shm_entries() -> set:
    return set(os.listdir("/dev/shm"))


def unix_sockets() -> str:
    return Path("/proc/net/unix").read_text()


def servers_of(address: str) -> List[int]:
    """Pids of live (not zombie) vrtspike-cache processes serving `address`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "stat").read_text()
        except OSError:
            continue
        state = status.rsplit(")", 1)[-1].split()[0]
        if state != "Z" and address.encode() in cmdline and any(b"vrtspike-cache" in a for a in cmdline[:1]):
            pids.append(int(entry.name))
    return pids


def wait_until(what: str, done, timeout: float = 20.0) -> None:
    """Polls `done` until true, failing with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.05)


class Addresses:
    """The cache addresses a test used, checked after it."""

    def __init__(self) -> None:
        self.seen: set = set()

    def add(self, address) -> None:
        if address:
            self.seen.add(address)


@pytest.fixture(autouse=True)
def leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Addresses]:
    """Servers stop with their last client; after the test no server of its
    addresses lives, no socket of theirs is bound, and /dev/shm holds nothing new."""
    monkeypatch.setenv("VRTSPIKE_CACHE_LINGER_S", "0")
    monkeypatch.delenv("VRTSPIKE_CACHE_ADDR", raising=False)
    before = shm_entries()
    addresses = Addresses()
    yield addresses
    import gc

    gc.collect()
    for address in addresses.seen:
        wait_until(f"the cache server at {address} exits", lambda: not servers_of(address))
        wait_until(f"no socket of {address} is bound", lambda: address not in unix_sockets())
    wait_until(f"/dev/shm holds nothing new (has {shm_entries() - before})", lambda: not (shm_entries() - before))
