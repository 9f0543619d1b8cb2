#!/usr/bin/env python3
"""Oracle fixture for the `dflash` drafter: z-lab's own `DFlashDraftModel` with tiny random
weights, drafting for a tiny random Gemma 4 target from the target's own hidden states.

z-lab's module (`dflash/model.py` of github.com/z-lab/dflash, commit 44947fb) is fetched at
setup time and never committed:

    git -C <z-lab/dflash checkout> archive 44947fbf71114e241c96de194f4b382b5dd330d0 dflash \\
        | tar -x -C <SRC>
    <venv with transformers 5.24.0, torch (CPU)>/bin/python tests/oracle/make_dflash_oracle.py \\
        --zlab-src <SRC>

What it does, in z-lab's loop order (`dflash_generate`), in float32 on the CPU:
1. builds a random Gemma 4 target (transformers' `Gemma4ForCausalLM`, 7 dense layers, hidden
   48, vocabulary 300, no per-layer inputs) and a random 3-layer drafter for it with z-lab's
   `DFlashDraftModel` (a Qwen3 config with `block_size`, `num_target_layers` and
   `dflash_config.mask_token_id`; `target_layer_ids` left out so z-lab's default formula picks
   them: [1, 2, 4] for 3 draft layers of a 7-layer target, a tie that Python's round breaks
   to even);
2. runs a 12-token prompt through the target; the anchor is the target's greedy token; the
   context is the taps `hidden_states[i + 1]` of every prompt position (z-lab's
   `extract_context_feature`);
3. drafts a block `[anchor, mask x (B-1)]` with z-lab's forward, draft cache and `crop(start)`;
   (transformers 5.24's `crop` takes a negative count of rows to drop, so the script calls
   `crop(start - cached)`, which keeps `start` rows as z-lab's `crop(start)` did in 4.x);
   the target's embedding (`target.model.embed_tokens`: Gemma's E[t] * sqrt(H)) feeds it and
   the target's tied head reads rows 1..B-1;
4. verifies with the target and FORCES the acceptance: round 1 accepts 2 drafts (the context
   grows by the taps of the anchor and both drafts), round 2 accepts none (the anchor's row
   alone), round 3 is drafted and recorded. The next anchor is the target's greedy token
   after the accepted rows, as in z-lab's loop.

Layer causality. The drafter's `layer_types` mix sliding and full attention with a window (6)
smaller than the context. z-lab's PyTorch attention hands `sliding_window` to transformers'
attention function and passes no mask: the eager and SDPA functions ignore the window (every
layer non-causal), flash-attention applies a symmetric window, non-causal. The serving stacks
(vLLM, SGLang, dflash-mlx) make a sliding layer causal within the block and windowed over
context + block positions, and a full layer non-causal. This script registers one attention
function with transformers (`AttentionInterface`) that builds that mask from z-lab's own
`module.sliding_window` and then calls transformers' eager attention; everything else is
z-lab's module unchanged.

The first round is also recorded with z-lab's attention as it stands on the CPU
(transformers' eager function: every layer non-causal, no window): `r1.stock_eager_logits`
and `r1_stock_eager` in oracle.json.

Logits: z-lab's loop calls `target.lm_head` (no soft-cap); the host's port applies Gemma's
soft-cap (30). Both are recorded (`logits`: capped, what the plugin returns; `raw_logits`).

Writes tests/fixtures/dflash-oracle/{config.json, model.safetensors} (the drafter),
target/{config.json, model.safetensors}, oracle.safetensors, oracle.json. Deterministic
(seeded); no machine path is written.
"""

import argparse
import importlib.util
import json
import os
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dflash-oracle"
ZLAB_COMMIT = "44947fbf71114e241c96de194f4b382b5dd330d0"

TARGET = dict(
    vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
    layer_types=["sliding_attention"] * 2 + ["full_attention"]
    + ["sliding_attention"] * 3 + ["full_attention"],
    sliding_window=8, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=4096,
    initializer_range=0.2, tie_word_embeddings=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                           "partial_rotary_factor": 0.25},
    },
)

DRAFTER = dict(
    architectures=["DFlashDraftModel"], vocab_size=300, hidden_size=48,
    intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=True,
    max_position_embeddings=4096, initializer_range=0.2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    use_sliding_window=True, sliding_window=6, max_window_layers=0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    tie_word_embeddings=False, block_size=6, num_target_layers=7,
    dflash_config={"mask_token_id": 4},
)
PROMPT_LEN = 12
FORCED_ACCEPTANCE = [2, 0]  # after rounds 1 and 2; round 3 is only drafted


