#!/usr/bin/env python3
"""Generate the committed Gemma 4 test fixtures (tiny random models + golden outputs).

The golden outputs come from HF transformers' own Gemma 4 implementation, run on the
CPU in float32 with eager attention. Everything is seeded, so re-running the script
gives the same files.

How to run (from anywhere; keep the virtual environment OUTSIDE the repository):

    python3 -m venv <some-dir-outside-the-repo>/venv
    <venv>/bin/pip install -r tests/oracle/requirements.txt   # torch + transformers==5.24.0
    <venv>/bin/python tests/oracle/make_fixtures.py [OUT_DIR]

OUT_DIR defaults to tests/fixtures next to this script's tests/ folder (the repository
root is found from this file's own location). One sub-folder per variant is written:

  tiny-ple-kvshare   flat gemma4_text config in the *released* key form (global_head_dim,
                     num_global_key_value_heads), PLE + KV sharing + double-wide MLP,
                     one F32 model.safetensors with prefix `model.`
  tiny-moe-keqv      MoE + attention_k_eq_v + global kv heads; config.json left exactly as
                     transformers 5.24 saves it (with `per_layer_config`, no
                     global_head_dim); F32 weights sharded into two files + index json
  tiny-wrapped-bf16  Gemma4ForConditionalGeneration layout (nested text_config, outer
                     model_type gemma4, tensors `model.language_model.*`), BF16 weights,
                     plus a 512-token byte-level BPE tokenizer.json with Gemma's special ids
  tiny-ple-q4        mlx-community style affine-quantized weights (U32 packed + F32
                     scales/biases; 4-bit group 32 by default, 8-bit group 64 overrides
                     for layer 1's MLP), flat `model.` prefix

golden.safetensors in every variant holds (float32 / int64, batch dimension dropped):
  prompt_ids [T]          T = 20 seeded random ids in [3, V)
  logits [T, V]           full forward without a cache (after the final soft-cap)
  hidden.{k} [T, H]       k = 0..N; HF output_hidden_states semantics: 0 = scaled
                          embedding, k = output of layer k-1, N = final-norm output
  decode_logits [T, V]    DynamicCache: prefill of tokens 0..6, then one token at a time
  chunked_logits [T, V]   DynamicCache fed in chunks of 3, 5, 4, 8 tokens
  greedy_ids [24]         greedy continuation of prompt_ids (EOS never stops it)
  greedy_logits [24, V]   the logits row each greedy token was the argmax of
  tok_text_ids [n]        (tiny-wrapped-bf16 only) tokenizer ids of a sample string

make_long_goldens.py (run after this script) adds golden_long.safetensors (a 700-token
prompt) to every variant and golden_half.safetensors (transformers' own half-precision
logits) to the two that the Rust tests run in half precision.

For the bf16 variant the goldens are computed in float32 on the bf16-rounded weights;
for the quantized variant they are computed in float32 on the dequantized weights
(w = scales * q + biases).
"""

import copy
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load_file, save_file
from transformers import (
    DynamicCache,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
T_PROMPT = 20
DECODE_PREFILL = 7
CHUNKS = (3, 5, 4, 8)
N_GREEDY = 24

SLIDING = "sliding_attention"
FULL = "full_attention"
ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}

# Architecture of the PLE / KV-sharing variant; the others derive from it.
PLE_KVSHARE = dict(
    vocab_size=256,
    vocab_size_per_layer_input=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    sliding_window=4,
    num_kv_shared_layers=3,
    hidden_size_per_layer_input=8,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    rope_parameters=ROPE,
    initializer_range=0.2,
    max_position_embeddings=512,
)

MOE_KEQV = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    head_dim=16,
    global_head_dim=32,
    attention_k_eq_v=True,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    sliding_window=4,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=24,
    final_logit_softcapping=30.0,
    rope_parameters=ROPE,
    initializer_range=0.2,
    max_position_embeddings=512,
)

WRAPPED = dict(PLE_KVSHARE, vocab_size=512, vocab_size_per_layer_input=512, sliding_window=8)

PLE_Q4 = dict(
    PLE_KVSHARE,
    hidden_size=128,
    intermediate_size=256,
    head_dim=32,
    global_head_dim=64,
    hidden_size_per_layer_input=32,
)

