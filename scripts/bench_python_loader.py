#!/usr/bin/env python3
"""The PyTorch training-loader shape of ../shared/baselines/torch_loader.py with the
`vrtspike` package's Dataset (`make bench-python`, docs/benchmarks.md).

Rank processes forked from this one (as the peer's, as under torchrun), each with
its own DataLoader (`--workers` worker processes, `--prefetch` batches each,
persistent workers, batch `--batch`) over `vrtspike.data.Dataset` of `--root` with
clip `--clip`, crop `--crop`, `--bins` voxel bins, and vrtspike's
`DistributedSampler` (shuffled from `--seed`, the tail dropped); every worker of
every rank reads through the one node-shared cache server (`--cache-gb` cap, the
planned policy), which the parent starts (it makes a Dataset first) and stops.

Prints one JSON line, as the peer does: samples per second over the last epoch (all
ranks together), the epoch times, and the server's hit rate and Pss-relevant size
(its bytes held) before it stops. Measure the memory from outside with
shared/tools/pss-tree.
"""
import argparse
import json
import multiprocessing as mp
import os
import time

import torch
from torch.utils.data import DataLoader

from vrtspike.data import Dataset, DistributedSampler


def keys(args):
    return {
        "DATA.CLIP_LEN": args.clip, "DATA.CROP_SIZE": args.crop, "DATA.SPIKE_BINS": args.bins,
        "DATA.CACHE_SIZE_GB": args.cache_gb, "DATA.CACHE_POLICY": args.policy, "TRAIN.SEED": args.seed,
    }


def run_rank(rank, args, queue):
    torch.set_num_threads(1)
    dataset = Dataset(args.root, args.split, overrides=keys(args))
    sampler = DistributedSampler(dataset, num_replicas=args.ranks, rank=rank, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        prefetch_factor=args.prefetch if args.workers else None,
                        persistent_workers=args.workers > 0, drop_last=True)
    times, count = [], 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        count = 0
        for batch in loader:
            count += batch.blur.shape[0]
        times.append(time.perf_counter() - t0)
    del loader
    dataset.close()
    queue.put({"rank": rank, "epoch_s": times, "samples_last_epoch": count})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--split", default="train")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--clip", type=int, default=6)
    p.add_argument("--crop", type=int, default=256)
    p.add_argument("--bins", type=int, default=32)
    p.add_argument("--cache-gb", type=float, default=2.0)
    p.add_argument("--policy", choices=("planned", "lru"), default="planned")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    # The server stops with the last of this job's connections.
    os.environ.setdefault("VRTSPIKE_CACHE_LINGER_S", "0")
    holder = Dataset(args.root, args.split, overrides=keys(args))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, args, queue)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    results = [queue.get() for _ in procs]
    for pr in procs:
        pr.join()
    stats = holder.cache_stats() or {}
    how = holder.cache_how
    holder.close()
    last = max(r["epoch_s"][-1] for r in results)
    samples = sum(r["samples_last_epoch"] for r in results)
    print(json.dumps({
        "loader": "vrtspike.data.Dataset",
        "cache": how,
        "ranks": args.ranks, "workers_per_rank": args.workers,
        "samples_last_epoch": samples,
        "samples_per_s": round(samples / last, 3) if last > 0 else None,
        "epoch_s": [r["epoch_s"] for r in sorted(results, key=lambda r: r["rank"])],
        "cache_hit_rate": stats.get("hit_rate"),
        "cache_bytes_used": stats.get("bytes_used"),
    }))


if __name__ == "__main__":
    main()
