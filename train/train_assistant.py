#!/usr/bin/env python3
"""Train a Gemma 4 assistant drafter (Google's released format) for a Gemma 4 target.

The drafter is what `plugins/assistant` serves and what transformers loads as
`Gemma4AssistantForCausalLM`: four layers that attend only to the target's own K/V (the last
sliding and the last full KV-owning layer of the target), fed `concat(target embedding of a
token, a hidden state)`, at one fixed query position per round, with its own tied LM head.

Training follows how the drafter is served (plugins/assistant/README.md): for an anchor token
at position P (the token the target has not yet processed), step 0 reads the target's
final-norm hidden state at P - 1 and the target's embedding of x_P; step s > 0 reads the
embedding of x_{P+s} and the drafter's own projected output of step s - 1. Every step's query
sits at P and sees the donor entries of positions before P (full layers: all of them; sliding
layers: the last window + 1). Step s learns the target's own distribution for position
P + s + 1 (the target's logits at P + s, teacher-forced on the corpus), weighted by
--step-decay^s. Every position of a window is an anchor at once: the per-anchor visibility is
one [L, L] mask, and the K steps are K passes of the small stack over all anchors.

The module here is written from the drafter's math, with transformers' parameter names, so
the saved checkpoint loads with Gemma4AssistantForCausalLM.from_pretrained; --verify checks
that it does and that transformers' own forward drafts what this module drafts.

Needs torch, numpy, safetensors, transformers==5.24.0. Reads token files written by
train_tokenizer.py (flat little-endian uint16).

  python train/train_assistant.py --target models/gemma4-code-25m-v2 \\
      --train-bin train/data/train.bin --heldout-bin train/data/heldout.bin \\
      --out train/out/assistant --max-minutes 6

Outputs in --out: model/ (config.json, model.safetensors, generation_config.json),
metrics.json (held-out mean acceptance length of greedy chains at 1..K drafts against the
target's greedy tokens, the loss curve), train_log.csv.
"""

import argparse
import csv
import json
import math
import time
from pathlib import Path

import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trained_for import write as write_trained_for  # noqa: E402

SLIDING = "sliding_attention"
FULL = "full_attention"


