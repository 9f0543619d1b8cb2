#!/usr/bin/env python3
"""Long-sequence goldens for the committed fixtures: a 700-token prompt, past the 512 slots a
KV buffer starts with, so the Rust side can check against transformers the attention paths
that a 20-token prompt never reaches (a prefill chunk over 512 tokens, masked windows over
buffers holding more than 512 positions, decode across a sliding buffer's compaction).

It reads the fixture folders that make_fixtures.py wrote (it does not rebuild or rewrite the
models) and writes one small file next to each, golden_long.safetensors (float32 / int64):

  long_prompt_ids [700]      seeded random ids in [3, V)
  long_positions [P]         the prompt positions whose logits are kept
  long_logits [P, V]         transformers' full forward (no cache) at those positions
  long_greedy_ids [16]       greedy continuation of the whole prompt (EOS never stops it)
  long_greedy_logits [16, V] the logits row each greedy token was the argmax of

For the two fixtures the Rust tests also run in half precision (tiny-wrapped-bf16 in bf16,
tiny-ple-kvshare in bf16 and f16) it writes golden_half.safetensors as well: transformers'
own logits of the short golden prompt (golden.safetensors' prompt_ids) with the model run in
that dtype, as float32 [T, V] under the keys `bf16_logits` / `f16_logits`. They measure how far
rounding alone moves the logits, which is what the Rust half-precision check is scaled by.

Only a handful of rows are kept, around the places where the Rust cache changes what it does
(the 64-token masked-window limit, the 256-slot growth step, the 512-slot first capacity, the
chunk boundaries the test uses), so the files stay small.

As in make_fixtures.py, the bf16 fixture is computed in float32 on its bf16 weights and the
quantized one in float32 on its dequantized weights (w = scales * q + biases, read back from
the fixture's own file). Before writing, each rebuilt model must reproduce the fixture's
short golden logits, and transformers' own cached decode of the long prompt must agree with
its full forward, so a wrong reconstruction or a cache quirk cannot produce a golden.

Run it with the oracle environment of make_fixtures.py (outside the repository):

    <venv>/bin/python tests/oracle/make_long_goldens.py [FIXTURES_DIR]
"""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DynamicCache,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (the quantization helpers and constants)

T_LONG = 700
N_GREEDY_LONG = 16
# The chunking the Rust test uses for its cached runs (see tests/gemma4_oracle.rs): one run
# prefills 600 then a masked window of 40 then single tokens; the other prefills 200 then
# windows of mixed sizes. The kept rows bracket those boundaries and the buffer sizes.
POSITIONS = sorted(
    {0, 1, 63, 64, 199, 200, 255, 256, 257, 400, 508, 509, 510, 511, 512, 513, 514, 599, 600,
     601, 639, 640, 641, 699}
)


def load_plain(d, cls):
    return cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()


def load_quantized(d):
    """The q4 fixture as a float32 model: the dequantized weights of its own file."""
    cfg = Gemma4TextConfig.from_pretrained(d)
    qcfg = getattr(cfg, "quantization", None) or mf.read_json(os.path.join(d, "config.json"))["quantization"]
    for key in ("quantization", "quantization_config"):
        if hasattr(cfg, key):
            delattr(cfg, key)
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).eval().float()
    saved = load_file(os.path.join(d, "model.safetensors"))
    state = {}
    for name, t in saved.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and module + ".scales" in saved:
            spec = qcfg.get(module, qcfg)
            state[name] = mf.dequantize(
                t.numpy(),
                saved[module + ".scales"].numpy(),
                saved[module + ".biases"].numpy(),
                spec["group_size"],
                spec["bits"],
            )
        else:
            state[name] = t.to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    # lm_head is tied to the embedding; nothing else may be left at its random init.
    assert all(k == "lm_head.weight" for k in missing), missing
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model


def check_short_golden(tag, d, model):
    golden = load_file(os.path.join(d, "golden.safetensors"))
    with torch.no_grad():
        got = mf.logits_of(model, golden["prompt_ids"])
    diff = (got - golden["logits"]).abs().max().item()
    print(f"   rebuilt model vs golden.safetensors logits: {diff:.3e}")
    assert diff < 1e-5, (tag, diff)


