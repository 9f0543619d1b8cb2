#!/usr/bin/env python3
"""Train a small Gemma 4 text decoder (transformers' Gemma4ForCausalLM) on data/train.bin.

Needs torch, numpy, transformers==5.24.0 (+ safetensors); `tokenizers` only for the optional
sample text in metrics.json. Reads the token files written by train_tokenizer.py (flat
little-endian uint16, documents as BOS ... EOS).

Model (E2B/E4B style, 25.45 M parameters): 8 layers S S S F S S S F (S = sliding window 128,
F = full), hidden 512, 8 query heads, 2 KV heads, head_dim 64 on sliding layers and 128 on
full layers, MLP 1024, per-layer embeddings of width 32, the last 2 layers share KV (layer 6
reuses sliding layer 5, layer 7 reuses full layer 3), vocab 8192, tied embeddings, logit
soft-cap 30, RoPE θ=1e4 (sliding) / proportional 0.25 θ=1e6 (full).

Training: random windows of seq_len+1 tokens, AdamW (0.9, 0.95), weight decay on matrices,
linear warmup then cosine decay to lr*min_lr_frac. The schedule runs on
progress = max(step / max_steps, train_seconds / (max_minutes*60)), so a wall-clock budget
gets a complete cosine schedule. bf16 autocast on CUDA; torch.compile when it works.
Every --eval-every steps the held-out loss is measured on a fixed set of windows; with
--keep-best 1 (default) the weights of the best such eval are restored before saving (early
stopping: a small corpus is seen many times on a GPU). The final held-out loss is measured
in float32 on --final-eval-windows windows (all of heldout.bin on CUDA by default).

Outputs in --out (default: out/run next to this script):
  train_log.csv   step,tokens,seconds,train_loss,lr       (every --log-every steps)
  eval_log.csv    step,tokens,seconds,heldout_loss,heldout_ppl
  metrics.json    params, steps, tokens, wall time, device, losses, perplexity, config
  model/          checkpoint (bf16, or float32 with --save-dtype f32): config.json (released
                  key form), generation_config.json,
                  model-0000X-of-0000N.safetensors shards (each <= 15 MB) + index json,
                  tokenizer.json, tokenizer_config.json, golden.safetensors, metrics.json

golden.safetensors (from the saved checkpoint reloaded on CPU, float32, eager, eval mode):
  prompt_ids   int64 [64]      start of held-out requests/api.py (BOS first)
  logits       f32 [64, V]     full forward without a cache
  greedy_ids   int64 [32]      greedy continuation with a DynamicCache (EOS does not stop it)
  greedy_logits f32 [32, V]    the logits row each greedy token is the argmax of
"""

import argparse
import csv
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
BOS, EOS, PAD = 2, 1, 0
GOLDEN_T = 64
GOLDEN_GREEDY = 32
GOLDEN_FILE = "requests/api.py"
MAX_SHARD = "15MB"

SLIDING = "sliding_attention"
FULL = "full_attention"
# The shape of the 25 M default models (gemma4-code-25m, then -v2). The first one (gemma4-code-7m) had hidden 256,
# 4 heads / 1 KV head, MLP 512 and 6 layers S S S F S F: 7.4 M parameters.
MODEL_KW = dict(
    vocab_size=8192,
    vocab_size_per_layer_input=8192,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    layer_types=[SLIDING, SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL],
    sliding_window=128,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=32,
    use_double_wide_mlp=False,
    final_logit_softcapping=30.0,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    initializer_range=0.02,
    attention_bias=False,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=PAD,
)

# Draft models for the `draft-model` drafter: the default model's tokenizer and conventions,
# few layers (a draft step must cost a fraction of a target step), no per-layer inputs and no
# KV sharing. `--shape draft2` / `draft3`.
DRAFT_SHAPES = {
    "draft2": dict(layer_types=[SLIDING, FULL]),
    "draft3": dict(layer_types=[SLIDING, SLIDING, FULL]),
}
DRAFT_KW = dict(
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    global_head_dim=128,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0,
)


