"""The peer measurement: transformers' Gemma4ForCausalLM on the GPU with the same config as
mlx-spec's random-weight bench, bf16, greedy decode (SDPA attention). CACHE is `dynamic` (the
default cache) or `static` (a preallocated cache, with which generate compiles the decode
step with torch.compile: transformers' fastest single-request setting). Prints one line:
prefill and decode tokens/s.
Usage: python3 transformers_peer.py CONFIG_JSON PROMPT_TOKENS GEN_TOKENS [dynamic|static]"""
import json
import sys
import time

import torch
import transformers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

config_path, prompt_len, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache = sys.argv[4] if len(sys.argv) > 4 else "dynamic"
extra = {"cache_implementation": "static"} if cache == "static" else {}
raw = json.load(open(config_path))
raw.pop("model_type", None)
config = Gemma4TextConfig(**raw)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Gemma4ForCausalLM(config).to(torch.bfloat16).eval()
vocab = config.vocab_size
ids = torch.tensor([[3 + (i * 2654435761) % (vocab - 3) for i in range(prompt_len)]], device="cuda")


def run():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, **extra)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=gen + 1, min_new_tokens=gen + 1, do_sample=False, **extra)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    prefill = t1 - t0
    decode = (t2 - t1) - prefill
    return prompt_len / prefill, gen / decode


with torch.no_grad():
    run()  # warm-up (with a static cache, this is where the decode step gets compiled)
    run()
    prefill_rate, decode_rate = run()
print(f"transformers {transformers.__version__}, torch {torch.__version__}, {cache} cache")
print(f"prefill {prefill_rate:.0f} tok/s | decode {decode_rate:.1f} tok/s")
