#!/usr/bin/env python3
"""Train a DSpark block drafter (DeepSpec's `Gemma4DSparkModel` format) for a Gemma 4 target.

The drafter is what `plugins/deepspec` serves (the spec: block-drafters.md section 1 of the
drafter references). It reads hidden states tapped inside the target (the residual stream
leaving target layers `target_layer_ids`, post layer_scalar; never the last layer) at every
verified position, and drafts a whole block in one forward:

    context row j:   c_j = rms(fc([tap_a(j) ; tap_b(j) ; ...]), hidden_norm)
    block at P:      h = E[anchor, mask, ..., mask] * sqrt(H)      positions P .. P+B-1
                     h = draft layers(h): queries of the block, keys/values of the context
                         rows j < P and of the whole block (bidirectional inside it), K = V
                         from k_proj, scale 1, proportional RoPE
                     hB = rms(h, norm);  U = softcap(hB E^T)        the target's tied head
    row k (-> P+k+1): Z_k = U_k + markov_w2(markov_w1[prev_k])     prev_0 = anchor
                     c_k = sigmoid(proj([hB_k ; markov_w1[prev_k]]))

The embedding and LM head are the target's own (frozen): the checkpoint stores neither
(`mlx_spec_shared_vocab`), and the plugin reads them through the target's ports, exactly as
DeepSpec's frozen copies would hold them.

Training (frozen target, teacher-forced windows of the corpus; DeepSpec's recipe): every
window gets --num-anchors random anchor positions; block row k of an anchor at P learns the
token at P+k+1 with loss 0.1 CE(corpus token) + 0.9 L1(softmax Z_k, softmax target logits at
P+k) + 1.0 BCE(c_k, 1 - L1/2), each row weighted exp(-k/4) while its label lies inside the
window. The Markov head reads the corpus token before each row (teacher forcing).

The module here is written from the spec. `--verify-only MODEL_DIR` (and the end of every
training run, when --deepspec-src is given) loads the saved checkpoint into DeepSpec's own
`Gemma4DSparkModel`, gives it the target's embedding and head
(`initialize_embeddings_and_head`) and the target's own taps of a held-out prompt, and checks
that DeepSpec's `forward_dspark_draft_block` + `build_dspark_proposal` draft the same block
(tokens, Markov-corrected logits, confidence logits) as this module.

Needs torch, numpy, safetensors and transformers with Gemma 4 (the target pass); the check
needs DeepSpec's source and the transformers it pins (5.10.2). Reads the flat uint16 token
files of train_tokenizer.py.

  python train/train_dspark.py --target models/gemma4-code-25m-v2 \\
      --train-bin train/data/train.bin --heldout-bin train/data/heldout.bin \\
      --out train/out/dspark --layers 1 --ffn 1536 --markov-rank 64 --max-minutes 6

Outputs in --out: model/ (config.json, model.safetensors), metrics.json (held-out mean
acceptance length at block sizes 1..B and with the confidence cut at a few thresholds, against
the target's greedy tokens), train_log.csv.
"""

import argparse
import csv
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

THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