def use_shape(name):
    """Switches MODEL_KW to a named shape ("default" leaves it as it is)."""
    if name == "default":
        return
    MODEL_KW.update(DRAFT_KW)
    MODEL_KW.update(DRAFT_SHAPES[name])
    MODEL_KW["num_hidden_layers"] = len(MODEL_KW["layer_types"])


GENERATION_CONFIG = {
    "bos_token_id": BOS,
    "eos_token_id": [1, 106, 50],
    "pad_token_id": PAD,
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
    "transformers_version": "5.24.0",
}


def log(msg):
    print(msg, flush=True)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def load_bin(path):
    arr = np.fromfile(path, dtype="<u2")
    if arr.size == 0:
        sys.exit(f"{path} is empty")
    return arr


def make_config(attn):
    from transformers import Gemma4TextConfig

    kw = json.loads(json.dumps(MODEL_KW))
    cfg = Gemma4TextConfig(**kw)
    cfg._attn_implementation = attn
    # HF refuses a KV-sharing layer type without an earlier donor; check it ourselves too.
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    for j in range(first_shared, cfg.num_hidden_layers):
        t = cfg.layer_types[j]
        assert any(cfg.layer_types[i] == t for i in range(first_shared)), f"layer {j} ({t}) has no donor"
    assert cfg.layer_types[-1] == FULL
    return cfg


def released_config(cj):
    """Rewrite transformers-5.24 config.json into the released key form."""
    cj.pop("per_layer_config", None)
    cj["global_head_dim"] = MODEL_KW["global_head_dim"]
    cj["num_global_key_value_heads"] = None
    cj["eos_token_id"] = [1, 106]
    cj["bos_token_id"] = BOS
    cj["pad_token_id"] = PAD
    return cj


def lr_at(step, progress, args, warmup):
    warm = min(1.0, (step + 1) / warmup)
    p = min(1.0, progress)
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
    return args.lr * warm * cos


def eval_windows(held, seq_len, n):
    """Fixed, evenly spaced, non-overlapping windows of seq_len+1 tokens."""
    total = (len(held) - 1) // seq_len
    if total < 1:
        sys.exit("heldout.bin is shorter than one window")
    n = total if n <= 0 else min(n, total)
    starts = [int(round(i * (total - 1) / max(1, n - 1))) * seq_len for i in range(n)] if n > 1 else [0]
    return np.stack([held[s : s + seq_len + 1].astype(np.int64) for s in starts])


@torch.no_grad()
def evaluate(model, windows, batch, device, autocast):
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, len(windows), batch):
        w = torch.from_numpy(windows[i : i + batch]).to(device)
        x, y = w[:, :-1], w[:, 1:]
        with autocast():
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += y.numel()
    model.train()
    return tot / cnt


def pick_golden_prompt(held, data):
    """The first GOLDEN_T tokens (BOS first) of GOLDEN_FILE from the held-out set; when that
    file is not held out (or the index is missing), of the first long-enough held-out file."""
    docs = []
    index = Path(data) / "heldout_index.json"
    if index.exists():
        with open(index) as f:
            docs = [(d["path"], d["start"], d["n_tokens"]) for d in json.load(f)]
    else:
        starts = np.flatnonzero(held == BOS)
        ends = np.append(starts[1:], len(held))
        docs = [("?", int(s), int(e - s)) for s, e in zip(starts, ends)]
    need = GOLDEN_T + GOLDEN_GREEDY + 2
    docs = [d for d in docs if d[2] >= need]
    if not docs:
        sys.exit("no held-out document long enough for the golden prompt")
    chosen = next((d for d in docs if d[0] == GOLDEN_FILE), docs[0])
    path, start, _ = chosen
    assert held[start] == BOS
    return path, torch.from_numpy(held[start : start + GOLDEN_T].astype(np.int64))


@torch.no_grad()
def compute_golden(model, prompt):
    from transformers import DynamicCache

    out = {"prompt_ids": prompt}
    out["logits"] = model(input_ids=prompt[None, :], use_cache=False).logits[0].float()
    cache = DynamicCache(config=model.config)
    step_logits = model(input_ids=prompt[None, :], cache=cache, use_cache=True).logits[0, -1]
    greedy, rows = [], []
    for i in range(GOLDEN_GREEDY):
        tok = int(torch.argmax(step_logits))
        greedy.append(tok)
        rows.append(step_logits.float())
        if i + 1 < GOLDEN_GREEDY:
            step_logits = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    out["greedy_ids"] = torch.tensor(greedy, dtype=torch.int64)
    out["greedy_logits"] = torch.stack(rows, 0)
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def decode_text(tok_dir, ids):
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
        return tok.decode([int(i) for i in ids], skip_special_tokens=False)
    except Exception as e:  # tokenizers is optional here
        return f"(not decoded: {type(e).__name__})"


