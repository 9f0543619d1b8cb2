#!/usr/bin/env python3
"""Writes a copy of a drafter checkpoint with random weights: the same config and tensor names,
shapes and dtypes, every matrix drawn from N(0, std²) and every vector (norms, biases) kept.

A drafter that is almost never right, paired with the same target as the trained one: what
auto-off must hold near plain speed (BENCHMARKS.md, "Drafters that never help").

    python3 bench/random_drafter.py plugins/glm-mtp/checkpoint /tmp/glm-mtp-random [--seed 1]
    mlx-spec bench --drafter glm-mtp --drafter-set checkpoint=/tmp/glm-mtp-random ...

Standard library only (no numpy or safetensors needed); float32, bfloat16 and float16 tensors.
"""
import argparse
import json
import random
import shutil
import struct
from pathlib import Path


def random_bytes(dtype, count, std, rng):
    values = [rng.gauss(0.0, std) for _ in range(count)]
    if dtype == "F32":
        return struct.pack(f"<{count}f", *values)
    if dtype == "F16":
        return struct.pack(f"<{count}e", *values)
    if dtype == "BF16":
        # bfloat16 is the top half of a float32 (truncated: the values are random anyway).
        words = struct.unpack(f"<{count}I", struct.pack(f"<{count}f", *values))
        return struct.pack(f"<{count}H", *(w >> 16 for w in words))
    raise SystemExit(f"unsupported dtype {dtype} (float32, bfloat16, float16 only)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="checkpoint folder (config.json + model.safetensors)")
    parser.add_argument("dst", type=Path, help="folder to write (created)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--std", type=float, default=0.02)
    args = parser.parse_args()

    source = args.src / "model.safetensors"
    if not source.is_file():
        raise SystemExit(f"{source} does not exist")
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    rng = random.Random(args.seed)

    args.dst.mkdir(parents=True, exist_ok=True)
    for item in args.src.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy(item, args.dst / item.name)

    out = bytearray()
    new_header = {}
    for name, meta in sorted(header.items(), key=lambda kv: kv[0]):
        if name == "__metadata__":
            new_header[name] = meta
            continue
        start, end = meta["data_offsets"]
        shape = meta["shape"]
        if len(shape) >= 2:
            count = 1
            for d in shape:
                count *= d
            piece = random_bytes(meta["dtype"], count, args.std, rng)
        else:
            piece = body[start:end]
        new_header[name] = {"dtype": meta["dtype"], "shape": shape,
                            "data_offsets": [len(out), len(out) + len(piece)]}
        out += piece
    text = json.dumps(new_header).encode()
    text += b" " * (-len(text) % 8)
    with open(args.dst / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(out)
    print(f"wrote {args.dst} ({len(new_header)} entries, {len(out)} bytes of tensors)")


if __name__ == "__main__":
    main()
