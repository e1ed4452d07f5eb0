#!/usr/bin/env python3
"""Spike study (`make bench-spike`, issue 10): does the spike branch help VRT-Spike?

Trains one config twice with the real trainer (vrtspike-launch), spikes on
(`MODEL.SPIKE.ENABLED=true`) and off (`false`), same data, steps and seed, then
prints one table from each run's result.json: arm, validation PSNR / SSIM, the
blurred input's PSNR over the same frames, the gain over the input, and the
spike arm's margin over the spike-off arm. `--table-only` reprints the table
of runs already made. Standard library only.

  spike_study.py --launch target/release/vrtspike-launch \
      --config configs/study/vrt_spike_study.yaml --out runs/spike-study \
      [--ranks 2] [--set KEY=VALUE ...] [--table-only]
"""
import argparse
import json
import os
import subprocess
import sys
import time

ARMS = (("spikes on", "spike-on", "true"), ("spikes off", "spike-off", "false"))
# The margin the issue asks of the spike arm over the spike-off arm, dB.
TARGET_MARGIN_DB = 0.5


def train(args, run_dir, enabled):
    """One arm through the launcher; returns its wall time in seconds."""
    cmd = [args.launch, "--gpus", "0", "--ranks", str(args.ranks),
           "--config", args.config, "--run-dir", run_dir,
           "--set", f"MODEL.SPIKE.ENABLED={enabled}"]
    for spec in args.set:
        cmd += ["--set", spec]
    print("+ " + " ".join(cmd), flush=True)
    start = time.monotonic()
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        sys.exit(f"{run_dir}: vrtspike-launch exited with {done.returncode}")
    return time.monotonic() - start


def result(run_dir):
    """Rank 0's summary of the run (result.json), with a validation."""
    path = os.path.join(run_dir, "result.json")
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError) as err:
        sys.exit(f"{path}: {err}")
    for key in ("val_psnr", "val_ssim", "input_psnr"):
        if summary.get(key) is None:
            sys.exit(f"{path}: no {key} (did the run validate at its last step?)")
    return summary


def table(rows):
    """Prints the arms, their figures and the spike arm's margin."""
    print(f"{'arm':<12}{'steps':>7}{'val PSNR':>10}{'SSIM':>8}{'input PSNR':>12}"
          f"{'vs input':>10}{'wall s':>8}")
    for label, s in rows:
        gain = s["val_psnr"] - s["input_psnr"]
        print(f"{label:<12}{s['steps']:>7}{s['val_psnr']:>10.2f}{s['val_ssim']:>8.4f}"
              f"{s['input_psnr']:>12.2f}{gain:>+10.2f}{s['wall_s']:>8.0f}")
    margin = rows[0][1]["val_psnr"] - rows[1][1]["val_psnr"]
    verdict = "met" if margin >= TARGET_MARGIN_DB else "MISSED"
    print(f"spikes on - spikes off: {margin:+.2f} dB "
          f"(target >= +{TARGET_MARGIN_DB} dB: {verdict})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", default="target/release/vrtspike-launch")
    p.add_argument("--config", default="configs/study/vrt_spike_study.yaml")
    p.add_argument("--out", default="runs/spike-study")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    rows = []
    for label, name, enabled in ARMS:
        run_dir = os.path.join(args.out, name)
        if not args.table_only:
            if os.path.exists(run_dir):
                sys.exit(f"{run_dir} exists (a run dir resumes); remove it or pick --out")
            wall = train(args, run_dir, enabled)
            print(f"{label}: {wall:.0f} s wall", flush=True)
        rows.append((label, result(run_dir)))
    table(rows)


if __name__ == "__main__":
    main()