def rms(x, weight, eps):
    """Gemma 4's RMSNorm in float32 (weight used as is; None: no weight)."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def proportional_frequencies(theta, partial, head_dim):
    """Gemma 4's full-attention RoPE: the first int(partial * D) // 2 pairs turn with
    theta^(-2j/D) (D the whole head), the rest stay still."""
    half = head_dim // 2
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / head_dim)
    inv[int(partial * head_dim) // 2:] = 0.0
    return inv.float()


def rope(x, positions, inv_freq):
    """Rotate-half RoPE of x [..., rows, D] at positions broadcastable to x's rows
    ([..., rows]); pairs (j, j + D/2)."""
    angles = positions.float()[..., None] * inv_freq.to(x.device)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    xf = x.float()
    half = x.shape[-1] // 2
    turned = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + turned * sin).to(x.dtype)


class DraftLayer(nn.Module):
    """One DeepSpec Gemma 4 draft layer (K = V from k_proj, scale 1)."""

    def __init__(self, hidden, heads, kv_heads, head_dim, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.Parameter(torch.ones(head_dim))
        self.k_norm = nn.Parameter(torch.ones(head_dim))
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.pre_feedforward_layernorm = nn.Parameter(torch.ones(hidden))
        self.post_feedforward_layernorm = nn.Parameter(torch.ones(hidden))
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.register_buffer("layer_scalar", torch.ones(1))

    def keys_values(self, x, positions, inv_freq, eps):
        """x [N, ..., rows, H] -> K (normed, turned), V (weightless norm), [N, ..., rows, kvh, D]."""
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        v = rms(k, None, eps)
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
        h = h + rms(self.o_proj(o.to(h.dtype)), self.post_attention_layernorm, eps)
        m = rms(h, self.pre_feedforward_layernorm, eps)
        fed = self.down_proj(F.gelu(self.gate_proj(m), approximate="tanh") * self.up_proj(m))
        h = h + rms(fed, self.post_feedforward_layernorm, eps)
        return h * self.layer_scalar


class DSpark(nn.Module):
    """The drafter without its vocabulary tables (the target's embedding and head are passed in)."""

    def __init__(self, hidden, vocab, taps, layers, heads, kv_heads, head_dim, ffn, markov_rank,
                 eps, rope_theta, partial, softcap):
        super().__init__()
        self.hidden, self.vocab, self.eps, self.softcap = hidden, vocab, eps, softcap
        self.fc = nn.Linear(taps * hidden, hidden, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.layers = nn.ModuleList([DraftLayer(hidden, heads, kv_heads, head_dim, ffn) for _ in range(layers)])
        self.norm = nn.Parameter(torch.ones(hidden))
        self.markov_w1 = nn.Embedding(vocab, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab, bias=False)
        self.confidence = nn.Linear(hidden + markov_rank, 1)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(self.confidence.bias)
        self.register_buffer("inv_freq", proportional_frequencies(rope_theta, partial, head_dim), persistent=False)

    def head(self, hidden, embedding):
        """Soft-capped logits of the target's tied head, float32."""
        z = torch.matmul(hidden.to(embedding.dtype), embedding.t()).float()
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def blocks(self, taps, anchors, anchor_tokens, mask_id, block, embedding):
        """taps [N, L, T*H] of context positions 0..L-1; anchors [N, A] positions (any, even
        >= L); anchor_tokens [N, A]. Returns hB [N, A, B, H] and U [N, A, B, V]."""
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
        hb = rms(h, self.norm, self.eps)
        return hb, self.head(hb, embedding)

    def markov_bias(self, prev):
        return self.markov_w2(self.markov_w1(prev)).float()

    def confidence_logits(self, hb, prev):
        feats = torch.cat([hb, self.markov_w1(prev).to(hb.dtype)], -1)
        return self.confidence(feats).squeeze(-1).float()

    @torch.no_grad()
    def greedy(self, hb, base, anchor_tokens):
        """Left-to-right greedy Markov chain over each block: tokens [N, A, B], the corrected
        logits Z [N, A, B, V], the confidence logits [N, A, B]."""
        prev = anchor_tokens
        tokens, rows, prevs = [], [], []
        for k in range(base.shape[2]):
            z = base[:, :, k] + self.markov_bias(prev)
            prevs.append(prev)
            prev = z.argmax(-1)
            tokens.append(prev)
            rows.append(z)
        prevs = torch.stack(prevs, 2)
        return torch.stack(tokens, 2), torch.stack(rows, 2), self.confidence_logits(hb, prevs)

    def deepspec_state_dict(self):
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm,
               "markov_head.markov_w1.weight": self.markov_w1.weight,
               "markov_head.markov_w2.weight": self.markov_w2.weight,
               "confidence_head.proj.weight": self.confidence.weight,
               "confidence_head.proj.bias": self.confidence.bias}
        for i, l in enumerate(self.layers):
            p = f"layers.{i}."
            out.update({
                p + "self_attn.q_proj.weight": l.q_proj.weight, p + "self_attn.k_proj.weight": l.k_proj.weight,
                p + "self_attn.o_proj.weight": l.o_proj.weight, p + "self_attn.q_norm.weight": l.q_norm,
                p + "self_attn.k_norm.weight": l.k_norm, p + "input_layernorm.weight": l.input_layernorm,
                p + "post_attention_layernorm.weight": l.post_attention_layernorm,
                p + "pre_feedforward_layernorm.weight": l.pre_feedforward_layernorm,
                p + "post_feedforward_layernorm.weight": l.post_feedforward_layernorm,
                p + "mlp.gate_proj.weight": l.gate_proj.weight, p + "mlp.up_proj.weight": l.up_proj.weight,
                p + "mlp.down_proj.weight": l.down_proj.weight, p + "layer_scalar": l.layer_scalar,
            })
        return out


def dspark_config(tcfg, args):
    """config.json: the target's text config, overwritten with the drafter's keys (as
    DeepSpec's build_draft_config does), plus `mlx_spec_shared_vocab`."""
    cfg = {k: v for k, v in tcfg.items() if k not in ("quantization", "quantization_config", "architectures")}
    full = dict(tcfg["rope_parameters"]["full_attention"])
    cfg.update({
        "architectures": ["Gemma4DSparkModel"],
        "target_model_type": tcfg.get("model_type", "gemma4_text"),
        "target_text_model_type": tcfg.get("model_type", "gemma4_text"),
        "num_target_layers": int(tcfg["num_hidden_layers"]),
        "num_hidden_layers": args.layers,
        "layer_types": ["full_attention"] * args.layers,
        "num_attention_heads": args.heads,
        "num_global_key_value_heads": args.kv_heads,
        "global_head_dim": args.head_dim,
        "attention_k_eq_v": True,
        "attention_bias": False,
        "intermediate_size": args.ffn,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": False,
        "target_layer_ids": list(args.taps),
        "block_size": args.block_size,
        "mask_token_id": args.mask_token_id,
        "num_anchors": args.num_anchors,
        "markov_rank": args.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "rope_parameters": {**tcfg["rope_parameters"], "full_attention": full},
        "dtype": "bfloat16",
        "mlx_spec_shared_vocab": True,
    })
    return cfg


def drafter_from_config(cfg):
    full = cfg["rope_parameters"]["full_attention"]
    return DSpark(int(cfg["hidden_size"]), int(cfg["vocab_size"]), len(cfg["target_layer_ids"]),
                  int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]),
                  int(cfg["num_global_key_value_heads"]), int(cfg["global_head_dim"]),
                  int(cfg["intermediate_size"]), int(cfg["markov_rank"]), float(cfg["rms_norm_eps"]),
                  float(full["rope_theta"]), float(full.get("partial_rotary_factor", 1.0)),
                  cfg.get("final_logit_softcapping"))


