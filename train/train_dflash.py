#!/usr/bin/env python3
"""Train a DFlash block drafter (z-lab's `DFlashDraftModel` format) for a Gemma 4 target.

The drafter is what `plugins/dflash` serves (block-drafters.md section 3 of the drafter
references). Like DSpark it reads hidden states tapped inside the target (the residual stream
leaving target layers `target_layer_ids`; never the last layer) at every verified position and
drafts a block in one forward, but it is a plain Qwen3 stack with no Markov or confidence head,
and its anchor row predicts nothing:

    context row j:   c_j = rms(fc([tap_a(j) ; tap_b(j) ; ...]), hidden_norm)
    block at P:      h = E[anchor, mask, ..., mask] * sqrt(H)      positions P .. P+B-1
    each layer:      x = rms(h, input_layernorm)
                     q = rope(rms(q_proj x, q_norm));  K = rope(rms(k_proj ., k_norm));  V = v_proj .
                     keys/values of the context rows j < P (from c) and of the whole block (from x),
                     no mask (every layer here is full attention: non-causal), scale head_dim^-1/2
                     h = h + o_proj o;  h = h + down(silu(gate m) * up m),  m = rms(h, post_attention_layernorm)
    row j = 1..B-1:  logits_j = softcap(rms(h_j, norm) E^T)       the target's tied head; drafts P+j

z-lab's checkpoints own no embedding and no LM head (they draft through the target's), so the
saved folder holds only the drafter's own tensors, named as z-lab's module names them.

Training (frozen target, teacher-forced windows of the corpus). z-lab has not released its
trainer; the DFlash paper trains on the target's own outputs with a cross-entropy over the block
rows, random anchors per sequence, and row weights that decay with the row's distance from the
anchor. Here the target's outputs are its distributions over the corpus windows: row j of an
anchor at P learns softmax(target logits at P+j-1) (the target's prediction for P+j, having read
the corpus up to P+j-1) by cross-entropy against those soft labels, weighted exp(-(j-1)/decay)
while P+j lies inside the window. Every window gets --num-anchors random anchors; each anchor's
block sees the context rows j < P, as in z-lab's loop, where the anchor is the token the last
verify produced and its hidden state is not yet known.

`--verify-only MODEL_DIR` (and the end of a training run, when --zlab-src is given) loads the
saved checkpoint into z-lab's own `DFlashDraftModel` and checks that, fed the target's own
taps of a held-out prompt and the target's embedding, it drafts the same block as this module.

Needs torch, numpy, safetensors and transformers with Gemma 4 (the target pass; the check also
needs Qwen3 and z-lab's `dflash/model.py`, fetched, never committed). Reads the flat uint16 token
files of train_tokenizer.py.

  python train/train_dflash.py --target models/gemma4-code-25m-v2 \\
      --train-bin train/data/train.bin --heldout-bin train/data/heldout.bin \\
      --out train/out/dflash --layers 2 --max-minutes 6

Outputs in --out: model/ (config.json, model.safetensors), metrics.json (held-out mean
acceptance length at block sizes 2..B against the target's greedy tokens), train_log.csv.
"""

import argparse
import csv
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trained_for import write as write_trained_for  # noqa: E402

from train_dspark import load_target, rms, rope, sample_anchors, target_pass, windows  # noqa: E402


