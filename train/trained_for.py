#!/usr/bin/env python3
"""Record which target a drafter checkpoint was trained for: `trained_for.json` in the
checkpoint folder, which mlx-spec reads when it builds the drafter and warns about when the
target in use differs (host/src/plugins/trained_for.rs).

  python trained_for.py TARGET_DIR CHECKPOINT_DIR [CHECKPOINT_DIR...]   write the file
  python trained_for.py TARGET_DIR                                      print the fingerprint

The fingerprint is the sha256 of the target's final norm weights (`model.norm.weight`, or
`model.language_model.norm.weight` in the multimodal layout), each rounded to bfloat16 and
written as little-endian bytes: quantization leaves norms as they are and a change of float
dtype rounds back to the same values, so the fingerprint names the trained weights, not how
they are stored. The drafter training scripts call `write` after saving.
"""

import json
import sys
from pathlib import Path

import numpy as np

FILE_NAME = "trained_for.json"
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight")


def load_file_bf16(path, name):
    """One tensor of a safetensors file as float32 (bfloat16 included, which numpy lacks),
    reading only the header and that tensor's bytes; None when the file does not hold it."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        if name not in header:
            return None
        meta = header[name]
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        buf = f.read(end - start)
    if meta["dtype"] == "BF16":
        bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32)
    return np.frombuffer(buf, dtype={"F32": "<f4", "F16": "<f2"}[meta["dtype"]]).astype(np.float32)


def _bf16_bits(values):
    """float32 -> bfloat16 bits, round to nearest even (as Rust's half::bf16::from_f32)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def fingerprint(target_dir):
    import hashlib

    for name in NORM_NAMES:
        weights = None
        for f in sorted(Path(target_dir).glob("*.safetensors")):
            weights = load_file_bf16(f, name)
            if weights is not None:
                break
        if weights is not None:
            return hashlib.sha256(_bf16_bits(weights).tobytes()).hexdigest()
    raise SystemExit(f"{target_dir}: no final norm ({' or '.join(NORM_NAMES)}) in its safetensors files")


def write(target_dir, checkpoint_dir):
    record = {"target": Path(target_dir).resolve().name, "final_norm_sha256": fingerprint(target_dir)}
    path = Path(checkpoint_dir) / FILE_NAME
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if len(sys.argv) == 2:
        print(fingerprint(sys.argv[1]))
    for ckpt in sys.argv[2:]:
        print("wrote", write(sys.argv[1], ckpt))
