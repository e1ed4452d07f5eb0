#!/usr/bin/env python3
"""Does a trained VRT-Spike use its spikes? (issue 10, spike study)

Runs a checkpoint (`vrtspike model run`) on the first two-frame clip of each test
sequence of a dataset (frames read by `vrtspike inspect`, whole 128x192 frames of the
demo set) with the real voxels and with altered ones: all zeros, a constant (their
mean), another clip's voxels, the clip's two frames swapped. Prints the PSNR of each
against the sharp frames, and the input's. A model that ignores its spike branch
scores the same on every row. Needs numpy (the venv's python).

  spike_ablation.py --bin target/release/vrtspike --config C \
      --weights RUN/checkpoints/step_N/model.safetensors --root data/demo [--bins 8]
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

DTYPES = {"F32": np.float32, "F64": np.float64, "U8": np.uint8, "I64": np.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    size = struct.unpack("<Q", raw[:8])[0]
    header, base = json.loads(raw[8:8 + size]), 8 + size
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        out[name] = np.frombuffer(raw[base + start:base + end],
                                  dtype=DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def psnr(output, target):
    mse = np.mean((np.clip(output, 0.0, 1.0) - target) ** 2)
    return 10.0 * np.log10(1.0 / mse)


def load_clips(args, tmp):
    """(blur, sharp, voxels) of frames 1-2 of every test sequence, stacked as a batch."""
    seqs = sorted(os.listdir(os.path.join(args.root, "test")))
    blur, sharp, vox = [], [], []
    for seq in seqs:
        frames = sorted(os.listdir(os.path.join(args.root, "test", seq, "blur")))[:2]
        parts = []
        for frame in frames:
            path = os.path.join(tmp, f"{seq}_{frame}.safetensors")
            subprocess.run([args.bin, "inspect", "--root", args.root, "--split", "test",
                            "--seq", seq, "--frame", os.path.splitext(frame)[0],
                            "--bins", str(args.bins), "--out", path],
                           check=True, stdout=subprocess.DEVNULL)
            parts.append(read_safetensors(path))
        blur.append(np.stack([p["blur"] for p in parts]))
        sharp.append(np.stack([p["sharp"] for p in parts]))
        vox.append(np.stack([p["voxel"] for p in parts]))
    return np.stack(blur), np.stack(sharp), np.stack(vox)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="target/release/vrtspike")
    p.add_argument("--config", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--root", default="data/demo")
    p.add_argument("--bins", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="spike-ablation-") as tmp:
        blur, sharp, vox = load_clips(args, tmp)
        if len(vox) < 2:
            sys.exit(f"{args.root}/test: need at least 2 sequences")
        variants = {
            "real": vox,
            "zeros": np.zeros_like(vox),
            "constant (mean)": np.full_like(vox, vox.mean()),
            "another clip's": np.roll(vox, 1, axis=0),
            "frames swapped": vox[:, ::-1],
        }
        print(f"{'voxels':<18}{'PSNR':>8}")
        print(f"{'(blurred input)':<18}{psnr(blur, sharp):>8.2f}")
        for name, v in variants.items():
            src, dst = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
            write_safetensors(src, {"x": blur, "voxels": v})
            subprocess.run([args.bin, "model", "run", "--config", args.config, "--weights",
                            args.weights, "--input", src, "--output", dst],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"{name:<18}{psnr(read_safetensors(dst)['y'], sharp):>8.2f}", flush=True)


if __name__ == "__main__":
    main()
