#!/usr/bin/env python3
"""Turn a trained checkpoint into the shipped default model: affine 8-bit weights in the
mlx-community layout, and the golden the Rust oracle test checks it against.

  python quantize_checkpoint.py SRC_MODEL_DIR DST_MODEL_DIR GOLDEN_FILE [--bits 8] [--group-size 64]

Every 2-D weight whose input width splits into groups (`embed_tokens` and so the tied head,
`embed_tokens_per_layer`, `per_layer_model_projection`, the attention and MLP projections,
`per_layer_input_gate`) is stored as
  <module>.weight  uint32 [out, in * bits / 32]   `bits`-bit values packed low bits first
  <module>.scales  float32 [out, in / group]
  <module>.biases  float32 [out, in / group]       w = scales * q + biases per group
Norms and the narrow `per_layer_projection` (input width 32) stay bfloat16. config.json gets
a `quantization` block (and the same as `quantization_config`). The scales are float32 (1.6 MB
more than bfloat16) because a loader that takes its compute dtype from them (mlx-spec's
`--dtype auto`) then runs in float32, which MLX's CPU quantized product runs about four times
faster than bfloat16 at this size.

The golden is computed by transformers (float32, eager attention) on the DEQUANTIZED weights,
i.e. on exactly the values the Rust loader reconstructs: `prompt_ids` (the first 64 tokens
of held-out requests/api.py, BOS first, taken from SRC's golden.safetensors), `logits`
[64, V] and `greedy_ids` (32 greedy tokens with a cache; EOS does not stop it).

Shards are written at most MAX_SHARD bytes each, with model.safetensors.index.json.
"""

import argparse
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import torch

MAX_SHARD = 15_000_000
GREEDY = 32


def quantize(w, group, bits):
    """w float32 [rows, cols] -> (packed uint32, scales f32, biases f32, dequantized f32)."""
    rows, cols = w.shape
    levels = (1 << bits) - 1
    g = w.reshape(rows, cols // group, group)
    lo = g.amin(-1, keepdim=True)
    hi = g.amax(-1, keepdim=True)
    scales = ((hi - lo) / levels).clamp_min(1e-8).to(torch.float32)
    biases = lo.to(torch.float32)
    # Quantize against the rounded scale and bias, the values the loader will use.
    s32, b32 = scales.float(), biases.float()
    q = torch.round((g - b32) / s32).clamp(0, levels).to(torch.int64)
    deq = (s32 * q.float() + b32).reshape(rows, cols)
    per_word = 32 // bits
    words = q.reshape(rows, cols // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    packed = (words << shifts).sum(-1).numpy().astype(np.uint32)  # disjoint bits: sum == or
    return packed, scales.reshape(rows, -1), biases.reshape(rows, -1), deq


def unpack(packed, bits, cols):
    per_word = 32 // bits
    p = torch.from_numpy(packed.astype(np.int64))
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    return ((p[..., None] >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0], cols)


def tensor_bytes(t):
    """(safetensors dtype, raw little-endian bytes) of a numpy array or torch tensor."""
    if isinstance(t, np.ndarray):
        assert t.dtype == np.uint32
        return "U32", t.astype("<u4").tobytes()
    if t.dtype == torch.bfloat16:
        return "BF16", t.contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    if t.dtype == torch.float32:
        return "F32", t.contiguous().numpy().astype("<f4").tobytes()
    if t.dtype == torch.int64:
        return "I64", t.contiguous().numpy().astype("<i8").tobytes()
    raise ValueError(f"unsupported dtype {t.dtype}")


def write_safetensors(path, tensors, metadata):
    header, blobs, pos = {"__metadata__": metadata}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        dtype, raw = tensor_bytes(t)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_sharded(out, tensors):
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        n = tensor_bytes(tensors[name])[1].__len__()
        if cur and size + n > MAX_SHARD:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += n
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, shard, {"format": "mlx"})
        weight_map.update({k: fname for k in shard})
    total = sum(os.path.getsize(out / f) for f in set(weight_map.values()))
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        f.write("\n")
    return sorted(set(weight_map.values()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("golden")
    ap.add_argument("--bits", type=int, default=8, choices=[4, 8])
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    from safetensors.torch import load_file, save_file
    from transformers import DynamicCache, Gemma4ForCausalLM

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    src, dst = Path(args.src), Path(args.dst)
    model = Gemma4ForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    state = model.state_dict()
    tied = model.config.tie_word_embeddings

    stored, n_quant = {}, 0
    with torch.no_grad():
        for name in sorted(state):
            if tied and name == "lm_head.weight":
                continue
            t = state[name].float()
            module = name[: -len(".weight")]
            if name.endswith(".weight") and t.dim() == 2 and "norm" not in name and t.shape[1] % args.group_size == 0:
                packed, scales, biases, deq = quantize(t, args.group_size, args.bits)
                assert torch.equal(unpack(packed, args.bits, t.shape[1]).float(),
                                   torch.round((deq.reshape(t.shape[0], -1, args.group_size)
                                                - biases.float()[..., None]) / scales.float()[..., None]).reshape(t.shape)), name
                stored[name] = packed
                stored[module + ".scales"] = scales
                stored[module + ".biases"] = biases
                state[name].copy_(deq)
                n_quant += 1
            else:
                stored[name] = t.to(torch.bfloat16)
                state[name].copy_(t.to(torch.bfloat16).float())
        if tied:
            assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    shards = write_sharded(dst, stored)
    cj = json.loads((src / "config.json").read_text())
    q = {"group_size": args.group_size, "bits": args.bits, "mode": "affine"}
    cj["quantization"] = dict(q)
    cj["quantization_config"] = dict(q)
    cj["dtype"] = "float32"
    with open(dst / "config.json", "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dst / name)

    # Golden on the dequantized weights.
    g = load_file(str(src / "golden.safetensors"))
    ids = g["prompt_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids[None, :], use_cache=False).logits[0].float()
        cache = DynamicCache(config=model.config)
        step = model(input_ids=ids[None, :], cache=cache, use_cache=True).logits[0, -1]
        greedy = []
        for i in range(GREEDY):
            tok = int(torch.argmax(step))
            greedy.append(tok)
            if i + 1 < GREEDY:
                step = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    golden = {"prompt_ids": ids.to(torch.int64).contiguous(), "logits": logits.contiguous(),
              "greedy_ids": torch.tensor(greedy, dtype=torch.int64)}
    Path(args.golden).parent.mkdir(parents=True, exist_ok=True)
    save_file(golden, args.golden, metadata={"format": "pt"})
    d = (logits - g["logits"]).abs().max().item()
    sizes = {s: os.path.getsize(dst / s) for s in shards}
    print(f"== {n_quant} matrices at {args.bits}-bit/{args.group_size}, shards {sizes}, "
          f"total {sum(sizes.values()) / 1e6:.2f} MB")
    print(f"   logits of the quantized model vs the bf16 checkpoint: max|d| = {d:.3f}; "
          f"greedy same as bf16: {greedy == g['greedy_ids'].tolist()}")
    print(f"   golden -> {args.golden}")


if __name__ == "__main__":
    main()
