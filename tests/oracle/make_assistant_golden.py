#!/usr/bin/env python3
"""Golden drafts of the shipped assistant drafter (plugins/assistant/checkpoint) for the
default model (models/gemma4-code-25m-v2, dequantized to float32), computed by transformers'
own Gemma4AssistantForCausalLM: for each prompt, the target's greedy anchor and six chained
greedy drafts of the round that follows the prompt's prefill. tests/shipped_assistant.rs
checks that `mlx-spec draft` proposes the same tokens.

  python tests/oracle/make_assistant_golden.py    # -> tests/fixtures/assistant-shipped.json

Needs torch, numpy, safetensors, tokenizers and transformers==5.24.0 (train/README.md).
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "train"))
from train_assistant import load_target  # noqa: E402

PROMPTS = [
    "import os\n\n\ndef read_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
]
DRAFTS = 6


@torch.no_grad()
def round_after(target, drafter, ids):
    from transformers import DynamicCache

    out = target(input_ids=torch.tensor([ids]), cache=DynamicCache(config=target.config),
                 use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    anchor = int(out.logits[0, -1].argmax())
    shared = {k: (v[0], v[1]) for k, v in out.shared_kv_states.items()}
    position = torch.tensor([[len(ids)]])
    embed = target.get_input_embeddings()
    token, hidden = torch.tensor([[anchor]]), out.hidden_states[-1][:, -1:]
    drafts, margins = [], []
    for _ in range(DRAFTS):
        o = drafter(inputs_embeds=torch.cat([embed(token), hidden], -1), attention_mask=None,
                    position_ids=position, shared_kv_states=shared, use_cache=False)
        top = o.logits[0, -1].topk(2).values
        margins.append(float(top[0] - top[1]))
        token, hidden = o.logits.argmax(-1), o.last_hidden_state
        drafts.append(int(token))
    return anchor, drafts, min(margins)


def main():
    from transformers import Gemma4AssistantForCausalLM

    model_dir = ROOT / "models/gemma4-code-25m-v2"
    checkpoint = ROOT / "plugins/assistant/checkpoint"
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    target, _ = load_target(model_dir, "cpu", torch.float32)
    drafter = Gemma4AssistantForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    cases = []
    for text in PROMPTS:
        ids = [2] + tokenizer.encode(text, add_special_tokens=False).ids
        anchor, drafts, margin = round_after(target, drafter, ids)
        cases.append({"text": text, "prompt_ids": ids, "anchor": anchor, "drafts": drafts,
                      "smallest_top2_margin": round(margin, 4)})
        print(f"{len(ids)} prompt tokens: anchor {anchor}, drafts {drafts}, margin {margin:.3f}")
    out = ROOT / "tests/fixtures/assistant-shipped.json"
    out.write_text(json.dumps({"num_draft_tokens": DRAFTS, "cases": cases}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
