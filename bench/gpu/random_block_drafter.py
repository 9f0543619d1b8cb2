#!/usr/bin/env python3
"""Writes a block drafter checkpoint of a released size with random bfloat16 weights, for
timing a round at that size (`bench/gpu/run.sh block-cost`); random drafts are all rejected, so
the bench's spec rate is the price of a round and its drafter column the block's part of it.

    python3 bench/gpu/random_block_drafter.py dspark configs/gemma-4-12b.json /tmp/dspark-12b
    python3 bench/gpu/random_block_drafter.py dflash configs/gemma-4-31b.json /tmp/dflash-31b

Formats and the shapes they take (../shared/reference/drafters/block-drafters.md):
  dspark  DeepSeek's `dspark_gemma4_12b_block7` (`Gemma4DSparkModel`): the target's text config
          overwritten with the drafter's keys; 5 full-attention layers of 16 heads x 512 with one
          K=V head, MLP 15 360, Markov rank 256, a confidence head, its own embedding and LM
          head; taps 5, 17, 29, 41, 46 of 48. 3 430 444 550 parameters (6.86 GB).
  dflash  z-lab's `gemma-4-31B-it-DFlash` (`DFlashDraftModel`, Qwen3 keys): 5 layers of 64 heads
          x 128 with 8 key/value heads, MLP 10 752, 4 sliding (window 2 048) and 1 full layer,
          blocks of 16, taps 1, 12, 23, 35, 46, 57 of 60; the target's embedding and head.

Norms are ones and layer scalars one; matrices N(0, 0.02^2). Needs torch and safetensors (the
GPU machine's python has both); draws on CUDA when there is one. `--check FIXTURE` instead
compares the tensor names and shapes this script would write for the fixture's own config with
the fixture's file (the oracle fixtures of tests/fixtures), so the layout is checked anywhere.
"""
import argparse
import json
import struct
from pathlib import Path

DSPARK_12B = {
    "architectures": ["Gemma4DSparkModel"],
    "num_hidden_layers": 5,
    "target_layer_ids": [5, 17, 29, 41, 46],
    "block_size": 7,
    "mask_token_id": 4,
    "num_attention_heads": 16,
    "global_head_dim": 512,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "intermediate_size": 15360,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": False,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "enable_moe_block": False,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
}

DFLASH_31B = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "num_hidden_layers": 5,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 10752,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_window": 2048,
    "use_sliding_window": True,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "block_size": 16,
    "tie_word_embeddings": False,
    "dflash_config": {"mask_token_id": 4, "target_layer_ids": [1, 12, 23, 35, 46, 57]},
}


def dspark_config(target):
    cfg = dict(target)
    cfg.update(DSPARK_12B)
    cfg["num_target_layers"] = target["num_hidden_layers"]
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    cfg["dtype"] = "bfloat16"
    return cfg


def dflash_config(target):
    cfg = dict(DFLASH_31B)
    cfg["hidden_size"] = target["hidden_size"]
    cfg["vocab_size"] = target["vocab_size"]
    cfg["num_target_layers"] = target["num_hidden_layers"]
    cfg["dtype"] = "bfloat16"
    return cfg


