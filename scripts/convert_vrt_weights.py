#!/usr/bin/env python3
"""Convert a VRT checkpoint (PyTorch .pth from JingyunLiang/VRT) to safetensors.

The keys are kept as they are in the reference state_dict (a `params` or
`params_ema` entry is unwrapped, a DataParallel `module.` prefix removed), so the
file loads strictly into vrtspike's VRT (`MODEL.SPIKE.ENABLED: false`):

    python scripts/convert_vrt_weights.py 006_VRT_videodeblurring_GoPro.pth vrt_gopro.safetensors
    vrtspike model run --config configs/deblur/vrt_gopro_deblur.yaml \
        --weights vrt_gopro.safetensors --input x.safetensors --output y.safetensors

Needs torch (already in the project venv); writes the safetensors format itself,
so the `safetensors` package is not required.
"""

import argparse
import ctypes
import json
import struct
import sys

import torch

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def state_dict_of(checkpoint, key):
    """The state_dict inside a checkpoint: `key` if given, else params_ema/params/state_dict."""
    if key:
        if key not in checkpoint:
            sys.exit(f"error: checkpoint has no entry {key!r}; it has {sorted(checkpoint)}")
        return checkpoint[key]
    for candidate in ("params_ema", "params", "state_dict"):
        if isinstance(checkpoint, dict) and candidate in checkpoint and isinstance(checkpoint[candidate], dict):
            return checkpoint[candidate]
    return checkpoint


def write_safetensors(tensors, path):
    """Write name -> tensor as safetensors (little-endian, header of offsets)."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in DTYPES:
            sys.exit(f"error: {name}: dtype {t.dtype} is not supported")
        # Raw bytes of the contiguous CPU tensor (no numpy needed).
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="VRT .pth checkpoint")
    parser.add_argument("output", help="output .safetensors")
    parser.add_argument("--key", help="entry of the checkpoint holding the state_dict (default: params_ema, params, state_dict)")
    args = parser.parse_args()
    checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    state = state_dict_of(checkpoint, args.key)
    tensors = {}
    for name, value in state.items():
        if not torch.is_tensor(value):
            continue
        if name.startswith("module."):
            name = name[len("module."):]
        tensors[name] = value
    if not tensors:
        sys.exit(f"error: {args.checkpoint}: no tensors found")
    write_safetensors(tensors, args.output)
    params = sum(t.numel() for n, t in tensors.items() if t.is_floating_point())
    print(f"{args.output}: {len(tensors)} tensors, {params:,} floating-point values")


if __name__ == "__main__":
    main()