# ---------------------------------------------------------------------- target
def load_target(path, device, dtype):
    """The target as mlx-spec runs it (a quantized folder is dequantized first)."""
    from transformers import Gemma4ForCausalLM

    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("quantization"):
        from eval_heldout import load_model

        model = load_model(path).to(device=device, dtype=dtype).eval()
    else:
        model = Gemma4ForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg.get("text_config", cfg)


@torch.no_grad()
def target_pass(target, ids, taps, softcap):
    """Taps [N, L, T*H] (the outputs of target layers `taps`, read by forward hooks as DeepSpec's
    cache builder does) and the target's logits [N, L, V] float32 (final norm, tied head, cap)."""
    caught = {}
    hooks = []
    for i in taps:
        def hook(_module, _inputs, output, i=i):
            caught[i] = output[0] if isinstance(output, tuple) else output
        hooks.append(target.model.layers[i].register_forward_hook(hook))
    try:
        hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    weight = target.get_input_embeddings().weight
    logits = torch.matmul(hidden.to(weight.dtype), weight.t()).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.cat([caught[i] for i in taps], -1), logits


def windows(data, batch, length, rng):
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    return torch.from_numpy(np.stack([data[s: s + length].astype(np.int64) for s in starts]))


def sample_anchors(n, length, count, device, gen):
    """`count` distinct random anchors per row in 0..L-2 (the first label exists), sorted."""
    keys = torch.rand(n, length - 1, device=device, generator=gen)
    return keys.topk(min(count, length - 1), dim=-1).indices.sort(-1).values