def save_checkpoint(model, args, out, tok_dir, held, metrics):
    from safetensors.torch import save_file
    from transformers import Gemma4ForCausalLM

    mdir = out / "model"
    if mdir.exists():
        shutil.rmtree(mdir)
    model = model.to("cpu").float().eval()
    state = None
    if args.save_dtype == "bf16":
        # Round the parameters to bfloat16 in place (buffers such as RoPE frequencies stay
        # float32): the model below (in-memory check, golden) then computes on exactly the
        # values the checkpoint holds.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: stored once, as embed_tokens
    model.config.use_cache = True
    model.save_pretrained(mdir, max_shard_size=MAX_SHARD, state_dict=state)
    with open(mdir / "config.json") as f:
        cj = json.load(f)
    write_json(mdir / "config.json", released_config(cj))
    write_json(mdir / "generation_config.json", GENERATION_CONFIG)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tok_dir) / name, mdir / name)
    shards = sorted(p for p in os.listdir(mdir) if p.endswith(".safetensors"))
    for s in shards:
        size = os.path.getsize(mdir / s)
        assert size <= 16_000_000, (s, size)
    if len(shards) > 1:
        assert (mdir / "model.safetensors.index.json").exists()

    # Golden from the checkpoint as saved (reloaded on CPU, float32, eager attention).
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    re = Gemma4ForCausalLM.from_pretrained(mdir, attn_implementation="eager", dtype=torch.float32).eval()
    golden_path, prompt = pick_golden_prompt(held, args.data)
    golden = compute_golden(re, prompt)
    with torch.no_grad():
        mine = model(input_ids=prompt[None, :], use_cache=False).logits[0]
        re_sdpa = Gemma4ForCausalLM.from_pretrained(mdir, attn_implementation="sdpa", dtype=torch.float32).eval()
        sdpa = re_sdpa(input_ids=prompt[None, :], use_cache=False).logits[0]
    d_mem = (mine - golden["logits"]).abs().max().item()
    d_sdpa = (sdpa - golden["logits"]).abs().max().item()
    d_cache = (golden["greedy_logits"][0] - golden["logits"][-1]).abs().max().item()
    log(f"   reload check: max|dlogit| in-memory vs reloaded = {d_mem:.2e}, sdpa vs eager = {d_sdpa:.2e}, "
        f"cache prefill vs no-cache = {d_cache:.2e}")
    assert d_mem < 1e-4 and d_sdpa < 1e-3 and d_cache < 1e-3, (d_mem, d_sdpa, d_cache)
    save_file(golden, str(mdir / "golden.safetensors"), metadata={"format": "pt"})
    for p in os.listdir(mdir):
        os.chmod(mdir / p, 0o644)
    metrics["golden"] = {
        "file": golden_path,
        "prompt_text": decode_text(tok_dir, golden["prompt_ids"].tolist()),
        "greedy_text": decode_text(tok_dir, golden["greedy_ids"].tolist()),
        "greedy_ids": golden["greedy_ids"].tolist(),
        "reload_max_abs_dlogit": d_mem,
        "sdpa_vs_eager_max_abs_dlogit": d_sdpa,
    }
    metrics["checkpoint"] = {
        "files": {p: os.path.getsize(mdir / p) for p in sorted(os.listdir(mdir))},
        "shards": shards,
    }
    return mdir


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(HERE / "data"), help="folder with train.bin, heldout.bin")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default DATA/tokenizer)")
    ap.add_argument("--out", default=str(HERE / "out" / "run"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-minutes", type=float, default=6.0, help="wall-clock budget of the training loop")
    ap.add_argument("--max-steps", type=int, default=0, help="0 = no step limit")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-seq-len", type=int, default=512,
                    help="window of the held-out evaluations (512 for every model so far, so figures compare)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 64 on cuda, 8 on cpu")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-windows", type=int, default=None,
                    help="held-out windows for the periodic evals (0 = all); default 1024 on cuda, 8 on cpu")
    ap.add_argument("--final-eval-windows", type=int, default=None,
                    help="windows for the final held-out number (0 = all); default all on cuda, 32 on cpu")
    ap.add_argument("--keep-best", type=int, default=1,
                    help="1: at the end restore the weights of the best periodic eval (early stopping)")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--attn", default="sdpa", help="attention implementation for training")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--state", default=None,
                    help="resumable training state: loaded when the file exists, written when a slice ends")
    ap.add_argument("--slice-minutes", type=float, default=0.0,
                    help="with --state: stop after this many minutes of training and save the state, so a "
                         "budget longer than one machine session runs as several (0 = no slices)")
    ap.add_argument("--save-dtype", choices=["f32", "bf16"], default="bf16",
                    help="dtype of the saved checkpoint (bf16: half the bytes to bring back from "
                         "a GPU machine; train/quantize_checkpoint.py makes the shipped model)")
    ap.add_argument("--shape", choices=["default", *DRAFT_SHAPES], default="default",
                    help="the default model's shape, or a small draft model of its tokenizer")
    args = ap.parse_args()
    use_shape(args.shape)

    import transformers
    from transformers import Gemma4ForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if transformers.__version__ != "5.24.0":
        log(f"warning: transformers {transformers.__version__}, this script was written for 5.24.0")

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.batch_size is None:
        args.batch_size = 64 if cuda else 8
    if args.eval_windows is None:
        args.eval_windows = 1024 if cuda else 8
    if args.final_eval_windows is None:
        args.final_eval_windows = 0 if cuda else 32
    data = Path(args.data)
    tok_dir = Path(args.tokenizer) if args.tokenizer else data / "tokenizer"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    train = load_bin(data / "train.bin")
    held = load_bin(data / "heldout.bin")
    assert int(train.max()) < MODEL_KW["vocab_size"] and int(held.max()) < MODEL_KW["vocab_size"]
    log(f"== data: train {len(train):,} tokens, held-out {len(held):,} tokens")
    train_t = torch.from_numpy(train.astype(np.int64)).to(device)
    windows = eval_windows(held, args.eval_seq_len, args.eval_windows)
    final_windows = eval_windows(held, args.eval_seq_len, args.final_eval_windows)

    try:
        cfg = make_config(args.attn)
        model = Gemma4ForCausalLM(cfg)
    except Exception as e:
        log(f"attn '{args.attn}' not accepted ({e}); using eager")
        args.attn = "eager"
        cfg = make_config("eager")
        model = Gemma4ForCausalLM(cfg)
    model = model.to(device).train()
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    log(f"== model: {n_params:,} parameters ({n_params * 4 / 1e6:.2f} MB float32), attn={args.attn}, device={device}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt_kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if cuda:
        opt_kw["fused"] = True
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], **opt_kw
    )

    def autocast():
        if cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    fwd = model
    compiled = False
    if args.compile == "on" or (args.compile == "auto" and cuda):
        try:
            fwd = torch.compile(model)
            compiled = True
        except Exception as e:
            log(f"torch.compile unavailable ({type(e).__name__}: {e}); eager")

    def train_step(f, x, y):
        with autocast():
            logits = f(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        return loss

    budget_s = args.max_minutes * 60.0
    warmup = args.warmup_steps
    if args.max_steps:
        warmup = max(1, min(warmup, args.max_steps // 10))
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    offs = torch.arange(args.seq_len + 1, device=device)
    hi = len(train) - args.seq_len - 1

    best = {"loss": float("inf"), "step": None, "tokens": None, "state": None}
    step, tokens = 0, 0
    # Time already trained in earlier slices: the schedule and the logs count from the
    # first slice, so a run in slices follows the same schedule as one in one go.
    prior_train_s = 0.0
    resumed = args.state and Path(args.state).is_file()
    if resumed:
        st = torch.load(args.state, map_location=device, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        gen.set_state(st["generator"].cpu())
        step, tokens, prior_train_s = st["step"], st["tokens"], st["train_seconds"]
        best.update(st["best"])
        log(f"== resumed from {args.state}: step {step}, {tokens:,} tokens, {prior_train_s / 60:.2f} min trained")
    (out / "PAUSED").unlink(missing_ok=True)
    mode = "a" if resumed else "w"
    train_log = open(out / "train_log.csv", mode, newline="")
    eval_log = open(out / "eval_log.csv", mode, newline="")
    tw = csv.writer(train_log)
    ew = csv.writer(eval_log)
    if not resumed:
        tw.writerow(["step", "tokens", "seconds", "train_loss", "lr"])
        ew.writerow(["step", "tokens", "seconds", "heldout_loss", "heldout_ppl"])

    def save_state():
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "generator": gen.get_state(),
            "step": step,
            "tokens": tokens,
            "train_seconds": prior_train_s + (time.time() - t_start - eval_time),
            "best": best,
        }
        tmp = Path(args.state + ".tmp")
        torch.save(state, tmp)
        tmp.replace(args.state)

    def run_eval(step, tokens, t_wall):
        t = time.time()
        loss = evaluate(model, windows, args.batch_size, device, autocast)
        ew.writerow([step, tokens, f"{t_wall:.2f}", f"{loss:.5f}", f"{math.exp(loss):.3f}"])
        eval_log.flush()
        mark = ""
        if loss < best["loss"]:
            best.update(loss=loss, step=step, tokens=tokens)
            if args.keep_best:
                best["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            mark = "  *best"
        log(f"   eval step {step:6d}: held-out loss {loss:.4f}  ppl {math.exp(loss):.2f}  ({time.time() - t:.1f}s){mark}")
        return loss, time.time() - t

    t_start = time.time()
    eval_time = 0.0
    acc_loss, acc_n = torch.zeros((), device=device), 0
    last_train_loss = float("nan")
    first_step_s = None
    log(f"== training: batch {args.batch_size} x seq {args.seq_len}, lr {args.lr}, warmup {warmup}, "
        f"budget {args.max_minutes} min, max_steps {args.max_steps or '-'}, compile {compiled}")
    while True:
        slice_s = time.time() - t_start - eval_time
        train_s = prior_train_s + slice_s
        progress = train_s / budget_s if budget_s > 0 else 0.0
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        if progress >= 1.0:
            break
        if args.state and args.slice_minutes > 0 and slice_s >= args.slice_minutes * 60.0:
            save_state()
            (out / "PAUSED").write_text(f"step {step}\n")
            log(f"== slice done at step {step} ({train_s / 60:.2f} of {args.max_minutes} min): state in {args.state}; "
                "run the same command again to go on")
            train_log.close()
            eval_log.close()
            return
        lr = lr_at(step, progress, args, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, hi, (args.batch_size,), device=device, generator=gen)
        w = train_t[starts[:, None] + offs]
        x, y = w[:, :-1], w[:, 1:]
        t_step = time.time()
        if compiled:
            try:
                loss = train_step(fwd, x, y)
            except Exception as e:
                log(f"torch.compile failed ({type(e).__name__}: {str(e)[:300]}); falling back to eager")
                opt.zero_grad(set_to_none=True)
                fwd, compiled = model, False
                loss = train_step(fwd, x, y)
        else:
            loss = train_step(fwd, x, y)
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        acc_loss += loss.detach()
        acc_n += 1
        if first_step_s is None:
            if cuda:
                torch.cuda.synchronize()
            first_step_s = time.time() - t_step
            log(f"   first step took {first_step_s:.1f}s (includes compilation when compiled)")
        if step % args.log_every == 0:
            last_train_loss = (acc_loss / acc_n).item()
            acc_loss.zero_()
            acc_n = 0
            wall = prior_train_s + time.time() - t_start
            tw.writerow([step, tokens, f"{wall:.2f}", f"{last_train_loss:.5f}", f"{lr:.6g}"])
            train_log.flush()
            if step % (args.log_every * 10) == 0:
                tps = tokens / max(1e-9, wall - eval_time)
                log(f"   step {step:6d}  tokens {tokens:12,d}  loss {last_train_loss:.4f}  lr {lr:.2e}  "
                    f"{tps:,.0f} tok/s  {wall:.0f}s")
        if args.eval_every and step % args.eval_every == 0:
            _, dt = run_eval(step, tokens, prior_train_s + time.time() - t_start)
            eval_time += dt
    if acc_n:
        last_train_loss = (acc_loss / acc_n).item()
        wall = prior_train_s + time.time() - t_start
        tw.writerow([step, tokens, f"{wall:.2f}", f"{last_train_loss:.5f}", f"{lr:.6g}"])
    train_wall = prior_train_s + time.time() - t_start
    train_s = train_wall - eval_time
    log(f"== trained {step} steps, {tokens:,} tokens in {train_wall / 60:.2f} min "
        f"({tokens / max(train_s, 1e-9):,.0f} tok/s excluding evals)")

    last_eval_loss, dt = run_eval(step, tokens, train_wall)  # same precision as training
    restored = False
    if args.keep_best and best["state"] is not None and best["step"] != step:
        model.load_state_dict(best["state"])
        restored = True
        log(f"== restored the weights of step {best['step']} (best periodic held-out loss {best['loss']:.4f}; "
            f"last {last_eval_loss:.4f})")
    best["state"] = None
    # Final number: float32 without autocast, on --final-eval-windows windows.
    model.float()
    t = time.time()
    fp32 = lambda: torch.autocast(device.type, enabled=False)  # noqa: E731
    heldout_fp32 = evaluate(model, final_windows, args.batch_size, device, fp32)
    log(f"   final held-out loss float32 ({len(final_windows)} windows): {heldout_fp32:.4f}  "
        f"ppl {math.exp(heldout_fp32):.2f}  ({time.time() - t:.1f}s)")
    unseen_fp32 = None
    if (data / "unseen.bin").is_file():
        unseen_windows = eval_windows(load_bin(data / "unseen.bin"), args.eval_seq_len, args.final_eval_windows)
        unseen_fp32 = evaluate(model, unseen_windows, args.batch_size, device, fp32)
        log(f"   final unseen-packages loss float32 ({len(unseen_windows)} windows): {unseen_fp32:.4f}  "
            f"ppl {math.exp(unseen_fp32):.2f}")
    train_log.close()
    eval_log.close()

    metrics = {
        "params": n_params,
        "float32_bytes": n_params * 4,
        "steps": step,
        "tokens_seen": tokens,
        "epochs": tokens / len(train),
        "train_wall_seconds": train_wall,
        "train_seconds_excluding_eval": train_s,
        "tokens_per_second": tokens / max(train_s, 1e-9),
        "first_step_seconds": first_step_s,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compiled": compiled,
        "attn_implementation": args.attn,
        "final_train_loss": last_train_loss,
        "heldout_loss": heldout_fp32,
        "heldout_ppl": math.exp(heldout_fp32),
        "heldout_eval_tokens": int(final_windows.shape[0] * args.eval_seq_len),
        "unseen_loss": unseen_fp32,
        "unseen_ppl": math.exp(unseen_fp32) if unseen_fp32 is not None else None,
        "last_step_periodic_eval_loss": last_eval_loss,
        "best_periodic_eval_loss": best["loss"],
        "best_step": best["step"],
        "best_tokens": best["tokens"],
        "restored_best": restored,
        "saved_step": best["step"] if restored else step,
        "train_tokens": int(len(train)),
        "heldout_tokens": int(len(held)),
        "args": vars(args),
        "config": MODEL_KW,
    }
    mdir = save_checkpoint(model, args, out, tok_dir, held, metrics)
    metrics["total_wall_seconds"] = time.time() - t_start
    write_json(out / "metrics.json", metrics)
    shutil.copyfile(out / "metrics.json", mdir / "metrics.json")
    log(f"== saved {mdir}")
    log(f"   golden prompt: {metrics['golden']['prompt_text'][:200]!r}")
    log(f"   greedy:        {metrics['golden']['greedy_text']!r}")
    log(json.dumps({k: metrics[k] for k in ("params", "steps", "tokens_seen", "train_wall_seconds",
                                             "final_train_loss", "heldout_loss", "heldout_ppl")}))


if __name__ == "__main__":
    main()
