#!/usr/bin/env python3
"""Gradient averaging on a slow link (issue 22, `make bench-link`).

Trains the tiny VRT-Spike (configs/study/vrt_spike_study.yaml: the demo set, 32-pixel
crops, 4 clips of 2 frames a rank) for a few steps on 2 ranks with Gloo, three ways in
one run, same seed and data:

  after_backward  flat buckets all-reduced one after another once backward is done
  reducer         PyTorch DDP's c10d::Reducer, each bucket's all-reduce overlapping backward
  reducer+bf16    the Reducer with gradients cast to bfloat16 for the all-reduce
  reducer-1MiB    the Reducer with 1 MiB buckets (DIST.BUCKET_CAP_MB=1): the tiny model's
                  7 MB of gradients fill PyTorch's default 1 MiB + 25 MiB buckets in two,
                  the second ready only at backward's end

on two links: two network namespaces joined by a veth pair shaped to 100 Mbit/s
(`tc qdisc ... tbf rate 100mbit`; one `vrtspike-launch --nnodes 2` and one CPU rank in
each, standing for two nodes on an ordinary network) and loopback (both ranks in one
launcher). Every rank has one thread (OMP_NUM_THREADS=1): both share the machine's
cores. Prints, per link and way, the step time and the exposed communication (the
gradient all-reduce time backward did not hide) from rank 0's `train` lines of
metrics.jsonl, skipping the first window (warm-up, bucket rebuild), and writes them as
JSON. Needs root and iproute2 for the slow link; without them it says so and runs
loopback only.

  slow_link_bench.py --launch target/release/vrtspike-launch --out bench-out/link \\
      [--steps 24] [--links slow,loopback]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

CONFIG = "configs/study/vrt_spike_study.yaml"
WAYS = [
    ("after_backward", ["DIST.GRAD_SYNC=after_backward"]),
    ("reducer", ["DIST.GRAD_SYNC=reducer"]),
    ("reducer+bf16", ["DIST.GRAD_SYNC=reducer", "DIST.GRAD_COMPRESSION=bf16"]),
    ("reducer-1MiB", ["DIST.GRAD_SYNC=reducer", "DIST.BUCKET_CAP_MB=1"]),
]
NODE_ADDRS = ("10.215.0.1", "10.215.0.2")
RATE = "100mbit"


def ip(*args):
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class TwoNodes:
    """Two network namespaces joined by a veth pair shaped to RATE both ways."""

    def __init__(self):
        tag = os.getpid()
        self.ns = (f"vslk{tag}a", f"vslk{tag}b")
        self.veth = (f"vla{tag}", f"vlb{tag}")

    def __enter__(self):
        try:
            for ns in self.ns:
                ip("netns", "add", ns)
            ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for ns, veth, addr in zip(self.ns, self.veth, NODE_ADDRS):
                ip("link", "set", veth, "netns", ns)
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                ip("-n", ns, "link", "set", veth, "up")
                ip("-n", ns, "link", "set", "lo", "up")
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth,
                                "root", "tbf", "rate", RATE, "burst", "64kb", "latency", "50ms"],
                               check=True, capture_output=True)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for ns in self.ns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def why_no_slow_link():
    if os.geteuid() != 0:
        return "not root (network namespaces need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (install iproute2)"
    return None


def launch_args(args, run_dir, sets):
    cmd = [args.launch, "--gpus", "0", "--config", CONFIG, "--run-dir", run_dir,
           "--max-restarts", "0",
           "--set", f"TRAIN.TOTAL_STEPS={args.steps}",
           "--set", f"TRAIN.WARMUP_STEPS={min(5, args.steps)}",
           "--set", f"LOG.LOG_EVERY_STEPS={args.window}",
           "--set", f"LOG.VAL_EVERY_STEPS={args.steps * 10}",
           "--set", f"LOG.CKPT_EVERY_STEPS={args.steps * 10}"]
    for spec in sets:
        cmd += ["--set", spec]
    return cmd


def run_slow(args, nodes, run_dir, sets, port):
    procs = []
    for node in (0, 1):
        cmd = ["ip", "netns", "exec", nodes.ns[node]] + launch_args(args, run_dir, sets) + [
            "--ranks", "1", "--nnodes", "2", "--node-rank", str(node),
            "--master-addr", NODE_ADDRS[0], "--master-port", str(port)]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=nodes.veth[node])
        log = open(os.path.join(args.out, f"{os.path.basename(run_dir)}-node{node}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = [p.wait() for p, _ in procs]
    for _, log in procs:
        log.close()
    if any(codes):
        sys.exit(f"{run_dir}: launchers exited with {codes} (logs in {args.out})")


def run_loopback(args, run_dir, sets):
    cmd = launch_args(args, run_dir, sets) + ["--ranks", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(os.path.join(args.out, f"{os.path.basename(run_dir)}.log"), "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        sys.exit(f"{run_dir}: vrtspike-launch exited with {code} (log in {args.out})")


def figures(run_dir):
    """Mean step and exposed-communication time over rank 0's train lines after the first."""
    lines = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "train":
                lines.append(row)
    if len(lines) < 2:
        sys.exit(f"{run_dir}: fewer than 2 train lines in metrics.jsonl")
    kept = lines[1:]
    step = sum(r["step_time_ms"] for r in kept) / len(kept)
    comm = sum(r["comm_time_ms"] for r in kept) / len(kept)
    return {"step_ms": step, "comm_ms": comm, "comm_share": comm / step if step else 0.0,
            "steps_measured": kept[-1]["step"] - lines[0]["step"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", default="target/release/vrtspike-launch")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--window", type=int, default=4, help="steps per train line")
    p.add_argument("--links", default="slow,loopback")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    links = args.links.split(",")
    if "slow" in links and (why := why_no_slow_link()):
        print(f"slow link skipped: {why}")
        links.remove("slow")
    results = {}
    port = 29750
    for link in links:
        for name, sets in WAYS:
            run_dir = os.path.join(args.out, f"{link}-{name.replace('+', '-')}")
            shutil.rmtree(run_dir, ignore_errors=True)
            started = time.time()
            if link == "slow":
                with TwoNodes() as nodes:
                    run_slow(args, nodes, run_dir, sets, port)
            else:
                run_loopback(args, run_dir, sets)
            port += 1
            row = figures(run_dir)
            row["wall_s"] = time.time() - started
            results[f"{link}/{name}"] = row
            print(f"{link:8} {name:15} step {row['step_ms']:8.1f} ms   exposed comm "
                  f"{row['comm_ms']:7.1f} ms ({100 * row['comm_share']:4.1f}%)", flush=True)
    with open(os.path.join(args.out, "link-bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"written {os.path.join(args.out, 'link-bench.json')}")


if __name__ == "__main__":
    main()