# Quantization for tiny-ple-q4 (module path -> override); defaults 4-bit / group 32.
Q_DEFAULT = {"group_size": 32, "bits": 4}
Q_OVERRIDES = {
    f"model.layers.1.mlp.{proj}": {"group_size": 64, "bits": 8}
    for proj in ("gate_proj", "up_proj", "down_proj")
}

# Weight-init seeds. Random tied-embedding models tend to predict their input token again,
# so many seeds give a greedy continuation that is one token repeated; the seeds for the
# MoE and q4 variants were picked so that the continuation changes token a few times.
MODEL_SEEDS = {
    "tiny-ple-kvshare": 100,
    "tiny-moe-keqv": 3,
    "tiny-wrapped-bf16": 300,
    "tiny-ple-q4": 8,
}

GENERATION_CONFIG = {
    "bos_token_id": 2,
    "eos_token_id": [1, 106, 50],
    "pad_token_id": 0,
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
    "transformers_version": "5.24.0",
}


# --------------------------------------------------------------------------- helpers


def text_config(kw):
    cfg = Gemma4TextConfig(**copy.deepcopy(kw))
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model, text_model):
    """Give every norm weight, layer_scalar and router scale a value in U[0.5, 1.5] and the
    embedding pad row real values, so a port that drops one of them fails loudly."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in sorted(tensors, key=lambda kv: kv[0]):
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
        emb = text_model.embed_tokens.weight
        emb[0].copy_(torch.randn(emb.shape[1], generator=g) * 0.2)


def to_released_form(tc, kw):
    """Rewrite a transformers-5.24 text config dict into the released key form."""
    tc.pop("per_layer_config", None)
    tc["global_head_dim"] = kw["global_head_dim"]
    tc["num_global_key_value_heads"] = kw.get("num_global_key_value_heads")
    return tc


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def logits_of(model, ids, cache=None):
    kwargs = {"use_cache": cache is not None}
    if cache is not None:
        kwargs["cache"] = cache
    return model(input_ids=ids[None, :], **kwargs).logits[0]


def compute_goldens(model, vocab, n_layers):
    """All golden tensors for one model (already in eval mode, fp32)."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (T_PROMPT,), generator=gen, dtype=torch.int64)
    cfg = model.config
    out = {"prompt_ids": ids}
    with torch.no_grad():
        full = model(input_ids=ids[None, :], use_cache=False, output_hidden_states=True)
        out["logits"] = full.logits[0]
        hs = full.hidden_states
        assert len(hs) == n_layers + 1, len(hs)
        for k, h in enumerate(hs):
            out[f"hidden.{k}"] = h[0]
        # hidden.N must be the final-norm output (HF replaces the last entry).
        last = model.model(input_ids=ids[None, :], use_cache=False)
        assert torch.equal(last.last_hidden_state[0], hs[-1][0])

        cache = DynamicCache(config=cfg)
        rows = [logits_of(model, ids[:DECODE_PREFILL], cache)]
        for t in range(DECODE_PREFILL, T_PROMPT):
            rows.append(logits_of(model, ids[t : t + 1], cache))
        out["decode_logits"] = torch.cat(rows, 0)

        assert sum(CHUNKS) == T_PROMPT
        cache = DynamicCache(config=cfg)
        rows, pos = [], 0
        for n in CHUNKS:
            rows.append(logits_of(model, ids[pos : pos + n], cache))
            pos += n
        out["chunked_logits"] = torch.cat(rows, 0)

        # Greedy: prefill, then argmax + one-token steps; never stops at EOS.
        cache = DynamicCache(config=cfg)
        step_logits = logits_of(model, ids, cache)[-1]
        greedy, greedy_logits = [], []
        for i in range(N_GREEDY):
            tok = int(torch.argmax(step_logits))
            greedy.append(tok)
            greedy_logits.append(step_logits)
            if i + 1 < N_GREEDY:
                step_logits = logits_of(model, torch.tensor([tok]), cache)[-1]
        out["greedy_ids"] = torch.tensor(greedy, dtype=torch.int64)
        out["greedy_logits"] = torch.stack(greedy_logits, 0)

    out = {k: v.detach().contiguous() for k, v in out.items()}
    for k, v in out.items():
        assert v.dtype in (torch.float32, torch.int64), (k, v.dtype)
    return out


