#!/usr/bin/env python3
"""A short CPU fine-tune that teaches the trained model that a bare `def`/`class` with a
docstring goes on with its body instead of ending the text.

Why: the "from_def" training documents (prepare_corpus.py) start at a random top-level
definition; when that definition is the last of its file and is only a docstring (abstract
methods, protocol stubs), the document is `BOS def f(...):\\n    \"\"\"doc\"\"\"\\n EOS`, which is
exactly what a user's short prompt looks like, and greedy decoding then ends at once.

Samples (seeded, reproducible), alternating: BOS + a top-level `def`/`class` line of a training
file and the rest of that file (at least MIN_FOLLOW more lines), so no end-of-text follows a
bare definition; then a random window of train.bin as in pre-training, so the rest of the
distribution holds. Half the definition samples are tokenized the way a prompt is (cut after
one of their first lines, each piece on its own; `prompt_shaped`). A definition sample shorter than --seq-len ends as its file does, with
EOS, and is filled up with a training document from its BOS: the order pre-training saw
(BOS ... EOS BOS ...). Filling it with a window that is not a document's start would teach
the model that a file may break off into a new one (BOS) anywhere. AdamW at a constant --lr
after a short warm-up, float32.

  python finetune_bare_defs.py SRC_MODEL_DIR OUT_MODEL_DIR [--minutes 12] [--lr 1e-4]

OUT gets a bf16 checkpoint like train_model.py's (config, generation config, tokenizer and
SRC's golden.safetensors, whose prompt ids quantize_checkpoint.py reads).
"""

import argparse
import json
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
DOC_SEP = "\x1e\n"
BOS, EOS = 2, 1
MIN_FOLLOW = 12
PROMPT_LINES = 8
TOP = re.compile(r"(def |async def |class )")


def def_starts(doc):
    """Line offsets of top-level definitions (their decorators included) with code after them."""
    lines = doc.split("\n")
    out = []
    for i, line in enumerate(lines):
        if TOP.match(line) and len(lines) - i > MIN_FOLLOW + 1:
            j = i
            while j > 0 and lines[j - 1].startswith("@"):
                j -= 1
            out.append("\n".join(lines[j:]))
    return out


def prompt_shaped(tok, text, rng):
    """The ids of a definition sample. Half of them are tokenized in two pieces, cut after one
    of the first PROMPT_LINES lines, as a user's prompt is: inside a file a newline merges with
    the next line's indentation into one token, so a prompt that ends in a newline ends in a
    token the corpus never shows mid-file, and the model must learn what follows it."""
    if rng.random() < 0.5:
        return tok.encode(text, add_special_tokens=False).ids
    lines = text.split("\n")
    cut = rng.randrange(1, min(PROMPT_LINES, len(lines) - 1) + 1)
    head = "\n".join(lines[:cut]) + "\n"
    tail = "\n".join(lines[cut:])
    return tok.encode(head, add_special_tokens=False).ids + tok.encode(tail, add_special_tokens=False).ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--minutes", type=float, default=12.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=4321)
    args = ap.parse_args()
    from tokenizers import Tokenizer
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    src, out, data = Path(args.src), Path(args.out), Path(args.data)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    docs = (data / "train.txt").read_text(encoding="utf-8").split(DOC_SEP)[:-1]
    picked = rng.sample(docs, min(4000, len(docs)))
    texts = [t for d in picked for t in def_starts(d)]
    rng.shuffle(texts)
    print(f"== {len(texts)} definition starts from {len(picked)} files")
    train = np.fromfile(data / "train.bin", dtype="<u2")

    model = Gemma4ForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    n = args.seq_len + 1
    doc_starts = np.flatnonzero(train[: len(train) - n] == BOS)  # each with a whole window after it
    t0, step, k, sample = time.time(), 0, 0, 0
    while time.time() - t0 < args.minutes * 60:
        rows = []
        for _ in range(args.batch_size):
            sample += 1
            if sample % 2 == 1:
                ids = [BOS] + prompt_shaped(tok, texts[k % len(texts)], rng) + [EOS]
                k += 1
                if len(ids) < n:  # the file ended: the next document follows, from its BOS
                    s = int(doc_starts[rng.randrange(0, len(doc_starts))])
                    ids += [int(x) for x in train[s : s + n - len(ids)]]
                rows.append(ids[:n])
            else:
                s = rng.randrange(0, len(train) - n)
                rows.append([int(x) for x in train[s : s + n]])
        w = torch.tensor(rows, dtype=torch.int64)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20)
        logits = model(input_ids=w[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            print(f"   step {step:4d}  loss {loss.item():.4f}  {time.time() - t0:.0f}s", flush=True)

    model.eval()
    if out.exists():
        shutil.rmtree(out)
    with torch.no_grad():
        state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    model.save_pretrained(out, max_shard_size="15MB", state_dict=state)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "golden.safetensors"):
        shutil.copyfile(src / name, out / name)
    (out / "finetune.json").write_text(json.dumps({"steps": step, "samples": step * args.batch_size,
                                                    "tokens": step * args.batch_size * args.seq_len,
                                                    "args": vars(args)}, indent=2) + "\n")
    print(f"== {step} steps, saved {out}")


if __name__ == "__main__":
    main()
