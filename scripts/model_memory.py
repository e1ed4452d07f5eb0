#!/usr/bin/env python3
"""Model time and memory against PyTorch (`make bench-model`, issue 10).

Runs `vrtspike profile --json` on the published VRT GoPro config, one 6x64x64 clip,
forward + backward, each in a process of its own (its peak RSS read from wait4):
first as vrtspike ran before this issue (glibc's own heap rule, no huge pages), then
with its default heap policy and activation checkpointing off and on. Prints them
beside the reference VRT's figures in PyTorch 2.11 eager measured on this machine
(2 cores, 2 threads), and the per-stage forward/backward time and peak memory of the
run without checkpointing.
Standard library only.
"""
import argparse
import json
import os
import subprocess
import sys

# The reference VRT (JingyunLiang/VRT) in PyTorch 2.11 eager on this machine, same
# shape and threads (issue 10's table).
PYTORCH = {
    "off": {"seconds": 42.3, "peak_gb": 17.2},
    "on": {"seconds": 46.4, "peak_gb": 7.4},
}
GOPRO = "configs/deblur/vrt_gopro_deblur.yaml"
# (name, checkpointing, config, environment): the first is the heap before issue 10.
RUNS = (
    ("before", "off", GOPRO,
     {"VRTSPIKE_MMAP_THRESHOLD": "glibc", "THP_MEM_ALLOC_ENABLE": "0"}),
    ("now", "off", GOPRO, {}),
    ("now", "on", "configs/deblur/vrt_gopro_deblur_ckpt.yaml", {}),
)


def profile(binary, config, size, threads, extra_env):
    """The profile's JSON object and the process's peak RSS in bytes."""
    cmd = [binary, "profile", "--config", config, "--size", str(size),
           "--iters", "1", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **extra_env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {os.waitstatus_to_exitcode(status)})")
    start, end = out.find("{"), out.rfind("}")
    if start < 0:
        sys.exit(f"{' '.join(cmd)}: no JSON object in its output")
    return json.loads(out[start:end + 1]), usage.ru_maxrss * 1024


def gb(value):
    return "-" if value is None else f"{value / 1e9:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default="target/release/vrtspike")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="write the profiles and the table here as JSON")
    args = parser.parse_args()
    results = []
    for name, flags, config, env in RUNS:
        print(f"profiling {config} ({name}, checkpointing {flags}) ...", flush=True)
        prof, peak = profile(args.bin, config, args.size, args.threads, env)
        seconds = (prof["forward_ms"] + (prof["backward_ms"] or 0.0)) / 1e3
        results.append({"run": name, "checkpointing": flags, "env": env,
                        "profile": prof, "seconds": seconds, "peak_bytes": peak})
    before = results[0]["seconds"]
    print(f"\nVRT GoPro, 1x{prof['input'][1]}x{args.size}x{args.size}, forward + backward, "
          f"{args.threads} threads; PyTorch 2.11 eager measured on this machine")
    print(f"{'run':<7} {'checkpointing':<14} {'vrtspike s':>11} {'peak GB':>8} "
          f"{'PyTorch s':>10} {'peak GB':>8}  targets")
    for r in results:
        ref = PYTORCH[r["checkpointing"]]
        verdict = ""
        if r["run"] == "now":
            limit = before if r["checkpointing"] == "off" else ref["seconds"]
            ok_mem = r["peak_bytes"] / 1e9 <= ref["peak_gb"]
            verdict = (f"memory {'met' if ok_mem else 'MISSED'}, "
                       f"time {'met' if r['seconds'] <= limit else 'MISSED'} (<= {limit:.1f} s)")
        print(f"{r['run']:<7} {r['checkpointing']:<14} {r['seconds']:>11.1f} "
              f"{gb(r['peak_bytes']):>8} {ref['seconds']:>10.1f} {ref['peak_gb']:>8.1f}  {verdict}")
    first = results[1]["profile"]
    print("\nper part, checkpointing off (ms; peak GB of the process while the part ran)")
    print(f"{'part':<16} {'forward':>9} {'peak':>6} {'backward':>9} {'peak':>6}")
    for row in first["parts"]:
        back = row["backward_ms"]
        print(f"{row['part']:<16} {row['forward_ms']:>9.0f} {gb(row['forward_peak_bytes']):>6} "
              f"{'-' if back is None else f'{back:.0f}':>9} "
              f"{gb(row['backward_peak_bytes']):>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"pytorch": PYTORCH, "vrtspike": results}, f, indent=1)


if __name__ == "__main__":
    main()
