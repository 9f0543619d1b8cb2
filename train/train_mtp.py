#!/usr/bin/env python3
"""Train a GLM-format multi-token-prediction (MTP) row for a Gemma 4 target.

The row is what `plugins/glm-mtp` serves (the spec: mtp.md section 2 of the drafter
references): one GLM-4.5 (`glm4_moe`) decoder block in dense mode, stored as layer
`model.layers.{N}` (N = the target's layer count) of a `Glm4MoeConfig` checkpoint.
The row at position i reads the target's final-norm hidden h_i and the target's input
embedding of t_{i+1} (Gemma: E[t] * sqrt(H), no per-layer input), and predicts t_{i+2}:

    x      = eh_proj([rms(e, enorm) ; rms(h, hnorm)])          embedding first
    o      = block(x) at RoPE position i                         GQA, qkv bias, q/k norm,
                                                                 partial rotate-half RoPE,
                                                                 dense SwiGLU MLP
    logits = target head(rms(o, shared_head.norm))               tied E^T, softcap 30

Chained step j > 0 of one draft round reads chain(o_{j-1}) (`--chain pre_norm`: o itself;
`post_norm`: rms(o, shared_head.norm)) and the previous draft, at position i + j. The row
keeps its own K/V cache: the rows of every earlier position built from TRUE target hiddens
("prefill"), then the rows of the round in hand.

Training (frozen target, teacher-forced windows of the corpus): every position i of a
window is an anchor at once. Step 0 is the ordinary causal pass over the rows
(h_i, t_{i+1}); step j reads the corpus token t_{i+1+j} and the row's own chained hidden,
at position i + j, and attends to the step-0 rows of positions <= i plus the chained rows
of its own anchor (steps 1..j) -- exactly what the cache holds while serving. Step j learns
the target's own distribution for position i + 2 + j (cross-entropy against the softmax of
the target's logits at i + 1 + j), weighted --step-decay^j.

The block is written from the spec with transformers' parameter names; `--verify-only`
(and the end of every training run) loads the saved checkpoint into transformers' own
`MtpLayer` around `Glm4MoeDecoderLayer`, as the drafter oracle builds it, and checks that
its logits and greedy drafts match this module's on a held-out prompt.

Needs torch, numpy, safetensors, transformers==5.24.0 (with its glm4_moe folder for the
check). Reads the flat uint16 token files of train_tokenizer.py.

  python train/train_mtp.py --target models/gemma4-code-25m-v2 \\
      --train-bin train/data/train.bin --heldout-bin train/data/heldout.bin \\
      --out train/out/mtp --chain pre_norm --max-minutes 6

Outputs in --out: model/ (config.json, model.safetensors), metrics.json (held-out mean
acceptance length of greedy chains at 1..K drafts against the target's greedy tokens, the
transformers check), train_log.csv.
"""

import argparse
import copy
import csv
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trained_for import write as write_trained_for  # noqa: E402

CHAINS = ("pre_norm", "post_norm")