# ---------------------------------------------------------------------- training
def dspark_loss(model, taps, ids, logits, anchors, args, embedding):
    n, length = ids.shape
    b = args.block_size
    anchor_tokens = torch.gather(ids, 1, anchors)
    hb, base = model.blocks(taps, anchors, anchor_tokens, args.mask_token_id, b, embedding)
    offsets = torch.arange(b, device=ids.device)
    label_pos = anchors[..., None] + offsets + 1  # [N, A, B]
    valid = label_pos < length
    safe = label_pos.clamp(max=length - 1)
    labels = torch.gather(ids[:, None].expand(-1, anchors.shape[1], -1), 2, safe)
    prev = torch.cat([anchor_tokens[..., None], labels[..., :-1]], -1)
    z = base + model.markov_bias(prev)
    teacher = torch.gather(logits, 1, (safe - 1).reshape(n, -1, 1).expand(-1, -1, logits.shape[-1]))
    teacher = teacher.reshape(*safe.shape, -1).softmax(-1)
    weight = valid.float() * torch.exp(-offsets.float() / args.loss_decay)
    denom = weight.sum() + 1e-6
    logp = z.log_softmax(-1)
    ce = -torch.gather(logp, -1, labels[..., None]).squeeze(-1)
    l1 = (logp.exp() - teacher).abs().sum(-1)
    target_conf = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    conf = model.confidence_logits(hb, prev)
    bce = F.binary_cross_entropy_with_logits(conf, target_conf, reduction="none")
    parts = {k: (v * weight).sum() / denom for k, v in (("ce", ce), ("l1", l1), ("bce", bce))}
    loss = args.ce_weight * parts["ce"] + args.l1_weight * parts["l1"] + args.bce_weight * parts["bce"]
    with torch.no_grad():
        rate = (target_conf * valid).sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)
    return loss, parts, rate


