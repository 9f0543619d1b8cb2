#!/usr/bin/env python3
"""End-to-end fixture for the `deepspec` drafter: a tiny random Gemma 4 target whose own
hidden states feed DeepSpec's own drafter module.

The drafter is the one of tests/fixtures/deepspec-oracle (DeepSpec's Gemma4DSparkModel with
random weights, made by the reference oracle). This script builds the target it was shaped
for (6 layers, hidden 48, vocabulary 300, K=V full layers, no per-layer inputs), runs a
12-token prompt through it with transformers, takes the taps DeepSpec's evaluator takes
(`hidden_states[i + 1]` for i in target_layer_ids, concatenated), and lets DeepSpec's own
inference helpers draft the first block after the prompt (anchor = the target's greedy
token, at position 12, fresh draft cache). `mlx-spec draft` on the same target and prompt
must propose the same block.

Needs DeepSpec's `deepspec` package (pinned commit afdfa7c) and the transformers it pins
(5.10.2), torch on the CPU:

    git -C <DeepSpec checkout> archive afdfa7c deepspec | tar -x -C <SRC>
    pip install --no-deps --target <TF510> transformers==5.10.2 httpx httpcore certifi \\
        "tokenizers>=0.22.0,<=0.23.0" "huggingface-hub>=1.5.0,<2.0"
    PYTHONPATH=<TF510> <venv>/bin/python tests/oracle/make_deepspec_e2e.py --deepspec-src <SRC>

Writes tests/fixtures/deepspec-oracle/target/{config.json, model.safetensors} and
tests/fixtures/deepspec-oracle/e2e.json. Deterministic (seeded); no machine path is written.
"""

import argparse
import json
import os
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec-oracle"

# The target the fixture drafter was shaped for (the reference oracle's TARGET_TEXT).
TARGET = dict(
    vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
    layer_types=["sliding_attention"] * 2 + ["full_attention"]
    + ["sliding_attention"] * 2 + ["full_attention"],
    sliding_window=8, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=4096,
    initializer_range=0.2, tie_word_embeddings=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                           "partial_rotary_factor": 0.25},
    },
)
PROMPT_LEN = 12


def machine_paths(out):
    """The folders of this run that must not end up in a fixture: where it was written, the
    repository, the home folder, the scratch folder."""
    import tempfile
    folders = {Path(out).resolve(), Path(__file__).resolve().parents[2], Path.home(),
               Path(tempfile.gettempdir()).resolve()}
    return [str(f).encode() for f in folders if str(f) != "/"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspec-src", required=True, help="directory holding the deepspec/ package")
    ap.add_argument("--out", default=str(FIXTURE))
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.deepspec_src))

    import torch
    import transformers
    from transformers import DynamicCache, Gemma4ForCausalLM, Gemma4TextConfig
    from deepspec.eval.dspark.draft_ops import build_dspark_proposal, forward_dspark_draft_block
    from deepspec.modeling.dspark.gemma4.modeling import Gemma4DSparkModel

    torch.set_grad_enabled(False)
    torch.manual_seed(11)
    out = Path(args.out)

    # ---- the target: random weights, norm weights and layer scalars away from 1
    cfg = Gemma4TextConfig(**TARGET)
    cfg._attn_implementation = "eager"
    target = Gemma4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(12)
    for name, p in target.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
    for name, b in target.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=g))
    tdir = out / "target"
    target.save_pretrained(tdir, safe_serialization=True)
    config = json.loads((tdir / "config.json").read_text())
    config["_name_or_path"] = ""
    (tdir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # ---- the prompt through the target, and DeepSpec's taps of it
    drafter = Gemma4DSparkModel.from_pretrained(out, dtype=torch.float32,
                                               attn_implementation="sdpa").eval()
    ids = torch.randint(5, TARGET["vocab_size"], (1, PROMPT_LEN),
                        generator=torch.Generator().manual_seed(13))
    res = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    hs = res.hidden_states
    taps = torch.cat([hs[0 if i == -1 else i + 1] for i in drafter.target_layer_ids], dim=-1)
    logits = res.logits[0, -1]
    anchor = int(logits.argmax())
    top2 = logits.topk(2).values

    # ---- DeepSpec's first block after the prompt
    B = int(drafter.block_size)
    draft_ids = torch.full((1, B), int(drafter.mask_token_id), dtype=torch.long)
    draft_ids[:, 0] = anchor
    block_hidden = forward_dspark_draft_block(
        drafter, draft_input_ids=draft_ids, position_ids=torch.arange(64).unsqueeze(0),
        past_key_values_draft=DynamicCache(), target_hidden_states=taps,
        start=PROMPT_LEN, block_size=B)
    proposal = build_dspark_proposal(
        drafter, draft_input_ids=draft_ids, block_hidden=block_hidden,
        block_size=B, temperature=0.0, confidence_threshold=0.0)
    tokens = proposal.verify_input_ids[0, 1:].tolist()
    hid = block_hidden[:, :B, :]
    corrected = drafter.sample_draft_tokens(
        drafter.compute_logits(hid), first_prev_token_ids=draft_ids[:, 0],
        temperature=0.0, hidden_states=hid)[1][0]
    gaps = (corrected.topk(2, dim=-1).values[:, 0] - corrected.topk(2, dim=-1).values[:, 1])
    prev = torch.tensor([[anchor] + tokens[:-1]])
    conf = torch.sigmoid(drafter.predict_confidence_step(hid, prev_token_ids=prev))[0]

    record = {
        "what": "a tiny random Gemma 4 target's own taps fed to DeepSpec's own drafter: the first block after the prompt",
        "generator": {"transformers": transformers.__version__,
                      "torch": torch.__version__.split("+")[0], "deepspec_commit": "afdfa7c",
                      "dtype": "float32", "device": "cpu"},
        "prompt_ids": ids[0].tolist(),
        "anchor": anchor,
        "anchor_logit_gap": float(top2[0] - top2[1]),
        "block_tokens": tokens,
        "block_logit_gaps": [float(x) for x in gaps],
        "confidence": [float(x) for x in conf],
        "target_layer_ids": list(drafter.target_layer_ids),
    }
    (out / "e2e.json").write_text(json.dumps(record, indent=2) + "\n")
    for f in list(tdir.iterdir()) + [out / "e2e.json"]:
        blob = f.read_bytes()
        for bad in machine_paths(out):
            assert bad not in blob, f"a path of this machine ({bad!r}) in {f.name}"
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
