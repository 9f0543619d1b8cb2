#!/usr/bin/env python3
"""Do short, bare prompts get an answer? Each prompt of bench/prompts/short.jsonl (a signature,
a signature with its docstring, a class header, an import block; no `# file:` header) is
continued greedily for 64 tokens by `mlx-spec generate`; a prompt passes when at least 16
tokens come before any end-of-text, a beginning-of-text (the model closing the file and
starting another one) counting as one. Prints a Markdown table (the text escaped) and the count.

  python3 bench/short_prompts.py [--model DIR] [--bin target/release/mlx-spec] [--json]

Exit status 0 when at least --need prompts pass (default 18 of 20), 1 otherwise.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEN_TOKENS = 64
MIN_TOKENS = 16


def run(binary, model, prompt):
    cmd = [binary, "generate", "--prompt", prompt, "--max-tokens", str(GEN_TOKENS), "--json"]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"mlx-spec failed on {prompt!r}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def before_end(result, bos):
    """Generated tokens before the first end-of-text or beginning-of-text (all of them when
    neither came)."""
    stats = result["stats"]
    tokens = result["tokens"][: stats["generated_tokens"]]
    ends = {bos}
    if stats["stop_token"] is not None:
        ends.add(stats["stop_token"])
    return next((i for i, t in enumerate(tokens) if t in ends), len(tokens))


def bos_of(model):
    """The model's beginning-of-text id (config.json); the default model is the one the host
    names in host/src/lib.rs."""
    if model is None:
        lib = (ROOT / "host" / "src" / "lib.rs").read_text(encoding="utf-8")
        model = ROOT / re.search(r'DEFAULT_MODEL_DIR: &str = "([^"]+)"', lib).group(1)
    config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    return config.get("text_config", config).get("bos_token_id", config.get("bos_token_id"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "mlx-spec"))
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "prompts" / "short.jsonl"))
    ap.add_argument("--need", type=int, default=18)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
    bos = bos_of(args.model)
    results = []
    for row in rows:
        r = run(args.bin, args.model, row["prompt"])
        n = before_end(r, bos)
        results.append({"id": row["id"], "kind": row["kind"], "prompt": row["prompt"], "tokens_before_end": n,
                        "stop_reason": r["stats"]["stop_reason"], "pass": n >= MIN_TOKENS, "text": r["text"]})
    passed = sum(r["pass"] for r in results)
    if args.json:
        print(json.dumps({"passed": passed, "of": len(results), "results": results}))
    else:
        esc = lambda s: s.replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|")  # noqa: E731
        print("| id | prompt | tokens before end-of-text | continuation |")
        print("|---|---|---:|---|")
        for r in results:
            mark = "" if r["pass"] else " ✗"
            print(f"| {r['id']} | `{esc(r['prompt'])}` | {r['tokens_before_end']}{mark} | `{esc(r['text'])}` |")
        print(f"\n{passed} of {len(results)} prompts gave at least {MIN_TOKENS} tokens before any end-of-text.")
    return 0 if passed >= args.need else 1


if __name__ == "__main__":
    sys.exit(main())
