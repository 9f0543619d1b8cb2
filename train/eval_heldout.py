#!/usr/bin/env python3
"""Held-out loss of a model folder on the token files, the way train_model.py measures it:
evenly spaced windows of 512 (+1) tokens of data/heldout.bin and data/unseen.bin, float32,
eager attention. A quantized folder (mlx-community affine layout, as quantize_checkpoint.py
writes) is dequantized first, so the number is that of the weights mlx-spec runs.

  python eval_heldout.py MODEL_DIR [MODEL_DIR...] [--windows N] [--data DIR]

--windows 0 evaluates every window (slow on a CPU: about 0.3 s a window for 25 M parameters).

--per-file CONTEXT scores each file instead, as `mlx-spec perplexity` does: BOS first, no EOS,
cut into chunks of at most CONTEXT predicted tokens, each chunk from a fresh context that
starts at the token before its first target (0 = the model's max_position_embeddings, the
context it serves; several comma-separated contexts score the files once each). The loss is
the mean over every predicted token of every file.

--device cuda runs on a GPU (float32; PyTorch keeps TF32 off for matrix products unless told
otherwise), the way train/gpu_run.sh TASK=eval calls it on the GPU machine.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_model import eval_windows, load_bin  # noqa: E402


def load_model(d, attn="eager"):
    from safetensors.torch import load_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    d = Path(d)
    cj = json.loads((d / "config.json").read_text())
    q = cj.get("quantization")
    if not q:
        return Gemma4ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation=attn).eval()
    stored = {}
    for f in sorted(d.glob("model*.safetensors")):
        stored.update(load_file(str(f)))
    bits, group = q["bits"], q["group_size"]
    per_word = 32 // bits
    state = {}
    for name, t in stored.items():
        if name.endswith(".scales") or name.endswith(".biases"):
            continue
        module = name[: -len(".weight")]
        if module + ".scales" in stored:
            p = t.to(torch.int64) & 0xFFFFFFFF
            shifts = torch.arange(per_word, dtype=torch.int64) * bits
            qv = ((p[..., None] >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0], -1).float()
            s = stored[module + ".scales"].float()
            b = stored[module + ".biases"].float()
            rows, cols = qv.shape
            w = s[..., None] * qv.reshape(rows, cols // group, group) + b[..., None]
            state[name] = w.reshape(rows, cols)
        else:
            state[name] = t.float()
    cfg_kw = {k: v for k, v in cj.items() if k not in ("quantization", "quantization_config")}
    cfg = Gemma4TextConfig(**cfg_kw)
    cfg._attn_implementation = attn
    model = Gemma4ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@torch.no_grad()
def loss_on(model, windows, batch=8, device="cpu"):
    tot, cnt = 0.0, 0
    for i in range(0, len(windows), batch):
        w = torch.from_numpy(windows[i : i + batch]).to(device)
        logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        cnt += w[:, 1:].numel()
    return tot / cnt


@torch.no_grad()
def per_file_loss(model, tokens, index, context, device="cpu"):
    """Sum of -log p over every file of `index` (each BOS + text, the EOS dropped), in chunks."""
    tot, cnt = 0.0, 0
    for doc in index:
        ids = torch.from_numpy(tokens[doc["start"] : doc["start"] + doc["n_tokens"] - 1].astype(np.int64)).to(device)
        first = 1
        while first < len(ids):
            n = min(context, len(ids) - first)
            chunk = ids[first - 1 : first + n][None]
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits.float()
            tot += F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
            cnt += n
            first += n
    return tot, cnt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--per-file", default=None, metavar="CONTEXT[,CONTEXT...]",
                    help="score whole files in chunks of CONTEXT tokens (0 = the served context)")
    ap.add_argument("--sets", default="heldout,unseen")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--attn", default="eager", help="attention implementation: eager or sdpa")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    data = Path(args.data)
    names = args.sets.split(",")
    if args.per_file is not None:
        contexts = [int(c) for c in args.per_file.split(",")]
        for d in args.models:
            model = load_model(d, args.attn).to(args.device)
            served = json.loads((Path(d) / "config.json").read_text())["max_position_embeddings"]
            for context in contexts:
                context = context or served
                row = {"model": d, "per_file_context": context, "device": args.device, "attn": args.attn}
                for name in names:
                    index = json.loads((data / f"{name}_index.json").read_text())
                    tot, cnt = per_file_loss(model, load_bin(data / f"{name}.bin"), index, context, args.device)
                    loss = tot / cnt
                    row[name] = {"files": len(index), "tokens": cnt, "loss": round(loss, 4), "ppl": round(math.exp(loss), 3)}
                print(json.dumps(row), flush=True)
        return
    sets = {name: eval_windows(load_bin(data / f"{name}.bin"), 512, args.windows) for name in names}
    for d in args.models:
        model = load_model(d, args.attn).to(args.device)
        row = {"model": d}
        for name, w in sets.items():
            loss = loss_on(model, w, device=args.device)
            row[name] = {"windows": len(w), "loss": round(loss, 4), "ppl": round(math.exp(loss), 3)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