def long_goldens(model, vocab):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, vocab, (T_LONG,), generator=gen, dtype=torch.int64)
    cfg = model.config
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    with torch.no_grad():
        full = mf.logits_of(model, ids)

        # transformers against itself: a 200-token prefill, then one token at a time.
        cache = DynamicCache(config=getattr(cfg, "text_config", cfg))
        rows = [mf.logits_of(model, ids[:200], cache)]
        for t in range(200, T_LONG):
            rows.append(mf.logits_of(model, ids[t : t + 1], cache))
        decoded = torch.cat(rows, 0)
        self_diff = (decoded - full)[positions].abs().max().item()

        cache = DynamicCache(config=getattr(cfg, "text_config", cfg))
        step = mf.logits_of(model, ids, cache)[-1]
        greedy, greedy_logits = [], []
        for i in range(N_GREEDY_LONG):
            tok = int(torch.argmax(step))
            greedy.append(tok)
            greedy_logits.append(step)
            if i + 1 < N_GREEDY_LONG:
                step = mf.logits_of(model, torch.tensor([tok]), cache)[-1]
    out = {
        "long_prompt_ids": ids,
        "long_positions": positions,
        "long_logits": full[positions],
        "long_greedy_ids": torch.tensor(greedy, dtype=torch.int64),
        "long_greedy_logits": torch.stack(greedy_logits, 0),
    }
    out = {k: v.detach().contiguous() for k, v in out.items()}
    top2 = out["long_greedy_logits"].topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    spread = out["long_logits"].std(dim=-1).mean().item()
    print(f"   transformers cached decode vs full forward at kept rows: {self_diff:.3e}")
    print(f"   long_greedy_ids = {greedy}")
    print(f"   smallest greedy top1-top2 margin = {margin:.4f}; mean row std of logits {spread:.3f}")
    assert self_diff < 1e-4, self_diff
    return out


# The half-precision runs the Rust tests compare against: fixture -> dtypes.
HALF = {
    "tiny-wrapped-bf16": (Gemma4ForConditionalGeneration, {"bf16_logits": torch.bfloat16}),
    "tiny-ple-kvshare": (
        Gemma4ForCausalLM,
        {"bf16_logits": torch.bfloat16, "f16_logits": torch.float16},
    ),
}


def half_goldens(tag, d):
    cls, dtypes = HALF[tag]
    golden = load_file(os.path.join(d, "golden.safetensors"))
    out = {}
    for key, dtype in dtypes.items():
        model = cls.from_pretrained(d, attn_implementation="eager", dtype=dtype).eval()
        with torch.no_grad():
            got = mf.logits_of(model, golden["prompt_ids"]).to(torch.float32)
        diff = got - golden["logits"]
        rel = diff.pow(2).mean().sqrt() / golden["logits"].std()
        agree = (got.argmax(-1) == golden["logits"].argmax(-1)).float().mean().item()
        print(f"   transformers in {key[:-7]}: max|dlogit| {diff.abs().max().item():.3f}, "
              f"rms/std {rel.item():.4f}, argmax agreement {agree:.2f}")
        out[key] = got.contiguous()
    path = os.path.join(d, "golden_half.safetensors")
    save_file(out, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    print(f"   wrote {path} ({os.path.getsize(path)} bytes)")


def main():
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else mf.REPO_ROOT / "tests" / "fixtures"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    variants = [
        ("tiny-ple-kvshare", lambda d: load_plain(d, Gemma4ForCausalLM), mf.PLE_KVSHARE),
        ("tiny-moe-keqv", lambda d: load_plain(d, Gemma4ForCausalLM), mf.MOE_KEQV),
        ("tiny-wrapped-bf16", lambda d: load_plain(d, Gemma4ForConditionalGeneration), mf.WRAPPED),
        ("tiny-ple-q4", load_quantized, mf.PLE_Q4),
    ]
    for tag, loader, arch in variants:
        d = str(root / tag)
        print(f"== {tag}")
        model = loader(d)
        check_short_golden(tag, d, model)
        out = long_goldens(model, arch["vocab_size"])
        path = os.path.join(d, "golden_long.safetensors")
        save_file(out, path, metadata={"format": "pt"})
        os.chmod(path, 0o644)
        print(f"   wrote {path} ({os.path.getsize(path)} bytes)")
        if tag in HALF:
            half_goldens(tag, d)


if __name__ == "__main__":
    main()