def rms(x, weight, eps):
    """Plain-weight RMSNorm in float32: weight * x / sqrt(mean(x^2) + eps)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class MtpRow(nn.Module):
    """The MTP row: enorm/hnorm, eh_proj, one dense glm4_moe block, shared_head.norm."""

    def __init__(self, hidden, heads, kv_heads, head_dim, ffn, eps, rope_theta, partial):
        super().__init__()
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.ffn, self.eps, self.rope_theta, self.partial = ffn, eps, rope_theta, partial
        self.enorm = nn.Parameter(torch.ones(hidden))
        self.hnorm = nn.Parameter(torch.ones(hidden))
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=True)
        self.q_norm = nn.Parameter(torch.ones(head_dim))
        self.k_norm = nn.Parameter(torch.ones(head_dim))
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.shared_norm = nn.Parameter(torch.ones(hidden))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # RoPE on the first `rotated` dims of each head, rotate-half pairs (j, j + rotated/2).
        self.rotated = int(head_dim * partial)
        exponent = torch.arange(0, self.rotated, 2, dtype=torch.float32) / self.rotated
        self.register_buffer("inv_freq", 1.0 / (rope_theta ** exponent), persistent=False)

    # ------------------------------------------------------------------ pieces
    def rope(self, x, positions):
        """x [B, h, n, D] rotated at positions [n] on its first `rotated` dims."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        r = self.rotated
        head, rest = x[..., :r].float(), x[..., r:]
        half = r // 2
        turned = torch.cat([-head[..., half:], head[..., :half]], -1)
        return torch.cat([(head * cos + turned * sin).to(x.dtype), rest], -1)

    def enter(self, token_embedding, hidden):
        """x = eh_proj([enorm(e) ; hnorm(h)])."""
        joined = torch.cat([rms(token_embedding, self.enorm, self.eps), rms(hidden, self.hnorm, self.eps)], -1)
        return self.eh_proj(joined.to(self.eh_proj.weight.dtype))

    def qkv(self, x, positions):
        b, n, _ = x.shape
        a = rms(x, self.input_layernorm, self.eps)
        q = self.q_proj(a).view(b, n, self.heads, self.head_dim)
        k = self.k_proj(a).view(b, n, self.kv_heads, self.head_dim)
        v = self.v_proj(a).view(b, n, self.kv_heads, self.head_dim)
        q = rms(q, self.q_norm, self.eps).transpose(1, 2)
        k = rms(k, self.k_norm, self.eps).transpose(1, 2)
        v = v.transpose(1, 2)
        return self.rope(q, positions), self.rope(k, positions), v

    def leave(self, x, attended):
        """Residual attention output, then the dense SwiGLU MLP with its residual."""
        b, _, n, _ = attended.shape
        x = x + self.o_proj(attended.transpose(1, 2).reshape(b, n, -1).to(x.dtype))
        f = rms(x, self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(f)) * self.up_proj(f))

    def expand(self, t):
        """kv head k serves query heads k*g .. k*g + g - 1."""
        return t.repeat_interleave(self.heads // self.kv_heads, dim=1)

    # ------------------------------------------------------------------ the chain
    def chain(self, hidden, first_tokens, next_tokens, steps, head, chain_hidden):
        """Runs `steps` chained draft steps for every anchor of a window at once.

        hidden [B, n, H]: the target's final-norm hidden h_i of anchor i = 0..n-1;
        first_tokens [B, n, H]: the embedding of t_{i+1}. Step 0 is the causal pass over these
        rows (positions i). `next_tokens(j, logits)` returns the embedding [B, n, H] of the token
        step j (j >= 1) reads for every anchor, given step j-1's logits. Step j's row of anchor i
        sits at position i + j and attends to the step-0 rows 0..i and to anchor i's own rows of
        steps 1..j. Returns the per-step logits [B, n, V]."""
        b, n, _ = hidden.shape
        device = hidden.device
        base = torch.arange(n, device=device)
        scale = self.head_dim ** -0.5
        causal = base[None, :] <= base[:, None]  # [query anchor i, key position p]: p <= i
        x = self.enter(first_tokens, hidden)
        q, k0, v0 = self.qkv(x, base)
        k0e, v0e = self.expand(k0).float(), self.expand(v0).float()
        scores = (q.float() @ k0e.transpose(-1, -2)) * scale
        attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v0e
        o = self.leave(x, attended)
        logits, normed = head(rms(o, self.shared_norm, self.eps))
        outputs = [logits]
        own_k, own_v = [], []
        for j in range(1, steps):
            carried = o if chain_hidden == "pre_norm" else normed
            x = self.enter(next_tokens(j, logits), carried)
            q, k, v = self.qkv(x, base + j)
            own_k.append(self.expand(k).float())
            own_v.append(self.expand(v).float())
            qf = q.float()
            shared = ((qf @ k0e.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
            own = torch.stack([(qf * kk).sum(-1) * scale for kk in own_k], -1)  # [B, h, n, j]
            weights = torch.cat([shared, own], -1).softmax(-1)
            attended = weights[..., :n] @ v0e
            attended = attended + (weights[..., n:, None] * torch.stack(own_v, -2)).sum(-2)
            o = self.leave(x, attended)
            logits, normed = head(rms(o, self.shared_norm, self.eps))
            outputs.append(logits)
        return outputs

    # ------------------------------------------------------------------ checkpoint
    def glm_state_dict(self, layer):
        p = f"model.layers.{layer}."
        out = {
            p + "enorm.weight": self.enorm,
            p + "hnorm.weight": self.hnorm,
            p + "eh_proj.weight": self.eh_proj.weight,
            p + "input_layernorm.weight": self.input_layernorm,
            p + "self_attn.q_proj.weight": self.q_proj.weight,
            p + "self_attn.q_proj.bias": self.q_proj.bias,
            p + "self_attn.k_proj.weight": self.k_proj.weight,
            p + "self_attn.k_proj.bias": self.k_proj.bias,
            p + "self_attn.v_proj.weight": self.v_proj.weight,
            p + "self_attn.v_proj.bias": self.v_proj.bias,
            p + "self_attn.q_norm.weight": self.q_norm,
            p + "self_attn.k_norm.weight": self.k_norm,
            p + "self_attn.o_proj.weight": self.o_proj.weight,
            p + "post_attention_layernorm.weight": self.post_attention_layernorm,
            p + "mlp.gate_proj.weight": self.gate_proj.weight,
            p + "mlp.up_proj.weight": self.up_proj.weight,
            p + "mlp.down_proj.weight": self.down_proj.weight,
            p + "shared_head.norm.weight": self.shared_norm,
        }
        return {k: v.detach() for k, v in out.items()}


def glm_config(row, tcfg, chain_hidden):
    """config.json: a Glm4MoeConfig dict (dense row: first_k_dense_replace > layer index) and
    the `mlx_spec_mtp` block the plugin reads."""
    layers = int(tcfg["num_hidden_layers"])
    cfg = {
        "architectures": ["Glm4MoeMTPModel"],
        "model_type": "glm4_moe",
        "vocab_size": int(tcfg["vocab_size"]),
        "hidden_size": row.hidden,
        "intermediate_size": row.ffn,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": row.heads,
        "num_key_value_heads": row.kv_heads,
        "head_dim": row.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(tcfg.get("max_position_embeddings", 8192)),
        "rms_norm_eps": row.eps,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "use_qk_norm": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": row.rope_theta,
                            "partial_rotary_factor": row.partial},
        "first_k_dense_replace": layers + 1,
        "moe_intermediate_size": row.ffn,
        "n_routed_experts": 1,
        "num_experts_per_tok": 1,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": tcfg.get("bos_token_id", 2),
        "eos_token_id": tcfg.get("eos_token_id", 1),
        "pad_token_id": tcfg.get("pad_token_id", 0),
        "dtype": "bfloat16",
        "transformers_version": "5.24.0",
        "mlx_spec_mtp": {
            "mtp_layer_index": layers,
            "target_model_type": tcfg.get("model_type", "gemma4_text"),
            "target_num_hidden_layers": layers,
            "target_hidden_size": int(tcfg["hidden_size"]),
            "target_vocab_size": int(tcfg["vocab_size"]),
            "embedding": "target_input_embedding",
            "lm_head": "target_logits_from_hidden",
            "hidden_in": "target_final_norm_output",
            "chain_hidden": chain_hidden,
            "mtp_kv_prefill": True,
            "rope_position": "position_of_hidden",
            "concat_order": "embed_first",
        },
    }
    return cfg


def row_from_config(cfg):
    rope = cfg["rope_parameters"]
    return MtpRow(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                  cfg["head_dim"], cfg["intermediate_size"], float(cfg["rms_norm_eps"]),
                  float(rope["rope_theta"]), float(rope.get("partial_rotary_factor", 1.0)))


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


class TargetHead:
    """The host's ports: input embedding (E[t] * sqrt(H)) and logits from a final hidden
    (tied E^T, then the final softcap)."""

    def __init__(self, target, tcfg):
        self.embed = target.get_input_embeddings()
        self.softcap = tcfg.get("final_logit_softcapping")

    def __call__(self, normed):
        z = normed.to(self.embed.weight.dtype) @ self.embed.weight.t()
        if self.softcap:
            z = torch.tanh(z.float() / self.softcap) * self.softcap
        return z, normed


@torch.no_grad()
def target_pass(target, port, ids):
    """Final-norm hidden [B, L, H] and logits [B, L, V] (from that hidden through the head
    port, as the target computes them), plus the input embeddings [B, L, H]."""
    hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state
    logits, _ = port(hidden)
    return hidden, logits.float(), port.embed(ids)


def windows(data, batch, length, rng):
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    return torch.from_numpy(np.stack([data[s : s + length].astype(np.int64) for s in starts]))


def shifted(embeds, j, n):
    """Rows 0..n-1 reading the embedding of t_{i+1+j}; past the window's end, zeros (those
    rows belong to anchors whose step j is not scored)."""
    part = embeds[:, 1 + j : 1 + j + n]
    if part.shape[1] < n:
        pad = torch.zeros_like(embeds[:, : n - part.shape[1]])
        part = torch.cat([part, pad], 1)
    return part


# ---------------------------------------------------------------------- training
def train(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, tcfg = load_target(args.target, device, dtype)
    port = TargetHead(target, tcfg)
    torch.manual_seed(args.seed)
    row = MtpRow(int(tcfg["hidden_size"]), args.heads, args.kv_heads, args.head_dim, args.ffn,
                 args.eps, args.rope_theta, args.partial_rotary).to(device)
    with torch.no_grad():  # start the output norm where the target's final norm is
        row.shared_norm.copy_(target.model.norm.weight.float())
    params = sum(p.numel() for p in row.parameters())
    print(f"mtp row ({args.chain}): {params / 1e6:.2f} M parameters on {device}", flush=True)
    decay = [p for p in row.parameters() if p.ndim == 2]
    no_decay = [p for p in row.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    train_data = np.fromfile(args.train_bin, dtype=np.uint16)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_log.csv", "w", newline="")
    writer = csv.writer(log)
    writer.writerow(["step", "seconds", "loss", "lr"] + [f"loss_step{j}" for j in range(args.steps)])
    weights = [args.step_decay**j for j in range(args.steps)]
    weights = [w / sum(weights) for w in weights]
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
        hidden, logits, embeds = target_pass(target, port, ids)
        n = ids.shape[1] - 1  # rows: anchors i = 0 .. L-2 (t_{i+1} exists)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            outputs = row.chain(hidden[:, :n], embeds[:, 1 : n + 1],
                                lambda j, _: shifted(embeds, j, n), args.steps, port, args.chain)
        loss = 0.0
        parts = []
        for j, drafted in enumerate(outputs):
            valid = n - j  # anchor i <= L-2-j: the target's logits at i+1+j exist
            teacher = logits[:, 1 + j : 1 + j + valid].softmax(-1)
            student = drafted[:, :valid].float().log_softmax(-1)
            part = -(teacher * student).sum(-1).mean()
            parts.append(part)
            loss = loss + weights[j] * part
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(row.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            value = loss.item()
            writer.writerow([step, round(time.time() - began, 2), value, lr] + [round(p.item(), 4) for p in parts])
            log.flush()
            print(f"step {step} loss {value:.4f} (step0 {parts[0].item():.3f}, last {parts[-1].item():.3f}) "
                  f"lr {lr:.2e} {time.time() - began:.0f}s", flush=True)
        step += 1
    log.close()
    return target, tcfg, port, row, step, time.time() - began


@torch.no_grad()
def evaluate(target, port, row, data, args, device):
    """Acceptance estimate over held-out windows: for each anchor i, step 0 reads h_i and the
    corpus token t_{i+1} (the pending token); each draft is the argmax, and the chain goes on
    with it. Draft j stands for position i + 2 + j, where the target's greedy token is the
    argmax of its logits at i + 1 + j. Counted as 1 + the drafts accepted in a row, as the
    verify loop counts a round."""
    rng = np.random.default_rng(args.seed + 1)
    accepted = torch.zeros(args.steps, device=device)
    anchors_seen = 0
    for _ in range(args.eval_batches):
        ids = windows(data, args.batch_size, args.seq_len, rng).to(device)
        hidden, logits, embeds = target_pass(target, port, ids)
        greedy = logits.argmax(-1)
        n = ids.shape[1] - 1
        anchors = n - args.steps + 1  # every step of these anchors has a target token
        outputs = row.chain(hidden[:, :n].float(), embeds[:, 1 : n + 1].float(),
                            lambda j, prev: port.embed(prev.argmax(-1)).float(), args.steps, port, args.chain)
        still = torch.ones(ids.shape[0], anchors, dtype=torch.bool, device=device)
        for j, drafted in enumerate(outputs):
            still = still & (drafted[:, :anchors].argmax(-1) == greedy[:, 1 + j : 1 + j + anchors])
            accepted[j] += still.float().sum()
        anchors_seen += ids.shape[0] * anchors
    per_position = (accepted / anchors_seen).tolist()
    lengths = [1 + sum(per_position[: k + 1]) for k in range(args.steps)]
    return {"accepted_per_position": per_position, "mean_acceptance_length_at_k": lengths}


def save(row, tcfg, chain_hidden, out):
    from safetensors.torch import save_file

    model_dir = Path(out) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    layer = int(tcfg["num_hidden_layers"])
    state = {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in row.glm_state_dict(layer).items()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = glm_config(row, tcfg, chain_hidden)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return model_dir


# ---------------------------------------------------------------------- transformers check
@torch.no_grad()
def verify(model_dir, target_path, data, args):
    """Loads MODEL_DIR twice: into this module, and into transformers' own MtpLayer around a
    Glm4MoeDecoderLayer (block config with first_k_dense_replace = 1, so its block 0 is the
    dense one; shared_head.norm outside the layer). On a held-out prompt, on the CPU in
    float32: prefill rows (h_i, t_{i+1}), then one round of K chained greedy steps from the
    target's own next token; the two must give the same logits and drafts."""
    from safetensors.torch import load_file
    from transformers import DynamicCache
    from transformers.modeling_layers import MtpLayer
    from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeDecoderLayer, Glm4MoeRMSNorm, Glm4MoeRotaryEmbedding)

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    meta = cfg["mlx_spec_mtp"]
    chain_hidden = meta["chain_hidden"]
    layer_index = meta["mtp_layer_index"]
    saved = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}

    # this module
    mine = row_from_config(cfg)
    names = mine.glm_state_dict(layer_index)
    assert set(saved) == set(names), f"tensor names differ: {sorted(set(saved) ^ set(names))}"
    for name, tensor in names.items():
        tensor.copy_(saved[name])
    mine.eval()

    # transformers
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "mlx_spec_mtp", "model_type",
                                                   "transformers_version", "dtype")}
    glm = Glm4MoeConfig(**kw)
    assert glm.first_k_dense_replace > glm.num_hidden_layers, "the row must be a dense layer"
    blk = copy.deepcopy(glm)
    blk.first_k_dense_replace = 1  # block index 0 inside the MtpLayer -> dense
    blk._attn_implementation = "eager"
    layer = MtpLayer(blk, Glm4MoeDecoderLayer, Glm4MoeRMSNorm, 0, use_post_norm=False).eval().float()
    shared_norm = Glm4MoeRMSNorm(glm.hidden_size, eps=glm.rms_norm_eps).eval().float()
    rotary = Glm4MoeRotaryEmbedding(blk)
    prefix = f"model.layers.{layer_index}."
    hf_state = {}
    for name, tensor in saved.items():
        rest = name[len(prefix):]
        if rest == "shared_head.norm.weight":
            continue
        hf_state[rest if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj") else "mtp_block." + rest] = tensor
    missing, unexpected = layer.load_state_dict(hf_state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    shared_norm.weight.copy_(saved[prefix + "shared_head.norm.weight"])

    target, tcfg = load_target(target_path, "cpu", torch.float32)
    port = TargetHead(target, tcfg)
    assert meta["target_hidden_size"] == tcfg["hidden_size"] and meta["target_vocab_size"] == tcfg["vocab_size"]
    ids = torch.from_numpy(data[: args.verify_prompt].astype(np.int64))[None]
    length = ids.shape[1]
    hidden, logits, _ = target_pass(target, port, ids)
    direct = target(input_ids=ids, use_cache=False).logits.float()
    head_port_diff = float((direct - logits).abs().max())
    assert head_port_diff < 1e-4, f"head port differs from the target's logits by {head_port_diff}"
    pending = int(logits[0, -1].argmax())

    def causal(n_new, n_past):
        q = torch.arange(n_new)[:, None] + n_past
        k = torch.arange(n_past + n_new)[None, :]
        return torch.zeros(n_new, n_past + n_new).masked_fill(k > q, float("-inf"))[None, None]

    def hf_rows(cache, toks, hid, positions):
        e = port.embed(toks)
        pe = rotary(e, positions)
        return layer(e, hid, position_embeddings=pe, attention_mask=causal(toks.shape[1], cache.get_seq_length()),
                     position_ids=positions, cache=cache)

    cache = DynamicCache()
    hf_rows(cache, ids[:, 1:], hidden[:, :-1], torch.arange(length - 1)[None])
    token, hid = torch.tensor([[pending]]), hidden[:, -1:]
    hf_logits, hf_drafts = [], []
    for j in range(args.steps):
        o = hf_rows(cache, token, hid, torch.tensor([[length - 1 + j]]))
        hn = shared_norm(o)
        step_logits, _ = port(hn)
        hf_logits.append(step_logits[0, -1])
        token = step_logits[:, -1:].argmax(-1)
        hf_drafts.append(int(token))
        hid = o if chain_hidden == "pre_norm" else hn
    assert cache.get_seq_length() == length - 1 + args.steps

    # this module: rows of every prompt position, the last one reading the pending token;
    # its last anchor's chain is the round above
    first = torch.cat([port.embed(ids[:, 1:]), port.embed(torch.tensor([[pending]]))], 1)
    outputs = mine.chain(hidden, first, lambda j, prev: port.embed(prev.argmax(-1)), args.steps, port, chain_hidden)
    my_drafts = [int(o[0, -1].argmax()) for o in outputs]
    worst = max(float((o[0, -1] - h).abs().max()) for o, h in zip(outputs, hf_logits))
    ok = my_drafts == hf_drafts and worst < 1e-3
    print(f"verify ({chain_hidden}): transformers MtpLayer(Glm4MoeDecoderLayer) drafts {hf_drafts}, "
          f"this module {my_drafts}; max |dlogit| {worst:.2e}; {'PASS' if ok else 'FAIL'}", flush=True)
    assert ok, "this module and transformers disagree"
    return {"hf_drafts": hf_drafts, "drafts": my_drafts, "max_logit_diff": worst,
            "head_port_max_diff": head_port_diff, "prompt_tokens": length, "pass": ok}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint folder (config.json + safetensors)")
    ap.add_argument("--train-bin")
    ap.add_argument("--heldout-bin", required=True)
    ap.add_argument("--out")
    ap.add_argument("--chain", choices=CHAINS, default="pre_norm", help="chain_hidden convention trained")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--partial-rotary", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=6, help="chained draft steps trained (K)")
    ap.add_argument("--step-decay", type=float, default=0.8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--max-minutes", type=float, default=6.0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--verify-prompt", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="train on the CPU (a smoke test)")
    ap.add_argument("--verify-only", metavar="MODEL_DIR",
                    help="skip training: check that transformers' MtpLayer loads MODEL_DIR and gives "
                    "this module's logits and drafts")
    args = ap.parse_args()
    heldout = np.fromfile(args.heldout_bin, dtype=np.uint16)

    if args.verify_only:
        print(json.dumps(verify(args.verify_only, args.target, heldout, args)))
        return
    if not args.train_bin or not args.out:
        ap.error("--train-bin and --out are needed to train")

    target, tcfg, port, row, steps, seconds = train(args)
    # Saved first, so that a failure below never loses the training run.
    model_dir = save(row, tcfg, args.chain, args.out)
    # mlx-spec warns when the drafter runs with another target (trained_for.py).
    write_trained_for(args.target, model_dir)
    device = next(row.parameters()).device
    metrics = {
        "params": sum(p.numel() for p in row.parameters()),
        "train_steps": steps,
        "train_seconds": round(seconds, 1),
        "args": vars(args),
        "heldout": evaluate(target, port, row.eval(), heldout, args, device),
    }
    print(json.dumps(metrics["heldout"]), flush=True)
    (Path(args.out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    metrics["verify"] = verify(model_dir, args.target, heldout, args)
    (Path(args.out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


if __name__ == "__main__":
    main()