def train(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, tcfg = load_target(args.target, device, dtype)
    embedding = target.get_input_embeddings().weight.detach()
    softcap = tcfg.get("final_logit_softcapping")
    assert max(args.taps) < int(tcfg["num_hidden_layers"]) - 1, "never the target's last layer"
    torch.manual_seed(args.seed)
    cfg = dspark_config(tcfg, args)
    model = drafter_from_config(cfg).to(device)
    with torch.no_grad():  # start the block's final norm where the target's final norm is
        model.norm.copy_(target.model.norm.weight.float())
    params = sum(p.numel() for p in model.parameters())
    print(f"dspark ({args.layers} layers, ffn {args.ffn}, markov {args.markov_rank}, taps {args.taps}, "
          f"B {args.block_size}): {params / 1e6:.3f} M parameters on {device}", flush=True)
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
    writer.writerow(["step", "seconds", "loss", "ce", "l1", "bce", "lr"] + [f"rate{k}" for k in range(args.block_size)])
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
            loss, parts, rate = dspark_loss(model, taps, ids, logits, anchors, args, embedding)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            value = loss.item()
            writer.writerow([step, round(time.time() - began, 2), round(value, 5)]
                            + [round(parts[k].item(), 5) for k in ("ce", "l1", "bce")] + [lr]
                            + [round(x, 4) for x in rate.tolist()])
            log.flush()
            print(f"step {step} loss {value:.4f} ce {parts['ce'].item():.3f} l1 {parts['l1'].item():.3f} "
                  f"bce {parts['bce'].item():.3f} rate0 {rate[0].item():.3f} rate{args.block_size - 1} "
                  f"{rate[-1].item():.3f} lr {lr:.2e} {time.time() - began:.0f}s", flush=True)
        step += 1
    log.close()
    return target, tcfg, model, cfg, step, time.time() - began


@torch.no_grad()
def evaluate(target, tcfg, model, data, args, device):
    """Held-out acceptance estimate. Every position P of a window (P + B - 1 inside it) is an
    anchor with the corpus token there and the context rows j < P; the block is drafted
    greedily (Markov chain on the drafts), and draft k is accepted while it equals the target's
    greedy token for P+k+1 (argmax of its logits at P+k, teacher-forced on the corpus) and every
    earlier draft was accepted. Mean acceptance length = 1 + accepted drafts, at block sizes
    1..B, and with the block cut at its first row whose confidence is below a threshold."""
    model.eval()
    embedding = target.get_input_embeddings().weight.detach()
    softcap = tcfg.get("final_logit_softcapping")
    rng = np.random.default_rng(args.seed + 1)
    b = args.block_size
    run_sum = torch.zeros(b, device=device)
    cut = {t: [0.0, 0.0] for t in THRESHOLDS}  # accepted, proposed
    conf_sum = torch.zeros(b, device=device)
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
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            hb, base = model.blocks(taps, anchors, anchor_tokens, args.mask_token_id, b, embedding)
            tokens, _, conf = model.greedy(hb, base, anchor_tokens)
        want = torch.gather(greedy, 1, (anchors[..., None] + torch.arange(b, device=device)).reshape(n, -1))
        match = tokens == want.reshape(n, -1, b)
        run = match.long().cumprod(-1)
        run_sum += run.float().sum((0, 1))
        accepted = run.sum(-1)
        c = conf.float().sigmoid()
        conf_sum += c.sum((0, 1))
        for t in THRESHOLDS:
            below = c < t
            first = torch.where(below.any(-1), below.float().argmax(-1), torch.full_like(accepted, b))
            cut[t][0] += torch.minimum(accepted, first).float().sum().item()
            cut[t][1] += first.float().sum().item()
        blocks += anchors.numel()
    per_position = (run_sum / blocks).tolist()
    lengths = [1 + sum(per_position[: k + 1]) for k in range(b)]
    return {
        "blocks": blocks,
        "accepted_per_position": [round(x, 4) for x in per_position],
        "mean_acceptance_length_at_block_size": [round(x, 4) for x in lengths],
        "mean_confidence_per_position": [round(x, 4) for x in (conf_sum / blocks).tolist()],
        "confidence_cut": {str(t): {"mean_acceptance_length": round(1 + a / blocks, 4),
                                    "mean_proposed": round(p / blocks, 4)} for t, (a, p) in cut.items()},
        "target_heldout_loss": round(target_nll / max(target_tokens, 1), 4),
    }


def save(model, cfg, out):
    from safetensors.torch import save_file

    model_dir = Path(out) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.deepspec_state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return model_dir


# ---------------------------------------------------------------------- DeepSpec check
@torch.no_grad()
def verify(model_dir, target_path, data, args):
    """Loads MODEL_DIR into this module and into DeepSpec's own Gemma4DSparkModel (with the
    target's embedding and head injected as its frozen copies), on the CPU in float32. For a
    held-out prompt of --verify-prompt tokens: the target's taps (DeepSpec's
    hidden_states[i + 1]) of all its rows as context, anchor = the target's greedy next token
    at position L (DeepSpec's first round); and a second block at anchor position L/2 (the
    corpus token there, context rows 0..L/2-1). Both must agree on the block's tokens, the
    Markov-corrected logits and the confidence logits."""
    sys.path.insert(0, os.path.abspath(args.deepspec_src))
    from safetensors.torch import load_file
    from transformers import DynamicCache, Gemma4TextConfig
    from deepspec.eval.dspark.draft_ops import build_dspark_proposal, forward_dspark_draft_block
    from deepspec.modeling.dspark.gemma4.modeling import Gemma4DSparkModel

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    saved = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    assert cfg.get("mlx_spec_shared_vocab") and "embed_tokens.weight" not in saved and "lm_head.weight" not in saved

    mine = drafter_from_config(cfg).float().eval()
    names = mine.deepspec_state_dict()
    assert set(saved) == set(names), f"tensor names differ: {sorted(set(saved) ^ set(names))}"
    for name, tensor in names.items():
        tensor.data.copy_(saved[name].reshape(tensor.shape))

    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "transformers_version", "dtype")}
    dcfg = Gemma4TextConfig(**kw)
    dcfg.architectures = cfg["architectures"]
    dcfg._attn_implementation = "sdpa"
    theirs = Gemma4DSparkModel(dcfg).float().eval()
    missing, unexpected = theirs.load_state_dict(saved, strict=False)
    assert set(missing) == {"embed_tokens.weight", "lm_head.weight"} and not unexpected, (missing, unexpected)

    target, tcfg = load_target(target_path, "cpu", torch.float32)
    embedding = target.get_input_embeddings().weight.detach()
    vocab, hidden = embedding.shape
    embed = nn.Embedding(vocab, hidden)
    embed.weight.data.copy_(embedding)
    head = nn.Linear(hidden, vocab, bias=False)
    head.weight.data.copy_(embedding)
    theirs.initialize_embeddings_and_head(embed_tokens=embed, lm_head=head)
    assert abs(float(theirs.embed_tokens.embed_scale) - float(hidden) ** 0.5) < 1e-5

    taps_ids = list(cfg["target_layer_ids"])
    b = int(cfg["block_size"])
    mask_id = int(cfg["mask_token_id"])
    length = args.verify_prompt
    ids = torch.from_numpy(data[:length].astype(np.int64))[None]
    res = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    their_taps = torch.cat([res.hidden_states[0 if i == -1 else i + 1] for i in taps_ids], -1)
    my_taps, my_logits = target_pass(target, ids, taps_ids, tcfg.get("final_logit_softcapping"))
    tap_diff = float((their_taps - my_taps).abs().max())
    head_diff = float((res.logits.float() - my_logits).abs().max())
    assert tap_diff == 0.0, f"forward-hook taps differ from hidden_states[i + 1] by {tap_diff}"
    assert head_diff < 1e-4, f"the head port differs from the target's logits by {head_diff}"

    report = []
    for anchor_pos, anchor in ((length, int(res.logits[0, -1].argmax())),
                               (length // 2, int(ids[0, length // 2]))):
        draft_ids = torch.full((1, b), mask_id, dtype=torch.long)
        draft_ids[0, 0] = anchor
        block_hidden = forward_dspark_draft_block(
            theirs, draft_input_ids=draft_ids, position_ids=torch.arange(anchor_pos + b)[None],
            past_key_values_draft=DynamicCache(), target_hidden_states=their_taps[:, :anchor_pos],
            start=anchor_pos, block_size=b)
        proposal = build_dspark_proposal(theirs, draft_input_ids=draft_ids, block_hidden=block_hidden,
                                         block_size=b, temperature=0.0, confidence_threshold=0.0)
        their_tokens = proposal.verify_input_ids[0, 1:].tolist()
        hid = block_hidden[:, :b]
        their_z = theirs.sample_draft_tokens(theirs.compute_logits(hid), first_prev_token_ids=draft_ids[:, 0],
                                             temperature=0.0, hidden_states=hid)[1][0]
        prev = torch.tensor([[anchor] + their_tokens[:-1]])
        their_conf = theirs.predict_confidence_step(hid, prev_token_ids=prev)[0]

        hb, base = mine.blocks(my_taps, torch.tensor([[anchor_pos]]), torch.tensor([[anchor]]), mask_id, b, embedding)
        tokens, z, conf = mine.greedy(hb, base, torch.tensor([[anchor]]))
        my_tokens = tokens[0, 0].tolist()
        z_diff = float((z[0, 0] - their_z).abs().max())
        c_diff = float((conf[0, 0] - their_conf).abs().max())
        ok = my_tokens == their_tokens and z_diff < 1e-3 and c_diff < 1e-3
        report.append({"anchor_position": anchor_pos, "anchor": anchor, "deepspec_tokens": their_tokens,
                       "tokens": my_tokens, "max_logit_diff": z_diff, "max_confidence_logit_diff": c_diff,
                       "deepspec_confidence": [round(x, 4) for x in their_conf.sigmoid().tolist()], "pass": ok})
        print(f"verify at anchor position {anchor_pos}: DeepSpec drafts {their_tokens}, this module {my_tokens}; "
              f"max |dZ| {z_diff:.2e}, max |dconf| {c_diff:.2e}; {'PASS' if ok else 'FAIL'}", flush=True)
    passed = all(r["pass"] for r in report)
    assert passed, "this module and DeepSpec's Gemma4DSparkModel disagree"
    return {"blocks": report, "head_port_max_diff": head_diff, "prompt_tokens": length, "pass": passed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint folder (config.json + safetensors)")
    ap.add_argument("--train-bin")
    ap.add_argument("--heldout-bin", required=True)
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=1, help="draft layers")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128, help="global_head_dim")
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--taps", type=int, nargs="+", default=[1, 3, 5, 6], help="target_layer_ids")
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--mask-token-id", type=int, default=4, help="<unused4>: never in the corpus")
    ap.add_argument("--num-anchors", type=int, default=96, help="anchors per training window")
    ap.add_argument("--loss-decay", type=float, default=4.0, help="row k weighs exp(-k / this)")
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--l1-weight", type=float, default=0.9)
    ap.add_argument("--bce-weight", type=float, default=1.0)
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
    ap.add_argument("--cpu", action="store_true", help="train on the CPU (a smoke test)")
    ap.add_argument("--deepspec-src", help="folder holding DeepSpec's deepspec/ package (for the check)")
    ap.add_argument("--verify-only", metavar="MODEL_DIR",
                    help="skip training: check that DeepSpec's Gemma4DSparkModel loads MODEL_DIR and drafts "
                    "what this module drafts")
    args = ap.parse_args()
    heldout = np.fromfile(args.heldout_bin, dtype=np.uint16)

    if args.verify_only:
        if not args.deepspec_src:
            ap.error("--verify-only needs --deepspec-src")
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
    if args.deepspec_src:
        metrics["verify"] = verify(model_dir, args.target, heldout, args)
        (Path(args.out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


if __name__ == "__main__":
    main()
