#!/usr/bin/env python3
"""Check a trained checkpoint folder written by train_model.py (run on CPU, float32).

  * config.json is in the released key form (global_head_dim, no per_layer_config) with
    eos [1, 106], bos 2, pad 0; generation_config.json has eos [1, 106, 50];
  * every safetensors shard is at most 16 MB and the index lists every tensor;
  * Gemma4ForCausalLM.from_pretrained reproduces golden.safetensors: the logits without a
    cache, and the greedy continuation with a DynamicCache;
  * tokenizer.json loads and gives the Gemma 4 special ids.

Usage:  python verify_checkpoint.py [MODEL_DIR]    (default: out/run/model next to this script)
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|tool_call>": 48, "<tool_call|>": 49,
           "<|tool_response>": 50, '<|"|>': 52, "<|channel>": 100, "<channel|>": 101,
           "<|turn>": 105, "<turn|>": 106}


def main():
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "out" / "run" / "model"
    import transformers
    from transformers import DynamicCache, Gemma4ForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))

    cj = json.loads((d / "config.json").read_text())
    assert cj["model_type"] == "gemma4_text" and "per_layer_config" not in cj, "not released form"
    assert cj["global_head_dim"] and cj["eos_token_id"] == [1, 106], cj.get("eos_token_id")
    assert cj["bos_token_id"] == 2 and cj["pad_token_id"] == 0
    gc = json.loads((d / "generation_config.json").read_text())
    assert gc["eos_token_id"] == [1, 106, 50] and gc["bos_token_id"] == 2 and gc["pad_token_id"] == 0

    shards = sorted(p for p in os.listdir(d) if p.startswith("model") and p.endswith(".safetensors"))
    names = set()
    for s in shards:
        assert os.path.getsize(d / s) <= 16_000_000, s
        names |= set(load_file(str(d / s)))
    if len(shards) > 1:
        wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(wm) == names, "index and shards disagree"
        assert set(wm.values()) == set(shards)

    model = Gemma4ForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    g = load_file(str(d / "golden.safetensors"))
    ids = g["prompt_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids[None, :], use_cache=False).logits[0]
        diff = (logits - g["logits"]).abs().max().item()
        cache = DynamicCache(config=model.config)
        step = model(input_ids=ids[None, :], cache=cache, use_cache=True).logits[0, -1]
        greedy = []
        for i in range(len(g["greedy_ids"])):
            tok = int(torch.argmax(step))
            greedy.append(tok)
            if i + 1 < len(g["greedy_ids"]):
                step = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    assert diff < 1e-4, f"logits differ from golden by {diff}"
    assert greedy == g["greedy_ids"].tolist(), (greedy, g["greedy_ids"].tolist())

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    for s, i in SPECIAL.items():
        assert tok.token_to_id(s) == i, s
    print(f"ok: {d}")
    print(f"   {n_params:,} params, {len(shards)} shard(s) {[os.path.getsize(d / s) for s in shards]} bytes")
    print(f"   golden logits max|diff| = {diff:.2e}, greedy {len(greedy)} ids reproduced")
    print(f"   prompt:  {tok.decode(ids.tolist(), skip_special_tokens=False)!r}")
    print(f"   greedy:  {tok.decode(greedy, skip_special_tokens=False)!r}")


if __name__ == "__main__":
    main()