def default_frequencies(theta, head_dim):
    """The default RoPE rotation: pair j turns with theta^(-2j/D)."""
    return (theta ** (-torch.arange(0, head_dim // 2, dtype=torch.float64) * 2.0 / head_dim)).float()


class DraftLayer(nn.Module):
    """One z-lab draft layer (`Qwen3DFlashDecoderLayer`), every layer full attention."""

    def __init__(self, hidden, heads, kv_heads, head_dim, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.Parameter(torch.ones(head_dim))
        self.k_norm = nn.Parameter(torch.ones(head_dim))
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def keys_values(self, x, positions, inv_freq, eps):
        """Rows x [N, ..., rows, H] -> K (normed, turned), V (as projected), [N, ..., rows, kvh, D]."""
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        k = rope(rms(k, self.k_norm, eps).transpose(-2, -3), positions[..., None, :], inv_freq).transpose(-2, -3)
        return k, v

    def forward(self, h, context, anchors, positions, inv_freq, eps):
        """h [N, A, B, H]: the blocks of A anchors per row of the batch, at `positions`
        [N, A, B]; context (Kc, Vc) [N, L, kvh, D] of context positions 0..L-1; anchors
        [N, A]: block a sees the context rows j < anchors[a] and every row of its own block."""
        n, a, b, _ = h.shape
        kvh, g, d = self.kv_heads, self.heads // self.kv_heads, self.head_dim
        x = rms(h, self.input_layernorm, eps)
        q = self.q_proj(x).unflatten(-1, (self.heads, d))
        q = rope(rms(q, self.q_norm, eps).transpose(-2, -3), positions[..., None, :], inv_freq).transpose(-2, -3)
        q = q * d ** -0.5
        kb, vb = self.keys_values(x, positions, inv_freq, eps)
        kc, vc = context
        length = kc.shape[1]
        # q as [N, kvh, g, A*B, D]: query head kv*g + i is served by key/value head kv.
        qh = q.reshape(n, a * b, kvh, g, d).permute(0, 2, 3, 1, 4)
        kc_h = kc.permute(0, 2, 1, 3)  # [N, kvh, L, D]
        vc_h = vc.permute(0, 2, 1, 3)
        s_ctx = torch.matmul(qh, kc_h[:, :, None].transpose(-1, -2))  # [N, kvh, g, A*B, L]
        visible = torch.arange(length, device=h.device)[None, None, :] < anchors[..., None]  # [N, A, L]
        visible = visible[:, :, None, :].expand(n, a, b, length).reshape(n, 1, 1, a * b, length)
        s_ctx = s_ctx.float().masked_fill(~visible, float("-inf"))
        qb = qh.reshape(n, kvh, g, a, b, d)
        kb_h = kb.permute(0, 3, 1, 2, 4)  # [N, kvh, A, B, D]
        vb_h = vb.permute(0, 3, 1, 2, 4)
        s_blk = torch.matmul(qb, kb_h[:, :, None].transpose(-1, -2)).float()  # [N, kvh, g, A, B, B]
        s_blk = s_blk.reshape(n, kvh, g, a * b, b)
        weights = torch.cat([s_ctx, s_blk], -1).softmax(-1)
        w_ctx = weights[..., :length].to(vc_h.dtype)
        w_blk = weights[..., length:].reshape(n, kvh, g, a, b, b).to(vb_h.dtype)
        o = torch.matmul(w_ctx, vc_h[:, :, None])  # [N, kvh, g, A*B, D]
        o = o + torch.matmul(w_blk, vb_h[:, :, None]).reshape(n, kvh, g, a * b, d)
        o = o.permute(0, 3, 1, 2, 4).reshape(n, a, b, self.heads * d)
        h = h + self.o_proj(o.to(h.dtype))
        m = rms(h, self.post_attention_layernorm, eps)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class DFlash(nn.Module):
    """The drafter without vocabulary tables (the target's embedding and head are passed in)."""

    def __init__(self, hidden, taps, layers, heads, kv_heads, head_dim, ffn, eps, rope_theta, softcap):
        super().__init__()
        self.hidden, self.eps, self.softcap = hidden, eps, softcap
        self.fc = nn.Linear(taps * hidden, hidden, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.layers = nn.ModuleList([DraftLayer(hidden, heads, kv_heads, head_dim, ffn) for _ in range(layers)])
        self.norm = nn.Parameter(torch.ones(hidden))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        self.register_buffer("inv_freq", default_frequencies(rope_theta, head_dim), persistent=False)

    def head(self, hidden, embedding):
        """Soft-capped logits of the target's tied head, float32 (what the host's port returns)."""
        z = torch.matmul(hidden.to(embedding.dtype), embedding.t()).float()
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def blocks(self, taps, anchors, anchor_tokens, mask_id, block, embedding):
        """taps [N, L, T*H] of context positions 0..L-1; anchors [N, A] positions; anchor_tokens
        [N, A]. Returns the logits [N, A, B-1, V] of rows 1..B-1 (row j drafts position P+j)."""
        n, a = anchors.shape
        dtype = self.fc.weight.dtype  # the residual stream's (autocast runs the products in bf16)
        c = rms(self.fc(taps.to(dtype)), self.hidden_norm, self.eps)
        length = c.shape[1]
        ctx_pos = torch.arange(length, device=c.device)[None].expand(n, length)
        ids = torch.full((n, a, block), mask_id, dtype=torch.long, device=anchors.device)
        ids[:, :, 0] = anchor_tokens
        scale = torch.tensor(float(self.hidden) ** 0.5, dtype=embedding.dtype)
        h = (F.embedding(ids, embedding) * scale.to(embedding.device)).to(dtype)
        positions = anchors[..., None] + torch.arange(block, device=anchors.device)
        for layer in self.layers:
            context = layer.keys_values(c, ctx_pos, self.inv_freq, self.eps)
            h = layer(h, context, anchors, positions, self.inv_freq, self.eps)
        return self.head(rms(h[:, :, 1:], self.norm, self.eps), embedding)

    def zlab_state_dict(self):
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm}
        for i, l in enumerate(self.layers):
            p = f"layers.{i}."
            out.update({
                p + "self_attn.q_proj.weight": l.q_proj.weight, p + "self_attn.k_proj.weight": l.k_proj.weight,
                p + "self_attn.v_proj.weight": l.v_proj.weight, p + "self_attn.o_proj.weight": l.o_proj.weight,
                p + "self_attn.q_norm.weight": l.q_norm, p + "self_attn.k_norm.weight": l.k_norm,
                p + "input_layernorm.weight": l.input_layernorm,
                p + "post_attention_layernorm.weight": l.post_attention_layernorm,
                p + "mlp.gate_proj.weight": l.gate_proj.weight, p + "mlp.up_proj.weight": l.up_proj.weight,
                p + "mlp.down_proj.weight": l.down_proj.weight,
            })
        return out


def dflash_config(tcfg, args):
    """config.json as z-lab publishes its drafters: a Qwen3 config with `block_size`,
    `num_target_layers` and `dflash_config` (mask token, taps)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": int(tcfg["vocab_size"]),
        "hidden_size": int(tcfg["hidden_size"]),
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(tcfg["rms_norm_eps"]),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(tcfg.get("max_position_embeddings", 4096)),
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.layers,
        "layer_types": ["full_attention"] * args.layers,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "block_size": args.block_size,
        "num_target_layers": int(tcfg["num_hidden_layers"]),
        "dflash_config": {"mask_token_id": args.mask_token_id, "target_layer_ids": list(args.taps)},
        "dtype": "bfloat16",
    }


def drafter_from_config(cfg, softcap):
    return DFlash(int(cfg["hidden_size"]), len(cfg["dflash_config"]["target_layer_ids"]),
                  int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                  int(cfg["head_dim"]), int(cfg["intermediate_size"]), float(cfg["rms_norm_eps"]),
                  float(cfg["rope_parameters"]["rope_theta"]), softcap)


# ---------------------------------------------------------------------- training
def dflash_loss(model, taps, ids, logits, anchors, args, embedding):
    """Soft-label cross-entropy of rows 1..B-1 against the target's distributions, rows
    weighted exp(-(j-1)/decay) while their position lies inside the window."""
    n, length = ids.shape
    b = args.block_size
    anchor_tokens = torch.gather(ids, 1, anchors)
    z = model.blocks(taps, anchors, anchor_tokens, args.mask_token_id, b, embedding)  # [N, A, B-1, V]
    rows = torch.arange(1, b, device=ids.device)
    drafted_pos = anchors[..., None] + rows  # [N, A, B-1]
    valid = drafted_pos < length
    teacher_pos = (drafted_pos - 1).clamp(max=length - 1)
    teacher = torch.gather(logits, 1, teacher_pos.reshape(n, -1, 1).expand(-1, -1, logits.shape[-1]))
    teacher = teacher.reshape(*teacher_pos.shape, -1).softmax(-1)
    weight = valid.float() * torch.exp(-(rows - 1).float() / args.loss_decay)
    logp = z.log_softmax(-1)
    ce = -(teacher * logp).sum(-1)
    loss = (ce * weight).sum() / (weight.sum() + 1e-6)
    with torch.no_grad():
        hit = (z.argmax(-1) == teacher.argmax(-1)) & valid
        rate = hit.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)
    return loss, rate


def train(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, tcfg = load_target(args.target, device, dtype)
    embedding = target.get_input_embeddings().weight.detach()
    softcap = tcfg.get("final_logit_softcapping")
    assert max(args.taps) < int(tcfg["num_hidden_layers"]) - 1, "never the target's last layer"
    torch.manual_seed(args.seed)
    cfg = dflash_config(tcfg, args)
    model = drafter_from_config(cfg, softcap).to(device)
    with torch.no_grad():  # start the block's final norm where the target's final norm is
        model.norm.copy_(target.model.norm.weight.float())
    if args.init:
        # Go on from a saved drafter of the same shape (its weights; a fresh schedule).
        from safetensors.torch import load_file

        saved = load_file(str(Path(args.init) / "model.safetensors"))
        names = model.zlab_state_dict()
        assert set(saved) == set(names), f"--init {args.init}: tensor names differ"
        with torch.no_grad():
            for name, tensor in names.items():
                tensor.copy_(saved[name].to(tensor.dtype).reshape(tensor.shape))
    params = sum(p.numel() for p in model.parameters())
    print(f"dflash ({args.layers} layers, ffn {args.ffn}, taps {args.taps}, B {args.block_size}): "
          f"{params / 1e6:.3f} M parameters on {device}", flush=True)
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    train_data = np.fromfile(args.train_bin, dtype=np.uint16)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_log.csv", "w", newline="")
    writer = csv.writer(log)
    writer.writerow(["step", "seconds", "loss", "lr"] + [f"hit{j}" for j in range(1, args.block_size)])
    began = time.time()
    step = 0
    while True:
        elapsed = time.time() - began
        progress = max(step / max(args.max_steps, 1), elapsed / (args.max_minutes * 60))
        if progress >= 1.0:
            break
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        ids = windows(train_data, args.batch_size, args.seq_len, rng).to(device)
        taps, logits = target_pass(target, ids, args.taps, softcap)
        anchors = sample_anchors(ids.shape[0], ids.shape[1], args.num_anchors, device, gen)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, rate = dflash_loss(model, taps, ids, logits, anchors, args, embedding)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            value = loss.item()
            writer.writerow([step, round(time.time() - began, 2), round(value, 5), lr]
                            + [round(x, 4) for x in rate.tolist()])
            log.flush()
            print(f"step {step} loss {value:.4f} hit1 {rate[0].item():.3f} hit{args.block_size - 1} "
                  f"{rate[-1].item():.3f} lr {lr:.2e} {time.time() - began:.0f}s", flush=True)
        step += 1
    log.close()
    return target, tcfg, model, cfg, step, time.time() - began


@torch.no_grad()
def evaluate(target, tcfg, model, data, args, device):
    """Held-out acceptance estimate. Every position P of a window (P + B - 1 inside it) is an
    anchor with the corpus token there and the context rows j < P; draft j (row j, for P+j) is
    accepted while it equals the target's greedy token for P+j (the argmax of its logits at
    P+j-1, teacher-forced on the corpus) and every earlier draft was accepted. Mean acceptance
    length = 1 + accepted drafts, as the verify loop counts a round, at block sizes 2..B."""
    model.eval()
    embedding = target.get_input_embeddings().weight.detach()
    softcap = tcfg.get("final_logit_softcapping")
    rng = np.random.default_rng(args.seed + 1)
    b = args.block_size
    run_sum = torch.zeros(b - 1, device=device)
    blocks = 0
    target_nll, target_tokens = 0.0, 0
    for _ in range(args.eval_batches):
        ids = windows(data, args.eval_batch_size, args.seq_len, rng).to(device)
        taps, logits = target_pass(target, ids, args.taps, softcap)
        target_nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                      reduction="sum").item()
        target_tokens += ids[:, 1:].numel()
        greedy = logits.argmax(-1)
        n, length = ids.shape
        anchors = torch.arange(length - b + 1, device=device)[None].expand(n, -1)
        anchor_tokens = torch.gather(ids, 1, anchors)
        # Anchors in slices, so that the block rows of a whole window fit in memory.
        for part in torch.split(torch.arange(anchors.shape[1], device=device), 128):
            a = anchors[:, part]
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                z = model.blocks(taps, a, anchor_tokens[:, part], args.mask_token_id, b, embedding)
            want = torch.gather(greedy, 1, (a[..., None] + torch.arange(b - 1, device=device)).reshape(n, -1))
            run = (z.argmax(-1) == want.reshape(n, -1, b - 1)).long().cumprod(-1)
            run_sum += run.float().sum((0, 1))
            blocks += a.numel()
    per_position = (run_sum / blocks).tolist()
    lengths = [1 + sum(per_position[: j + 1]) for j in range(b - 1)]
    return {
        "blocks": blocks,
        "accepted_per_position": [round(x, 4) for x in per_position],
        "mean_acceptance_length_at_block_size": {str(j + 2): round(x, 4) for j, x in enumerate(lengths)},
        "target_heldout_loss": round(target_nll / max(target_tokens, 1), 4),
    }


def save(model, cfg, out):
    from safetensors.torch import save_file

    model_dir = Path(out) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.zlab_state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return model_dir


# ---------------------------------------------------------------------- z-lab check
@torch.no_grad()
def verify(model_dir, target_path, data, args):
    """Loads MODEL_DIR into this module and into z-lab's own DFlashDraftModel, on the CPU in
    float32. For a held-out prompt of --verify-prompt tokens: the target's taps (z-lab's
    `extract_context_feature`: hidden_states[i + 1]) of all its rows as context and the
    target's greedy next token as anchor (z-lab's first round); and a second block at anchor
    position L/2 (the corpus token there, context rows 0..L/2-1). z-lab's loop reads the block
    through the target's embedding module and `lm_head` (no soft-cap); both must draft the same
    tokens, and the logits agree before the cap."""
    from safetensors.torch import load_file
    from transformers import DynamicCache, Qwen3Config

    spec = importlib.util.spec_from_file_location("zlab_dflash_model", Path(args.zlab_src) / "dflash" / "model.py")
    zlab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zlab)

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    saved = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    target, tcfg = load_target(target_path, "cpu", torch.float32)
    mine = drafter_from_config(cfg, None).float().eval()  # uncapped, as z-lab's loop reads the head
    names = mine.zlab_state_dict()
    assert set(saved) == set(names), f"tensor names differ: {sorted(set(saved) ^ set(names))}"
    for name, tensor in names.items():
        tensor.data.copy_(saved[name].reshape(tensor.shape))

    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")}
    zcfg = Qwen3Config(**kw)
    zcfg.architectures = cfg["architectures"]
    zcfg._attn_implementation = "sdpa"
    theirs = zlab.DFlashDraftModel(zcfg).float().eval()
    missing, unexpected = theirs.load_state_dict(saved, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    assert list(theirs.target_layer_ids) == list(cfg["dflash_config"]["target_layer_ids"])

    embedding = target.get_input_embeddings().weight.detach()
    taps_ids = list(cfg["dflash_config"]["target_layer_ids"])
    b = int(cfg["block_size"])
    mask_id = int(cfg["dflash_config"]["mask_token_id"])
    length = args.verify_prompt
    ids = torch.from_numpy(data[:length].astype(np.int64))[None]
    res = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    their_taps = zlab.extract_context_feature(res.hidden_states, taps_ids)
    my_taps, _ = target_pass(target, ids, taps_ids, None)
    tap_diff = float((their_taps - my_taps).abs().max())
    assert tap_diff == 0.0, f"forward-hook taps differ from hidden_states[i + 1] by {tap_diff}"

    report = []
    for anchor_pos, anchor in ((length, int(res.logits[0, -1].argmax())),
                               (length // 2, int(ids[0, length // 2]))):
        block_ids = torch.full((1, b), mask_id, dtype=torch.long)
        block_ids[0, 0] = anchor
        hidden = theirs(position_ids=torch.arange(anchor_pos + b)[None],
                        noise_embedding=target.model.embed_tokens(block_ids),
                        target_hidden=their_taps[:, :anchor_pos], past_key_values=DynamicCache(),
                        use_cache=True, is_causal=False)[:, 1 - b:, :]
        their_logits = target.lm_head(hidden)[0].float()
        their_tokens = their_logits.argmax(-1).tolist()
        my_logits = mine.blocks(my_taps, torch.tensor([[anchor_pos]]), torch.tensor([[anchor]]), mask_id, b,
                                embedding)[0, 0]
        my_tokens = my_logits.argmax(-1).tolist()
        diff = float((my_logits - their_logits).abs().max())
        ok = my_tokens == their_tokens and diff < 1e-3
        report.append({"anchor_position": anchor_pos, "anchor": anchor, "zlab_tokens": their_tokens,
                       "tokens": my_tokens, "max_logit_diff": diff, "pass": ok})
        print(f"verify at anchor position {anchor_pos}: z-lab drafts {their_tokens}, this module {my_tokens}; "
              f"max |dlogit| {diff:.2e}; {'PASS' if ok else 'FAIL'}", flush=True)
    passed = all(r["pass"] for r in report)
    assert passed, "this module and z-lab's DFlashDraftModel disagree"
    return {"blocks": report, "prompt_tokens": length, "pass": passed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint folder (config.json + safetensors)")
    ap.add_argument("--train-bin")
    ap.add_argument("--heldout-bin", required=True)
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=2, help="draft layers")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--taps", type=int, nargs="+", default=[1, 3, 5, 6], help="target_layer_ids")
    ap.add_argument("--block-size", type=int, default=8, help="B: B-1 drafts a block")
    ap.add_argument("--mask-token-id", type=int, default=4, help="<unused4>: never in the corpus")
    ap.add_argument("--num-anchors", type=int, default=96, help="anchors per training window")
    ap.add_argument("--loss-decay", type=float, default=4.0, help="row j weighs exp(-(j-1) / this)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--max-steps", type=int, default=1000000)
    ap.add_argument("--max-minutes", type=float, default=6.0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--eval-batch-size", type=int, default=8)
    ap.add_argument("--verify-prompt", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="train on the CPU")
    ap.add_argument("--init", metavar="MODEL_DIR", help="start from this saved drafter (same shape)")
    ap.add_argument("--zlab-src", help="folder holding z-lab's dflash/model.py (for the check)")
    ap.add_argument("--verify-only", metavar="MODEL_DIR",
                    help="skip training: check that z-lab's DFlashDraftModel loads MODEL_DIR and drafts what "
                    "this module drafts")
    args = ap.parse_args()
    heldout = np.fromfile(args.heldout_bin, dtype=np.uint16)

    if args.verify_only:
        if not args.zlab_src:
            ap.error("--verify-only needs --zlab-src")
        print(json.dumps(verify(args.verify_only, args.target, heldout, args)))
        return
    if not args.train_bin or not args.out:
        ap.error("--train-bin and --out are needed to train")
    if args.cpu:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    target, tcfg, model, cfg, steps, seconds = train(args)
    # Saved first, so that a failure below never loses the training run.
    model_dir = save(model, cfg, args.out)
    # mlx-spec warns when the drafter runs with another target (trained_for.py).
    write_trained_for(args.target, model_dir)
    device = next(model.parameters()).device
    metrics = {
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": (model_dir / "model.safetensors").stat().st_size,
        "train_steps": steps,
        "train_seconds": round(seconds, 1),
        "args": vars(args),
        "heldout": evaluate(target, tcfg, model, heldout, args, device),
    }
    print(json.dumps(metrics["heldout"]), flush=True)
    (Path(args.out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if args.zlab_src:
        metrics["verify"] = verify(model_dir, args.target, heldout, args)
        (Path(args.out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


if __name__ == "__main__":
    main()
