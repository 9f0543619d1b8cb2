#!/usr/bin/env python3
"""Reference numbers for `mlx-spec perplexity` (tests/perplexity.rs), from transformers 5.24.

For each (model, text, context) case: the text is tokenized with the model's tokenizer.json
(no special tokens) and BOS is put first; the ids are cut into chunks of at most `context`
predicted tokens, each chunk run from a fresh start on the token before its first target;
the summed negative log-likelihood (nats, float64 sums of float32 log-softmax rows, eager
attention, float32 weights) is written with the token count to tests/goldens/perplexity.json.

Models: the bf16 fixture tests/fixtures/tiny-wrapped-bf16 (upcast to float32: exactly its
stored values) and the default model models/gemma4-code-25m-v2, dequantized from its 8-bit
weights the way mlx-spec reconstructs them (train/eval_heldout.py's loader).

  python tests/oracle/make_perplexity_goldens.py        (venv of tests/oracle/requirements.txt)
"""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "train"))

TEXT = "tests/fixtures/perplexity/sample.py"
CASES = [
    ("tests/fixtures/tiny-wrapped-bf16", None),
    ("tests/fixtures/tiny-wrapped-bf16", 40),
    ("models/gemma4-code-25m-v2", None),
    ("models/gemma4-code-25m-v2", 100),
]


def load(rel):
    d = ROOT / rel
    cj = json.loads((d / "config.json").read_text())
    if "text_config" in cj:
        from transformers import Gemma4ForConditionalGeneration

        model = Gemma4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        tc = cj["text_config"]
    else:
        from eval_heldout import load_model

        model = load_model(d)
        tc = cj
    bos = cj.get("bos_token_id", tc.get("bos_token_id"))
    return model.eval(), bos, tc["max_position_embeddings"]


@torch.no_grad()
def nll(model, ids, context):
    total, count = 0.0, 0
    targets = len(ids) - 1
    first = 0
    while first < targets:
        n = min(context, targets - first)
        chunk = torch.tensor([ids[first : first + n + 1]])
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits.double(), dim=-1)
        total += -logp[torch.arange(n), chunk[0, 1:]].sum().item()
        count += n
        first += n
    return total, count


def main():
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    text = (ROOT / TEXT).read_text(encoding="utf-8")
    out = []
    for rel, context in CASES:
        model, bos, served = load(rel)
        tok = Tokenizer.from_file(str(ROOT / rel / "tokenizer.json"))
        ids = [bos] + tok.encode(text, add_special_tokens=False).ids
        ctx = context or served
        nats, count = nll(model, ids, ctx)
        out.append({"model": rel, "file": TEXT, "context": context, "served_context": served,
                    "tokens": count, "nats": nats})
        print(f"{rel} context {ctx}: {count} tokens, {nats / count:.6f} nats/token")
    path = ROOT / "tests" / "goldens" / "perplexity.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