def check_generate(model, goldens):
    """Cross-check our greedy loop against HF generate (EOS can't end it early because
    min_new_tokens == max_new_tokens; the only effect is that EOS ids are masked)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    greedy = goldens["greedy_ids"].tolist()
    if eos & set(greedy):
        return "skipped (greedy path contains an EOS id)"
    with torch.no_grad():
        gen = model.generate(
            input_ids=goldens["prompt_ids"][None, :],
            do_sample=False,
            max_new_tokens=N_GREEDY,
            min_new_tokens=N_GREEDY,
            top_k=None,
            top_p=None,
            temperature=None,
        )
    got = gen[0, T_PROMPT:].tolist()
    return "match" if got == greedy else f"MISMATCH {got} vs {greedy}"


def report(tag, model, goldens):
    full = goldens["logits"]
    d_dec = (full - goldens["decode_logits"]).abs().max().item()
    d_chk = (full - goldens["chunked_logits"]).abs().max().item()
    top2 = goldens["greedy_logits"].topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    print(f"== {tag}")
    print(f"   max|full - decode|  = {d_dec:.3e}")
    print(f"   max|full - chunked| = {d_chk:.3e}")
    print(f"   greedy_ids = {goldens['greedy_ids'].tolist()}")
    print(f"   smallest greedy top1-top2 margin = {margin:.4f}")
    print(f"   HF generate vs greedy loop: {check_generate(model, goldens)}")
    assert d_dec < 1e-4 and d_chk < 1e-4, (d_dec, d_chk)


def save_goldens(d, goldens):
    save_file(goldens, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})


def fresh_dir(d):
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)


def reload_check(cls, d, goldens, what):
    re = cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        got = logits_of(re, goldens["prompt_ids"])
    diff = (got - goldens["logits"]).abs().max().item()
    print(f"   reload via from_pretrained ({what}): max|dlogit| = {diff:.3e}")
    assert diff < 1e-5, diff


def build_causal_lm(kw, seed):
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(text_config(kw)).eval().float()
    randomize(model, model.model)
    return model


# --------------------------------------------------------------------------- variants


def make_ple_kvshare(out):
    tag = "tiny-ple-kvshare"
    d = os.path.join(out, tag)
    fresh_dir(d)
    model = build_causal_lm(PLE_KVSHARE, seed=MODEL_SEEDS["tiny-ple-kvshare"])
    model.save_pretrained(d)
    cj = to_released_form(read_json(os.path.join(d, "config.json")), PLE_KVSHARE)
    cj["eos_token_id"] = [1, 106]
    write_json(os.path.join(d, "config.json"), cj)
    write_json(os.path.join(d, "generation_config.json"), GENERATION_CONFIG)
    goldens = compute_goldens(model, PLE_KVSHARE["vocab_size"], PLE_KVSHARE["num_hidden_layers"])
    save_goldens(d, goldens)
    report(tag, model, goldens)
    reload_check(Gemma4ForCausalLM, d, goldens, "released-form config")


def make_moe_keqv(out):
    tag = "tiny-moe-keqv"
    d = os.path.join(out, tag)
    fresh_dir(d)
    model = build_causal_lm(MOE_KEQV, seed=MODEL_SEEDS["tiny-moe-keqv"])
    model.save_pretrained(d)  # config.json stays in transformers' own form
    cj = read_json(os.path.join(d, "config.json"))
    assert "per_layer_config" in cj and "global_head_dim" not in cj
    write_json(os.path.join(d, "generation_config.json"), GENERATION_CONFIG)

    # Re-shard the single file HF wrote into two halves + an index.
    single = os.path.join(d, "model.safetensors")
    sd = load_file(single)
    os.remove(single)
    names = sorted(sd)
    half = (len(names) + 1) // 2
    shards = [names[:half], names[half:]]
    weight_map, total = {}, 0
    for i, part in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, os.path.join(d, fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    write_json(
        os.path.join(d, "model.safetensors.index.json"),
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )

    goldens = compute_goldens(model, MOE_KEQV["vocab_size"], MOE_KEQV["num_hidden_layers"])
    save_goldens(d, goldens)
    report(tag, model, goldens)
    reload_check(Gemma4ForCausalLM, d, goldens, "per_layer_config form, 2 shards")


# Inline training text for the toy tokenizer (English + a little code).
TOKENIZER_CORPUS = """\
The host loads a model, reads its configuration, and maps the weights into memory.
Each request is turned into tokens, the tokens are run through the decoder, and the
model answers one token at a time until it reaches a stop token or the length limit.
A small draft model can propose several tokens at once; the target model checks them
in a single pass and keeps the longest prefix that it agrees with.