def rms(x, weight, eps):
    """Gemma 4's RMSNorm, in float32: x / sqrt(mean(x^2) + eps) * weight (weight as is)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def inverse_frequencies(rope, head_dim):
    """The target's RoPE for one layer kind: default, or proportional (only the first
    partial_rotary_factor of the pairs turn, at full-width frequencies)."""
    theta = float(rope.get("rope_theta", 10000.0))
    half = head_dim // 2
    freq = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / head_dim)
    if rope.get("rope_type", "default") == "proportional":
        rotated = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim) // 2
        freq[rotated:] = 0.0
        freq = freq / float(rope.get("factor", 1.0))
    return freq.float()


def rotate(q, positions, inv_freq):
    """Rotate-half RoPE of q [B, H, L, D] at `positions` [L]."""
    angles = positions.float()[:, None] * inv_freq[None, :].to(q.device)
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, None]
    half = q.shape[-1] // 2
    rotated = torch.cat([-q[..., half:], q[..., :half]], -1)
    return (q.float() * cos + rotated.float() * sin).to(q.dtype)


class Layer(nn.Module):
    def __init__(self, d, heads, head_dim, ffn):
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.q_norm = nn.Parameter(torch.ones(head_dim))
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.pre_feedforward_layernorm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)
        self.post_feedforward_layernorm = nn.Parameter(torch.ones(d))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.heads, self.head_dim = heads, head_dim

    def forward(self, a, donor, mask, positions, inv_freq, eps):
        keys, values = donor  # [B, kvh, L, D], the target's, frozen
        b, length, _ = a.shape
        y = rms(a, self.input_layernorm, eps)
        q = self.q_proj(y).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        q = rms(q, self.q_norm, eps)
        q = rotate(q, positions, inv_freq)
        group = self.heads // keys.shape[1]
        k = keys.repeat_interleave(group, dim=1).to(q.dtype)
        v = values.repeat_interleave(group, dim=1).to(q.dtype)
        # Scale 1.0: q_norm and the target's k_norm play the role of 1/sqrt(d).
        scores = (q.float() @ k.float().transpose(-1, -2)).masked_fill(~mask, -1e30)
        attended = (scores.softmax(-1) @ v.float()).to(q.dtype)
        attended = attended.transpose(1, 2).reshape(b, length, -1)
        a = a + rms(self.o_proj(attended), self.post_attention_layernorm, eps)
        f = rms(a, self.pre_feedforward_layernorm, eps)
        m = self.down_proj(F.gelu(self.gate_proj(f), approximate="tanh") * self.up_proj(f))
        a = a + rms(m, self.post_feedforward_layernorm, eps)
        return a * self.layer_scalar


class Assistant(nn.Module):
    """The assistant drafter's forward over many anchors at once."""

    def __init__(self, target_cfg, d, heads, ffn, num_layers=4):
        super().__init__()
        t = target_cfg
        self.backbone = t["hidden_size"]
        self.vocab = t["vocab_size"]
        self.eps = float(t.get("rms_norm_eps", 1e-6))
        self.window = int(t["sliding_window"])
        self.kinds = layer_kinds(num_layers)
        self.head_dims = {SLIDING: t["head_dim"], FULL: t.get("global_head_dim") or t["head_dim"]}
        self.embed_tokens = nn.Embedding(self.vocab, d)
        self.pre_projection = nn.Linear(2 * self.backbone, d, bias=False)
        self.post_projection = nn.Linear(d, self.backbone, bias=False)
        self.layers = nn.ModuleList(Layer(d, heads, self.head_dims[k], ffn) for k in self.kinds)
        self.norm = nn.Parameter(torch.ones(d))
        rope = t["rope_parameters"]
        self.inv_freq = {k: inverse_frequencies(rope[k], self.head_dims[k]) for k in (SLIDING, FULL)}
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def masks(self, length, device):
        """visible[P, k]: anchor P sees donor position k (full: k < P; sliding: the last
        window + 1 positions before P)."""
        p = torch.arange(length, device=device)[:, None]
        k = torch.arange(length, device=device)[None, :]
        full = k < p
        sliding = full & (k >= p - 1 - self.window)
        return {FULL: full[None, None], SLIDING: sliding[None, None]}

    def step(self, token_embedding, hidden, donors, masks, positions):
        """One draft step for every anchor: (logits [B, L, V], projected hidden [B, L, H_b])."""
        # The target's tensors come in its dtype (bf16 on the GPU); outside autocast (the
        # held-out evaluation) they must meet the drafter's float32 weights.
        joined = torch.cat([token_embedding, hidden], -1).to(self.pre_projection.weight.dtype)
        a = self.pre_projection(joined)
        for layer, kind in zip(self.layers, self.kinds):
            a = layer(a, donors[kind], masks[kind], positions, self.inv_freq[kind], self.eps)
        z = rms(a, self.norm, self.eps)
        logits = z @ self.embed_tokens.weight.t()
        return logits, self.post_projection(z)

    def hf_state_dict(self):
        """Parameters under transformers' names."""
        out = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm,
            "pre_projection.weight": self.pre_projection.weight,
            "post_projection.weight": self.post_projection.weight,
        }
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm
            out[p + "self_attn.q_proj.weight"] = layer.q_proj.weight
            out[p + "self_attn.q_norm.weight"] = layer.q_norm
            out[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
            out[p + "pre_feedforward_layernorm.weight"] = layer.pre_feedforward_layernorm
            out[p + "mlp.gate_proj.weight"] = layer.gate_proj.weight
            out[p + "mlp.up_proj.weight"] = layer.up_proj.weight
            out[p + "mlp.down_proj.weight"] = layer.down_proj.weight
            out[p + "post_feedforward_layernorm.weight"] = layer.post_feedforward_layernorm
            out[p + "layer_scalar"] = layer.layer_scalar
        return {k: v.detach() for k, v in out.items()}


def layer_kinds(num_layers):
    """Sliding layers, then one full layer last, as the released drafters stack them (four
    layers there; fewer here make each draft step cheaper for a small target)."""
    return [SLIDING] * (num_layers - 1) + [FULL]


def assistant_config(target_cfg, d, heads, ffn, num_layers=4):
    """config.json in the released flat form."""
    t = target_cfg
    text = {
        "model_type": "gemma4_text",
        "hidden_size": d,
        "intermediate_size": ffn,
        "num_hidden_layers": num_layers,
        "layer_types": layer_kinds(num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": t["num_key_value_heads"],
        "num_global_key_value_heads": t.get("num_global_key_value_heads") or t["num_key_value_heads"],
        "attention_k_eq_v": bool(t.get("attention_k_eq_v", False)),
        "head_dim": t["head_dim"],
        "global_head_dim": t.get("global_head_dim") or t["head_dim"],
        "sliding_window": t["sliding_window"],
        "rope_parameters": t["rope_parameters"],
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": t["vocab_size"],
        "num_kv_shared_layers": num_layers,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "max_position_embeddings": t.get("max_position_embeddings", 8192),
        "bos_token_id": t.get("bos_token_id", 2),
        "eos_token_id": t.get("eos_token_id", 1),
        "pad_token_id": t.get("pad_token_id", 0),
    }
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "text_config": text,
        "backbone_hidden_size": t["hidden_size"],
        "use_ordered_embeddings": False,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "transformers_version": "5.24.0",
    }


def load_target(path, device, dtype):
    """The target as mlx-spec runs it: a quantized folder (mlx-community affine layout) is
    dequantized first, so the drafter learns the distributions it will be verified against."""
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
def target_pass(target, ids):
    """The target over a window: its logits [B, L, V], final-norm hidden [B, L, H], scaled
    embeddings [B, L, H] and donor K/V per layer kind, all from one forward."""
    from transformers import DynamicCache

    out = target(
        input_ids=ids,
        cache=DynamicCache(config=target.config),
        use_cache=True,
        output_hidden_states=True,
        return_shared_kv_states=True,
    )
    donors = {kind: (kv[0], kv[1]) for kind, kv in out.shared_kv_states.items()}
    embeds = target.get_input_embeddings()(ids)
    return out.logits.float(), out.hidden_states[-1], embeds, donors


def chain(assistant, embeds, hidden, donors, steps):
    """Runs `steps` teacher-forced draft steps for every anchor P = 1 .. L - steps - 1 at
    once. Step 0 reads the embedding of x_P and the target's hidden at P - 1; step s the
    embedding of x_{P+s} and the drafter's own hidden of step s - 1. Returns the per-step
    logits [B, A, V] (A anchors)."""
    length = embeds.shape[1]
    anchors = length - steps - 1
    device = embeds.device
    masks = assistant.masks(length, device)
    positions = torch.arange(length, device=device)
    # Anchor P sits in row P; row 0 has no visible donor entry and is dropped below.
    hidden_in = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
    token_embedding = embeds
    outputs = []
    for s in range(steps):
        logits, projected = assistant.step(token_embedding, hidden_in, donors, masks, positions)
        outputs.append(logits[:, 1 : anchors + 1])
        hidden_in = projected
        # Row P next reads x_{P+s+1}: the embeddings shifted left by s + 1.
        token_embedding = torch.cat([embeds[:, s + 1 :], torch.zeros_like(embeds[:, : s + 1])], 1)
    return outputs


def windows(data, batch, length, rng):
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    return torch.from_numpy(np.stack([data[s : s + length].astype(np.int64) for s in starts]))


def train(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, tcfg = load_target(args.target, device, dtype)
    torch.manual_seed(args.seed)
    assistant = Assistant(tcfg, args.hidden, args.heads, args.ffn, args.layers).to(device)
    params = sum(p.numel() for p in assistant.parameters())
    print(f"assistant: {params / 1e6:.2f} M parameters on {device}", flush=True)
    decay = [p for n, p in assistant.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in assistant.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    train_data = np.fromfile(args.train_bin, dtype=np.uint16)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_log.csv", "w", newline="")
    writer = csv.writer(log)
    writer.writerow(["step", "seconds", "loss", "lr"])
    weights = torch.tensor([args.step_decay**s for s in range(args.steps)], device=device)
    weights = weights / weights.sum()
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
        logits, hidden, embeds, donors = target_pass(target, ids)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            outputs = chain(assistant, embeds, hidden, donors, args.steps)
        anchors = outputs[0].shape[1]
        loss = 0.0
        for s, drafted in enumerate(outputs):
            # Step s of anchor P predicts position P + s + 1: the target's logits at P + s.
            teacher = logits[:, 1 + s : 1 + s + anchors].softmax(-1)
            student = drafted.float().log_softmax(-1)
            loss = loss + weights[s] * -(teacher * student).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(assistant.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            value = loss.item()
            writer.writerow([step, round(time.time() - began, 2), value, lr])
            log.flush()
            print(f"step {step} loss {value:.4f} lr {lr:.2e} {time.time() - began:.0f}s", flush=True)
        step += 1
    log.close()
    return target, tcfg, assistant, step, time.time() - began


@torch.no_grad()
def evaluate(target, assistant, data, args, device):
    """An estimate of the acceptance the drafter will see, over held-out windows: for each
    anchor x_P (the corpus' token), greedy chains of 1..K drafts compared with the target's
    greedy token at each position, teacher-forced on the corpus (so a chain is measured where
    the target's own continuation and the corpus agree); 1 + the accepted drafts, as the verify
    loop counts a round. The real figure comes from `mlx-spec bench` (BENCHMARKS.md)."""
    rng = np.random.default_rng(args.seed + 1)
    embed = target.get_input_embeddings()
    accepted = torch.zeros(args.steps, device=device)
    anchors_seen = 0
    for _ in range(args.eval_batches):
        ids = windows(data, args.batch_size, args.seq_len, rng).to(device)
        logits, hidden, embeds, donors = target_pass(target, ids)
        greedy = logits.argmax(-1)  # the target's token after each position
        length = ids.shape[1]
        anchors = length - args.steps - 1
        masks = assistant.masks(length, device)
        positions = torch.arange(length, device=device)
        hidden_in = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
        token_embedding = embeds
        still = torch.ones(ids.shape[0], anchors, dtype=torch.bool, device=device)
        for s in range(args.steps):
            out, projected = assistant.step(token_embedding, hidden_in, donors, masks, positions)
            drafted = out.argmax(-1)
            # Draft s of anchor P stands for position P + s + 1: the target's greedy token
            # there is its argmax at P + s.
            still = still & (drafted[:, 1 : anchors + 1] == greedy[:, 1 + s : 1 + s + anchors])
            accepted[s] += still.float().sum()
            hidden_in = projected
            token_embedding = embed(drafted)
        anchors_seen += ids.shape[0] * anchors
    per_position = (accepted / anchors_seen).tolist()
    lengths = [1 + sum(per_position[: k + 1]) for k in range(args.steps)]
    return {"accepted_per_position": per_position, "mean_acceptance_length_at_k": lengths}


def save(assistant, tcfg, args, out):
    from safetensors.torch import save_file

    model_dir = Path(out) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in assistant.hf_state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = assistant_config(tcfg, args.hidden, args.heads, args.ffn, args.layers)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"num_assistant_tokens": args.steps, "num_assistant_tokens_schedule": "constant"}
    (model_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return model_dir


@torch.no_grad()
def verify(model_dir, target_path, assistant, data, args):
    """transformers loads the checkpoint with no missing or unexpected tensor, and its own
    forward (the round transformers' candidate generator runs after a prefill) drafts what
    this module drafts, on CPU in float32."""
    from transformers import DynamicCache, Gemma4AssistantForCausalLM

    hf, info = Gemma4AssistantForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys")}
    assert not bad, f"checkpoint keys do not match transformers: {bad}"
    target, _ = load_target(target_path, "cpu", torch.float32)
    # Compare with the weights as saved (bfloat16), not the float32 ones trained.
    mine = assistant.cpu().to(torch.bfloat16).float()
    ids = torch.from_numpy(data[: args.verify_prompt].astype(np.int64))[None]
    out = target(input_ids=ids, cache=DynamicCache(config=target.config), use_cache=True,
                 output_hidden_states=True, return_shared_kv_states=True)
    anchor = out.logits[:, -1].argmax(-1, keepdim=True)
    length = ids.shape[1] + 1
    shared = {k: (v[0][:, :, :length], v[1][:, :, :length]) for k, v in out.shared_kv_states.items()}
    position = torch.tensor([[length - 1]])
    token, hidden = anchor, out.hidden_states[-1][:, -1:]
    hf_tokens, worst = [], 0.0
    # This module, for the same single anchor: donors are the prompt's, the query at P.
    donors = {k: (v[0], v[1]) for k, v in shared.items()}
    p = ids.shape[1]
    masks = {k: m[:, :, p : p + 1, :p] for k, m in mine.masks(p + 1, "cpu").items()}
    my_token, my_hidden = anchor, hidden
    embed = target.get_input_embeddings()
    for _ in range(args.steps):
        o = hf(inputs_embeds=torch.cat([embed(token), hidden], -1), attention_mask=None,
               position_ids=position, shared_kv_states=shared, use_cache=False)
        token, hidden = o.logits.argmax(-1), o.last_hidden_state
        hf_tokens.append(int(token))
        logits, my_hidden = mine.step(embed(my_token), my_hidden, donors, masks, position[0])
        worst = max(worst, float((logits - o.logits).abs().max()))
        my_token = logits.argmax(-1)
        assert int(my_token) == int(token), "this module and transformers draft differently"
    print(f"verify: transformers loads the checkpoint and drafts {hf_tokens}; max |dlogit| {worst:.2e}")
    return {"hf_drafts": hf_tokens, "max_logit_diff": worst}


def verify_saved(model_dir, args):
    """--verify-only: rebuilds this module from a saved checkpoint and runs `verify` on it."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg["text_config"]
    _, tcfg = load_target(args.target, "cpu", torch.float32)
    assistant = Assistant(tcfg, text["hidden_size"], text["num_attention_heads"],
                          text["intermediate_size"], text["num_hidden_layers"])
    saved = load_file(str(model_dir / "model.safetensors"))
    names = assistant.hf_state_dict()
    assert set(saved) == set(names), f"tensor names differ: {set(saved) ^ set(names)}"
    with torch.no_grad():
        for hf_name, tensor in names.items():
            # hf_state_dict returns detached views sharing the parameters' storage.
            tensor.copy_(saved[hf_name].float())
    heldout = np.fromfile(args.heldout_bin, dtype=np.uint16)
    result = verify(model_dir, args.target, assistant, heldout, args)
    print(json.dumps(result))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint folder (config.json + safetensors)")
    ap.add_argument("--train-bin", required=True)
    ap.add_argument("--heldout-bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=256, help="drafter width d")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="drafter layers (the last one full attention)")
    ap.add_argument("--ffn", type=int, default=1024)
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
                    help="skip training: check that transformers loads MODEL_DIR (a saved drafter) "
                    "and drafts what this module drafts with its weights")
    args = ap.parse_args()

    if args.verify_only:
        verify_saved(Path(args.verify_only), args)
        return

    target, tcfg, assistant, steps, seconds = train(args)
    # Saved first, so that a failure below never loses the training run.
    model_dir = save(assistant, tcfg, args, args.out)
    # mlx-spec warns when the drafter runs with another target (trained_for.py).
    write_trained_for(args.target, model_dir)
    device = next(assistant.parameters()).device
    heldout = np.fromfile(args.heldout_bin, dtype=np.uint16)
    metrics = {
        "params": sum(p.numel() for p in assistant.parameters()),
        "train_steps": steps,
        "train_seconds": round(seconds, 1),
        "args": vars(args),
        "heldout": evaluate(target, assistant.eval(), heldout, args, device),
    }
    print(json.dumps(metrics["heldout"]), flush=True)
    metrics["verify"] = verify(model_dir, args.target, assistant, heldout, args)
    (Path(args.out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


if __name__ == "__main__":
    main()