def layer_causality_attention(module, query, key, value, attention_mask, scaling,
                              dropout=0.0, **kwargs):
    """Transformers' eager attention with the per-layer mask of the serving stacks: a layer
    with a window is causal and windowed over absolute positions, a full layer sees all."""
    import torch
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    assert attention_mask is None, "z-lab's loop passes no mask"
    window = module.sliding_window
    mask = None
    if window is not None:
        q_len, k_len = query.shape[-2], key.shape[-2]
        # Keys are positions 0..k_len-1 (context then block); queries the last q_len of them.
        q_pos = torch.arange(k_len - q_len, k_len).unsqueeze(1)
        k_pos = torch.arange(k_len).unsqueeze(0)
        allowed = (k_pos <= q_pos) & (q_pos - k_pos < window)
        mask = torch.zeros(q_len, k_len, dtype=query.dtype)
        mask[~allowed] = torch.finfo(query.dtype).min
    return eager_attention_forward(module, query, key, value, mask, scaling=scaling,
                                   dropout=dropout)


def load_zlab(src):
    spec = importlib.util.spec_from_file_location("zlab_dflash_model",
                                                  os.path.join(src, "dflash", "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_paths(out):
    """The folders of this run that must not end up in a fixture: where it was written, the
    repository, the home folder, the scratch folder."""
    import tempfile
    folders = {Path(out).resolve(), Path(__file__).resolve().parents[2], Path.home(),
               Path(tempfile.gettempdir()).resolve()}
    return [str(f).encode() for f in folders if str(f) != "/"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zlab-src", required=True, help="directory holding z-lab's dflash/ package")
    ap.add_argument("--out", default=str(FIXTURE))
    args = ap.parse_args()

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import (AttentionInterface, DynamicCache, Gemma4ForCausalLM,
                              Gemma4TextConfig, Qwen3Config)

    zlab = load_zlab(os.path.abspath(args.zlab_src))
    torch.set_grad_enabled(False)
    torch.manual_seed(21)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # ---- the target: random weights, norm weights and layer scalars away from 1
    tcfg = Gemma4TextConfig(**TARGET)
    tcfg._attn_implementation = "eager"
    target = Gemma4ForCausalLM(tcfg).float().eval()
    g = torch.Generator().manual_seed(22)
    for name, p in target.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
    for name, b in target.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=g))
    tdir = out / "target"
    target.save_pretrained(tdir, safe_serialization=True)
    tconfig = json.loads((tdir / "config.json").read_text())
    tconfig["_name_or_path"] = ""
    (tdir / "config.json").write_text(json.dumps(tconfig, indent=2, sort_keys=True) + "\n")

    # ---- the drafter: z-lab's class, random weights (norms and biases away from 1 and 0)
    AttentionInterface.register("per_layer_causality", layer_causality_attention)
    dcfg = Qwen3Config(**DRAFTER)
    dcfg._attn_implementation = "per_layer_causality"
    drafter = zlab.DFlashDraftModel(dcfg).float().eval()
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    assert drafter.target_layer_ids == [1, 2, 4], drafter.target_layer_ids
    assert [l.self_attn.sliding_window for l in drafter.layers] == [6, None, 6]
    drafter.save_pretrained(out, safe_serialization=True)
    dconfig = json.loads((out / "config.json").read_text())
    dconfig["_name_or_path"] = ""
    dconfig.pop("_attn_implementation", None)
    (out / "config.json").write_text(json.dumps(dconfig, indent=2, sort_keys=True) + "\n")

    # ---- the prompt through the target; z-lab's taps of it
    B = int(drafter.block_size)
    mask_id = int(drafter.mask_token_id)
    cap = float(TARGET["final_logit_softcapping"])
    prompt = torch.randint(5, TARGET["vocab_size"], (1, PROMPT_LEN),
                           generator=torch.Generator().manual_seed(23))

    def target_pass(ids):
        res = target(input_ids=ids, output_hidden_states=True, use_cache=False)
        taps = zlab.extract_context_feature(res.hidden_states, drafter.target_layer_ids)
        return res.logits[0], taps[0]

    logits, taps = target_pass(prompt)
    anchor_gap = float(logits[-1].topk(2).values[0] - logits[-1].topk(2).values[1])
    anchor = int(logits[-1].argmax())
    sequence = prompt[0].tolist()  # verified tokens, positions 0..start-1
    new_taps = taps  # rows not yet in the draft cache
    draft_cache = DynamicCache()
    tensors, rounds = {}, []
    min_gap = float("inf")
    for r in range(len(FORCED_ACCEPTANCE) + 1):
        tag = f"r{r + 1}"
        start = len(sequence)
        cache_before = draft_cache.get_seq_length()
        assert cache_before + new_taps.shape[0] == start
        block = torch.full((1, B), mask_id, dtype=torch.long)
        block[0, 0] = anchor
        noise = target.model.embed_tokens(block)
        position_ids = torch.arange(cache_before, start + B).unsqueeze(0)
        hidden = drafter(target_hidden=new_taps.unsqueeze(0), noise_embedding=noise,
                         position_ids=position_ids, past_key_values=draft_cache,
                         use_cache=True, is_causal=False)
        raw = target.lm_head(hidden[:, 1 - B:, :])[0]
        # z-lab's `crop(start)` (keep `start` rows); transformers 5.24 takes the rows to drop.
        draft_cache.crop(start - draft_cache.get_seq_length())
        assert draft_cache.get_seq_length() == start
        capped = torch.tanh(raw / cap) * cap
        drafts = capped.argmax(-1).tolist()
        assert drafts == raw.argmax(-1).tolist()
        top2 = capped.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        min_gap = min(min_gap, min(gaps))
        tensors[f"{tag}.new_taps"] = new_taps.contiguous()
        tensors[f"{tag}.block_embeddings"] = noise[0].contiguous()
        tensors[f"{tag}.block_hidden"] = hidden[0].contiguous()
        tensors[f"{tag}.logits"] = capped.contiguous()
        tensors[f"{tag}.raw_logits"] = raw.contiguous()
        record = {"tag": tag, "anchor": anchor, "anchor_position": start,
                  "context_rows_before": cache_before, "new_context_rows": new_taps.shape[0],
                  "drafts": drafts, "draft_logit_gaps": gaps}
        if r < len(FORCED_ACCEPTANCE):
            k = FORCED_ACCEPTANCE[r]
            verify = [anchor] + drafts
            logits, taps = target_pass(torch.tensor([sequence + verify]))
            # Rows of the verify window: positions start..start+B-1.
            accepted = verify[: k + 1]
            sequence += accepted
            new_taps = taps[start : start + k + 1]
            next_logits = logits[start + k]
            top2 = next_logits.topk(2).values
            min_gap = min(min_gap, float(top2[0] - top2[1]))
            anchor = int(next_logits.argmax())
            record["forced_accepted"] = k
        rounds.append(record)

    # ---- round 1 again with z-lab's attention as it stands (transformers' eager function:
    # no mask, so every layer non-causal and no window), to show what the convention changes.
    drafter.config._attn_implementation = "eager"
    assert drafter.layers[0].self_attn.config._attn_implementation == "eager"
    r1 = rounds[0]
    block = torch.full((1, B), mask_id, dtype=torch.long)
    block[0, 0] = r1["anchor"]
    hidden = drafter(target_hidden=tensors["r1.new_taps"].unsqueeze(0),
                     noise_embedding=target.model.embed_tokens(block),
                     position_ids=torch.arange(0, PROMPT_LEN + B).unsqueeze(0),
                     past_key_values=DynamicCache(), use_cache=True, is_causal=False)
    stock = torch.tanh(target.lm_head(hidden[:, 1 - B:, :])[0] / cap) * cap
    tensors["r1.stock_eager_logits"] = stock.contiguous()
    stock_top2 = stock.topk(2, dim=-1).values
    stock_record = {"drafts": stock.argmax(-1).tolist(),
                    "min_top2_logit_gap": float((stock_top2[:, 0] - stock_top2[:, 1]).min())}
    assert stock_record["drafts"] != r1["drafts"], "the convention must matter on this fixture"

    save_file(tensors, str(out / "oracle.safetensors"))
    meta = {
        "what": "z-lab's DFlashDraftModel (random weights) drafting for a random Gemma 4 target from the target's own taps; three rounds of one draft cache, acceptance forced to 2 then 0",
        "generator": {"zlab_dflash_commit": ZLAB_COMMIT,
                      "transformers": transformers.__version__,
                      "torch": torch.__version__.split("+")[0], "dtype": "float32",
                      "device": "cpu",
                      "attention": "z-lab's module; sliding layers causal in the window, full layers non-causal (see make_dflash_oracle.py)"},
        "prompt_ids": prompt[0].tolist(),
        "anchor_logit_gap": anchor_gap,
        "block_size": B,
        "mask_token_id": mask_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "min_top2_logit_gap": min_gap,
        "rounds": rounds,
        "r1_stock_eager": stock_record,
    }
    (out / "oracle.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in [p for p in out.rglob("*") if p.is_file()]:
        blob = f.read_bytes()
        for bad in machine_paths(out):
            assert bad not in blob, f"a path of this machine ({bad!r}) in {f.name}"
    print(json.dumps({k: v for k, v in meta.items() if k != "rounds"}, indent=1))
    for r in rounds:
        print(r["tag"], r["anchor"], r["anchor_position"], r["drafts"],
              f"min gap {min(r['draft_logit_gaps']):.4f}")
    assert min_gap > 1e-3, f"a top-2 logit gap of {min_gap} could flip under float32 noise"


if __name__ == "__main__":
    main()
