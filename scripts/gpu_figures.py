#!/usr/bin/env python3
"""The figures of a GPU run (scripts/gpu_run.sh OUT_DIR), one line each, from the
JSON of its parts, the training run's metrics.jsonl and nvidia-smi dmon's lines:

- the GPU suite's result;
- each profile: forward + backward, and the whole training step with each AdamW
  kernel timed (the update's share: norm, clipping, AdamW, zeroing);
- training: the mean step time after the first window against the profiled forward +
  backward of the same model (issue 34's goal: at most 1.05x), host reads per
  window, dmon's SM busy share over the training steps against the trainer's own
  NVML figure over the same windows, the validation's time and its idle dmon seconds;
- the table of issue 34: vrtspike's whole step against PyTorch eager and
  torch.compile, both with the fused AdamW (time, peak memory).

    python3 scripts/gpu_figures.py OUT_DIR
"""
import datetime
import json
import os
import sys

GIB = 2**30


def load(out, name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def records(path):
    """The JSON lines of a metrics.jsonl (bad lines left out)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def dmon_seconds(path):
    """(unix time, SM %) of every dmon line `YYYYMMDD HH:MM:SS gpu sm ...`."""
    rows = []
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return rows
    for line in lines:
        parts = line.split()
        if len(parts) < 4 or line.startswith("#"):
            continue
        try:
            when = datetime.datetime.strptime(parts[0] + parts[1], "%Y%m%d%H:%M:%S")
            rows.append((when.timestamp(), float(parts[3])))
        except ValueError:
            continue
    return rows


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def tests_line(out):
    tests = load(out, "tests.json")
    if not tests:
        return
    print(f"tests: {len(tests['passed'])} passed, {len(tests['failed'])} failed {tests['failed']}; {tests['result']}")
    for line in tests.get("figures", []):
        print("  " + line)


def profile_lines(out):
    for name in ("baseline-ckpt", "gopro-ckpt"):
        p = load(out, f"profile-{name}.json")
        if not p:
            continue
        peak = (p.get("cuda_peak") or {}).get("allocated_bytes") or p.get("peak_rss_bytes") or 0
        print(f"profile {name:14s} fwd {p['forward_ms']:9.1f} ms  bwd {p['backward_ms']:9.1f} ms  "
              f"fwd+bwd {p['forward_ms'] + p['backward_ms']:9.1f} ms  peak {peak / GIB:6.2f} GiB  params {p['total_params']}")
        for t in p.get("train_steps", []):
            peak = (t.get("peak_bytes") or 0) / GIB
            print(f"  training step, {t['optimizer']:7s} AdamW: {t['step_ms']:9.1f} ms (min {t['step_min_ms']:.1f}), "
                  f"update {t['update_ms']:8.2f} ms over {t['tensors']} tensors, peak {peak:6.2f} GiB")


def train_lines(out):
    recs = records(os.path.join(out, "train-run", "metrics.jsonl"))
    train = [r for r in recs if r.get("kind") == "train"]
    if not train:
        return
    later = train[1:] or train
    step_ms = mean(r["step_time_ms"] for r in later)
    print(f"train: {train[-1]['step']} steps, step {step_ms:.1f} ms (mean of the windows after the first), "
          f"host reads per window {[r.get('host_reads') for r in train]}")
    profile = load(out, "profile-baseline-ckpt.json")
    if profile:
        fwd_bwd = profile["forward_ms"] + profile["backward_ms"]
        print(f"  step / profiled forward+backward of the same model: {step_ms / fwd_bwd:.3f}x (goal <= 1.05)")
    dmon = dmon_seconds(os.path.join(out, "dmon.txt"))
    # The training steps: from the end of the first window to the last train line.
    begin, end = train[0]["time"], train[-1]["time"]
    busy = [sm for t, sm in dmon if begin <= t <= end]
    first, last = train[0]["step"], train[-1]["step"]
    memory = [r for r in recs if r.get("kind") == "memory" and first < r.get("step", 0) <= last]
    trainer = mean(r["gpu_util_pct"] for r in memory if r.get("gpu_util_pct") is not None)
    if busy:
        low = sum(1 for sm in busy if sm < 90)
        print(f"  dmon SM busy over the training steps: {mean(busy):.1f}% of {len(busy)} s "
              f"({low} s under 90%; goal >= 95%); the trainer's NVML figure: "
              + (f"{trainer:.1f}% (goal: within 5 points)" if trainer is not None else "none"))
    elif trainer is not None:
        print(f"  the trainer's NVML figure over the training steps: {trainer:.1f}% (no dmon)")
    for val in (r for r in recs if r.get("kind") == "val"):
        seconds = val.get("val_s", 0.0)
        inside = [sm for t, sm in dmon if val["time"] - seconds <= t <= val["time"]]
        idle = sum(1 for sm in inside if sm == 0)
        psnr, ssim = val.get("val_psnr") or float("nan"), val.get("val_ssim") or float("nan")
        print(f"  validation of {val.get('frames')} frames: {seconds:.1f} s (goal <= 16 s), PSNR {psnr:.2f} dB, "
              f"SSIM {ssim:.4f}" + (f"; dmon: {idle} of {len(inside)} s at 0%" if inside else ""))


def table_lines(out):
    p = load(out, "profile-gopro-ckpt.json")
    rows = []
    fused = [t for t in (p or {}).get("train_steps", []) if t["optimizer"] == "fused"]
    if fused:
        t = fused[0]
        rows.append(("vrtspike, fused AdamW", t["step_ms"], (t.get("peak_bytes") or 0) / GIB, None))
    for name in ("reference-ckpt", "reference-ckpt-compile"):
        r = load(out, f"{name}.json")
        if r:
            optimizer = r.get("optimizer", "none")
            label = ("torch.compile" if r.get("compile") else "PyTorch eager") + (
                f", {optimizer} AdamW" if optimizer != "none" else ", no optimizer step")
            peak = r.get("peak_allocated_mb", r.get("peak_rss_mb", 0)) / 1024
            rows.append((label, r["median_ms"], peak, r.get("compile_s")))
    if not rows:
        return
    print("VRT GoPro config, 6 x 256 x 256, checkpointing, one training step:")
    for label, ms, peak, compile_s in rows:
        extra = f" (compile {compile_s:.0f} s)" if compile_s else ""
        print(f"  {label:28s} {ms:9.1f} ms  peak {peak:6.2f} GiB{extra}")


def main():
    out = sys.argv[1]
    tests_line(out)
    profile_lines(out)
    train_lines(out)
    table_lines(out)
    s = load(out, "train-summary.json")
    if s:
        print("train summary:", json.dumps(s)[:1500])


if __name__ == "__main__":
    main()