When the cache is full, the sliding window forgets the oldest keys. The full attention
layers keep everything they have seen. Shared layers reuse the keys and values of an
earlier layer, which saves memory on the smaller models.

Please write a short story about a lighthouse keeper who finds a message in a bottle.
What is the capital of France? The capital of France is Paris. How many legs does a
spider have? A spider has eight legs. Thank you for your help, have a nice day!

fn main() {
    let tokens: Vec<u32> = vec![2, 105, 106, 1];
    for (i, t) in tokens.iter().enumerate() {
        println!("token {} = {}", i, t);
    }
}

def greet(name: str) -> str:
    return f"Hello, {name}! Welcome to the model server."

for line in open("input.txt"):
    if line.strip():
        print(line.upper())

{"role": "user", "content": "Summarize the following text in one sentence."}
Numbers like 3.14159, 2026, 1e-6 and 0x1F appear in logs; dates like 2026-11-30 too.
Café, naïve, façade and déjà vu are borrowed words; 東京 and 🦀 are here as well.
"""

# Special tokens at fixed ids (Gemma 4 ids from the spec); other low ids get placeholders.
SPECIAL_IDS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
TOKENIZER_SAMPLE = (
    "Hello world! The quick brown fox jumps over the lazy dog.\n"
    "fn main() { println!(\"héllo, wörld\"); } // 42 tokens, 🦀\n"
)
CHAT_TEXT = "<bos><|turn>user\nHi there<turn|>\n<|turn>model\n"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + message['content'] + '<turn|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


def build_tokenizer(d, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_special = max(SPECIAL_IDS) + 1
    specials = [SPECIAL_IDS.get(i, f"<unused{i}>") for i in range(n_special)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_CORPUS], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, s in enumerate(specials):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s), i)
    tok.save(os.path.join(d, "tokenizer.json"))

    # Reload from disk and check what the fixture promises.
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    assert tok.get_vocab_size() == vocab_size
    for i, s in SPECIAL_IDS.items():
        assert tok.token_to_id(s) == i
    assert max(tok.get_vocab().values()) == vocab_size - 1
    for text in (TOKENIZER_SAMPLE, TOKENIZER_CORPUS, "plain words"):
        enc = tok.encode(text)
        assert enc.ids[0] == 2, enc.ids[:3]
        assert tok.decode(enc.ids, skip_special_tokens=True) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    ids = tok.encode(TOKENIZER_SAMPLE).ids
    ids_plain = tok.encode(TOKENIZER_SAMPLE, add_special_tokens=False).ids
    chat_ids = tok.encode(CHAT_TEXT, add_special_tokens=False).ids
    assert chat_ids[:2] == [2, 105] and chat_ids[-4] == 105 and 106 in chat_ids
    assert tok.decode(chat_ids, skip_special_tokens=False) == CHAT_TEXT

    write_json(
        os.path.join(d, "tokenizer_config.json"),
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 512,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )

    # Cross-check with transformers' own tokenizer loading + chat template.
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(d)
    assert hf_tok(TOKENIZER_SAMPLE)["input_ids"] == ids
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == CHAT_TEXT, repr(rendered)

    golden = {
        "text": TOKENIZER_SAMPLE,
        "ids": ids,
        "ids_no_special": ids_plain,
        "chat_text": CHAT_TEXT,
        "chat_messages": messages,
        "chat_ids": chat_ids,
        "special_ids": {s: i for i, s in SPECIAL_IDS.items()},
    }
    write_json(os.path.join(d, "tokenizer_golden.json"), golden)
    print(f"   tokenizer: vocab {vocab_size}, sample -> {len(ids)} ids, chat_ids = {chat_ids}")
    return torch.tensor(ids, dtype=torch.int64)


def make_wrapped_bf16(out):
    tag = "tiny-wrapped-bf16"
    d = os.path.join(out, tag)
    fresh_dir(d)
    torch.manual_seed(MODEL_SEEDS["tiny-wrapped-bf16"])
    cfg = Gemma4Config(text_config=text_config(WRAPPED), vision_config=None, audio_config=None)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(cfg).eval().float()
    randomize(model, model.model.language_model)
    # Round every weight to bf16 so the fp32 goldens see exactly the saved values.
    # Only the saved state: non-persistent buffers (RoPE inv_freq, embed scales) stay fp32,
    # as they are recomputed in fp32 when the checkpoint is loaded.
    with torch.no_grad():
        for _, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).to(torch.float32))
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(d)

    cj = read_json(os.path.join(d, "config.json"))
    to_released_form(cj["text_config"], WRAPPED)
    cj["eos_token_id"] = [1, 106]
    cj["bos_token_id"] = 2
    cj["pad_token_id"] = 0
    write_json(os.path.join(d, "config.json"), cj)
    write_json(os.path.join(d, "generation_config.json"), GENERATION_CONFIG)

    sd = load_file(os.path.join(d, "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    assert all(k.startswith("model.language_model.") for k in sd), sorted(sd)[:3]

    tok_ids = build_tokenizer(d, WRAPPED["vocab_size"])
    goldens = compute_goldens(model, WRAPPED["vocab_size"], WRAPPED["num_hidden_layers"])
    goldens["tok_text_ids"] = tok_ids
    save_goldens(d, goldens)
    report(tag, model, goldens)
    reload_check(Gemma4ForConditionalGeneration, d, goldens, "bf16 weights -> fp32")


# ------------------------------------------------------------ MLX affine quantization


def quantize_affine(w, group_size, bits):
    """w [rows, cols] fp32 -> (packed uint32 [rows, cols*bits/32], scales, biases [rows, cols/g])."""
    rows, cols = w.shape
    assert cols % group_size == 0 and 32 % bits == 0
    levels = (1 << bits) - 1
    g = w.to(torch.float64).reshape(rows, cols // group_size, group_size)
    wmin = g.amin(-1, keepdim=True)
    wmax = g.amax(-1, keepdim=True)
    scales = ((wmax - wmin) / levels).clamp_min(1e-8).to(torch.float32)
    biases = wmin.to(torch.float32)
    q = torch.round((g - biases.double()) / scales.double()).clamp(0, levels).to(torch.int64)
    q = q.reshape(rows, cols)
    per_word = 32 // bits
    words = q.reshape(rows, cols // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    packed = (words << shifts).sum(-1)  # disjoint bit ranges: sum == bitwise or
    packed = packed.numpy().astype(np.uint32)
    return packed, scales.reshape(rows, -1).numpy(), biases.reshape(rows, -1).numpy(), q


def unpack(packed, bits, cols):
    per_word = 32 // bits
    p = torch.from_numpy(packed.astype(np.int64))
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    q = (p[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(p.shape[0], cols)


def dequantize(packed, scales, biases, group_size, bits):
    rows = packed.shape[0]
    cols = packed.shape[1] * 32 // bits
    q = unpack(packed, bits, cols).to(torch.float32).reshape(rows, cols // group_size, group_size)
    s = torch.from_numpy(scales)[..., None]
    b = torch.from_numpy(biases)[..., None]
    return (s * q + b).reshape(rows, cols)


def is_quantizable(name, t):
    """Linear weights and embedding tables (2-D `.weight`, not norms)."""
    return name.endswith(".weight") and t.dim() == 2 and "norm" not in name


def make_ple_q4(out):
    tag = "tiny-ple-q4"
    d = os.path.join(out, tag)
    fresh_dir(d)
    model = build_causal_lm(PLE_Q4, seed=MODEL_SEEDS["tiny-ple-q4"])
    model.save_pretrained(d)
    sd = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))

    # self-test of the bit packing on a handcrafted case
    q_test = torch.arange(64, dtype=torch.float32).reshape(1, 64) % 16
    p, s, b, _ = quantize_affine(q_test, 32, 4)
    assert p[0, 0] == 0x76543210 and p[0, 1] == 0xFEDCBA98, hex(int(p[0, 0]))
    row8 = torch.zeros(1, 64)
    row8[0, :4] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    row8[0, -1] = 255.0  # min 0, max 255 -> scale 1, q == value
    p8, _, _, _ = quantize_affine(row8, 64, 8)
    assert p8[0, 0] == 0x03020100 and p8[0, 15] == 0xFF000000, hex(int(p8[0, 0]))

    saved, dequant, quant = {}, {}, {}
    for name in sorted(sd):
        t = sd[name].to(torch.float32)
        module = name[: -len(".weight")]
        spec = Q_OVERRIDES.get(module, Q_DEFAULT)
        if is_quantizable(name, t) and t.shape[1] % spec["group_size"] == 0:
            packed, scales, biases, q = quantize_affine(t, spec["group_size"], spec["bits"])
            assert torch.equal(unpack(packed, spec["bits"], t.shape[1]), q), name  # pack roundtrip
            w = dequantize(packed, scales, biases, spec["group_size"], spec["bits"])
            step = torch.from_numpy(scales).repeat_interleave(spec["group_size"], 1)
            assert ((w - t).abs() <= 0.5 * step + 1e-6).all(), name
            saved[name] = packed
            saved[module + ".scales"] = scales
            saved[module + ".biases"] = biases
            dequant[name] = w
            quant[module] = spec
        else:
            saved[name] = t.numpy()
            dequant[name] = t
    assert set(Q_OVERRIDES) <= set(quant), "overrides must hit real modules"
    np_save_file(saved, os.path.join(d, "model.safetensors"), metadata={"format": "mlx"})

    # Load the dequantized weights into the HF model (lm_head stays tied to embed_tokens).
    state = model.state_dict()
    with torch.no_grad():
        for name, w in dequant.items():
            state[name].copy_(w)
    assert torch.equal(model.lm_head.weight, dequant["model.embed_tokens.weight"])

    # Independent check: dequantize again from the written file.
    back = load_file(os.path.join(d, "model.safetensors"))
    for module, spec in quant.items():
        w = dequantize(back[module + ".weight"].numpy(), back[module + ".scales"].numpy(),
                       back[module + ".biases"].numpy(), spec["group_size"], spec["bits"])
        assert torch.equal(w, state[module + ".weight"]), module

    qcfg = {"group_size": Q_DEFAULT["group_size"], "bits": Q_DEFAULT["bits"], "mode": "affine"}
    qcfg.update({k: dict(v) for k, v in sorted(Q_OVERRIDES.items())})
    cj = to_released_form(read_json(os.path.join(d, "config.json")), PLE_Q4)
    cj["eos_token_id"] = [1, 106]
    cj["quantization"] = qcfg
    cj["quantization_config"] = copy.deepcopy(qcfg)
    write_json(os.path.join(d, "config.json"), cj)
    write_json(os.path.join(d, "generation_config.json"), GENERATION_CONFIG)

    goldens = compute_goldens(model, PLE_Q4["vocab_size"], PLE_Q4["num_hidden_layers"])
    save_goldens(d, goldens)
    report(tag, model, goldens)
    n8 = sum(1 for v in quant.values() if v["bits"] == 8)
    print(f"   quantized {len(quant)} modules ({n8} at 8-bit/64), "
          f"{len(saved) - 3 * len(quant)} tensors left F32")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else str(REPO_ROOT / "tests" / "fixtures")
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)  # makes CPU reductions reproducible run to run
    torch.use_deterministic_algorithms(True)
    make_ple_kvshare(out)
    make_moe_keqv(out)
    make_wrapped_bf16(out)
    make_ple_q4(out)

    total = 0
    print("== files")
    for variant in sorted(os.listdir(out)):
        vdir = os.path.join(out, variant)
        if not os.path.isdir(vdir):
            continue
        vsize = 0
        for f in sorted(os.listdir(vdir)):
            os.chmod(os.path.join(vdir, f), 0o644)  # safetensors writes 0600
            size = os.path.getsize(os.path.join(vdir, f))
            vsize += size
            print(f"   {variant}/{f}  {size}")
        print(f"   {variant}: {vsize / 1e6:.3f} MB")
        total += vsize
    print(f"== total fixture size: {total} bytes ({total / 1e6:.3f} MB)")


if __name__ == "__main__":
    main()