def dspark_tensors(cfg):
    """(name, shape, kind) of every tensor the deepspec plugin reads; kind: matrix, norm, one."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, d, nkv = cfg["num_attention_heads"], cfg["global_head_dim"], cfg["num_global_key_value_heads"]
    r, taps = cfg["markov_rank"], len(cfg["target_layer_ids"])
    out = [("embed_tokens.weight", [v, h], "matrix"), ("lm_head.weight", [v, h], "matrix"),
           ("fc.weight", [h, taps * h], "matrix"), ("hidden_norm.weight", [h], "norm"),
           ("norm.weight", [h], "norm")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out += [(p + n + ".weight", [h], "norm") for n in
                ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        out += [(p + "layer_scalar", [1], "one"),
                (p + "self_attn.q_proj.weight", [nh * d, h], "matrix"),
                (p + "self_attn.k_proj.weight", [nkv * d, h], "matrix"),
                (p + "self_attn.o_proj.weight", [h, nh * d], "matrix"),
                (p + "self_attn.q_norm.weight", [d], "norm"),
                (p + "self_attn.k_norm.weight", [d], "norm"),
                (p + "mlp.gate_proj.weight", [inter, h], "matrix"),
                (p + "mlp.up_proj.weight", [inter, h], "matrix"),
                (p + "mlp.down_proj.weight", [h, inter], "matrix")]
    if cfg["markov_rank"]:
        out += [("markov_head.markov_w1.weight", [v, r], "matrix"), ("markov_head.markov_w2.weight", [v, r], "matrix")]
    if cfg["enable_confidence_head"]:
        width = h + (r if cfg["confidence_head_with_markov"] else 0)
        out += [("confidence_head.proj.weight", [1, width], "matrix"), ("confidence_head.proj.bias", [1], "norm")]
    return out


def dflash_tensors(cfg):
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    # z-lab's default (no target_layer_ids) taps one target layer per draft layer.
    taps = len(cfg["dflash_config"].get("target_layer_ids") or range(cfg["num_hidden_layers"]))
    bias = cfg.get("attention_bias", False)
    out = [("fc.weight", [h, taps * h], "matrix"), ("hidden_norm.weight", [h], "norm"), ("norm.weight", [h], "norm")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, rows, cols in (("q_proj", nh * d, h), ("k_proj", nkv * d, h), ("v_proj", nkv * d, h), ("o_proj", h, nh * d)):
            out.append((f"{p}self_attn.{name}.weight", [rows, cols], "matrix"))
            if bias:
                out.append((f"{p}self_attn.{name}.bias", [rows], "norm"))
        out += [(p + "self_attn.q_norm.weight", [d], "norm"), (p + "self_attn.k_norm.weight", [d], "norm"),
                (p + "input_layernorm.weight", [h], "norm"), (p + "post_attention_layernorm.weight", [h], "norm"),
                (p + "mlp.gate_proj.weight", [inter, h], "matrix"), (p + "mlp.up_proj.weight", [inter, h], "matrix"),
                (p + "mlp.down_proj.weight", [h, inter], "matrix")]
    return out


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return {k: v["shape"] for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


def check(fixture):
    cfg = json.loads((fixture / "config.json").read_text())
    tensors = dflash_tensors(cfg) if cfg["architectures"] == ["DFlashDraftModel"] else dspark_tensors(cfg)
    mine = {name: shape for name, shape, _ in tensors}
    theirs = header(fixture / "model.safetensors")
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise SystemExit(f"{fixture}: layout differs at {diff}")
    print(f"{fixture}: {len(mine)} tensors, names and shapes as this script writes them")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("format", nargs="?", choices=["dspark", "dflash"])
    ap.add_argument("target_config", nargs="?", type=Path)
    ap.add_argument("dst", nargs="?", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check", type=Path, metavar="FIXTURE")
    args = ap.parse_args()
    if args.check:
        return check(args.check)
    if not (args.format and args.target_config and args.dst):
        ap.error("FORMAT TARGET_CONFIG DST are needed (or --check FIXTURE)")

    import torch
    from safetensors.torch import save_file

    target = json.loads(args.target_config.read_text())
    target = target.get("text_config", target)
    cfg = dspark_config(target) if args.format == "dspark" else dflash_config(target)
    tensors = dspark_tensors(cfg) if args.format == "dspark" else dflash_tensors(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    state = {}
    for name, shape, kind in tensors:
        if kind == "matrix":
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
        else:
            t = torch.ones(shape, device=device, dtype=torch.float32)
        state[name] = t.to(torch.bfloat16).cpu()
    args.dst.mkdir(parents=True, exist_ok=True)
    (args.dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(args.dst / "model.safetensors"))
    params = sum(t.numel() for t in state.values())
    print(f"{args.dst}: {args.format} for {args.target_config.name}, {params:,} parameters, "
          f"{len(state)} tensors")


if __name__ == "__main__":
    main()
