"""Load benchmark of `mlx-spec serve`: requests/s and time to first token at several numbers
of concurrent clients, with and without speculation (BENCHMARKS.md, "The server under load").

Usage: python3 bench/serve_load.py [--binary target/release/mlx-spec] [--prompts FILE]
           [--clients 1,4,16] [--requests-per-client 4] [--max-tokens 128]
           [--drafters ngram,assistant]

Starts the server (default model, the ngram and assistant drafters, max_active 16) on a free
loopback port; each level runs without speculation, then with each drafter (`--drafters`).
Each client sends streaming chat requests from the prompt set one after another; a request's
time to first token is from sending it to its first content chunk. Greedy decoding: the
texts with and without speculation are the same, which the script checks. Standard library
only.
"""

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(binary, config):
    env = dict(os.environ)
    env.pop("MLX_SPEC_MODEL", None)
    proc = subprocess.Popen(
        [binary, "serve", "--config", config, "--port", "0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    for line in proc.stderr:
        if line.startswith("mlx-spec: listening on http://"):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            host, port = line.strip().rsplit("/", 1)[1].rsplit(":", 1)
            return proc, host, int(port)
    raise SystemExit("the server did not start")


def one(host, port, messages, max_tokens, speculation):
    """One streaming chat request: (seconds to the first content, seconds in all, text, tokens)."""
    body = json.dumps(
        {
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "speculation": speculation,
        }
    )
    conn = http.client.HTTPConnection(host, port, timeout=600)
    began = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"{response.status}: {response.read()[:500]!r}")
    first = None
    text = []
    tokens = 0
    buffered = b""
    while True:
        chunk = response.read1(65536)
        if not chunk:
            break
        buffered += chunk
        while b"\n\n" in buffered:
            event, buffered = buffered.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                c = json.loads(line[6:])
                piece = c["choices"][0]["delta"].get("content") if c.get("choices") else None
                if piece:
                    if first is None:
                        first = time.monotonic() - began
                    text.append(piece)
                if c.get("usage"):
                    tokens = c["usage"]["completion_tokens"]
    conn.close()
    return first or 0.0, time.monotonic() - began, "".join(text), tokens


def run_level(host, port, prompts, clients, per_client, max_tokens, speculation):
    results = []
    lock = threading.Lock()

    def client(c):
        for k in range(per_client):
            messages = prompts[(c * per_client + k) % len(prompts)]
            r = one(host, port, messages, max_tokens, speculation)
            with lock:
                results.append(((c * per_client + k) % len(prompts), r))

    began = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - began
    ttft = sorted(r[0] for _, r in results)
    tokens = sum(r[3] for _, r in results)
    return {
        "requests": len(results),
        "requests_per_s": len(results) / wall,
        "tokens_per_s": tokens / wall,
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "texts": {i: r[2] for i, r in results},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/mlx-spec"))
    ap.add_argument("--prompts", default=os.path.join(ROOT, "bench/prompts/free_text.jsonl"))
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafters", default="ngram,assistant")
    args = ap.parse_args()
    drafters = [d for d in args.drafters.split(",") if d]
    with open(args.prompts) as f:
        prompts = [json.loads(line)["messages"] for line in f if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "deploy.toml")
        with open(config, "w") as f:
            f.write(
                "[server]\nmax_active = 16\nqueue_length = 64\n"
                + "".join(f"[drafters.{d}]\n" for d in drafters)
            )
        proc, host, port = start(args.binary, config)
        try:
            one(host, port, prompts[0], 8, "off")  # warm-up
            print("| clients | speculation | requests | requests/s | tokens/s | TTFT median | TTFT p90 |")
            print("|---|---|---|---|---|---|---|")
            for clients in [int(c) for c in args.clients.split(",")]:
                texts = {}
                runs = [("off", "off")] + [(d, {"drafter": d}) for d in drafters]
                for name, speculation in runs:
                    r = run_level(
                        host, port, prompts, clients, args.requests_per_client, args.max_tokens,
                        speculation,
                    )
                    texts[name] = r["texts"]
                    print(
                        f"| {clients} | {name} | {r['requests']} | {r['requests_per_s']:.2f} | "
                        f"{r['tokens_per_s']:.0f} | {1000 * r['ttft_median_s']:.0f} ms | "
                        f"{1000 * r['ttft_p90_s']:.0f} ms |",
                        flush=True,
                    )
                for d in drafters:
                    if texts["off"] != texts[d]:
                        raise SystemExit(f"greedy texts differ with {d} and without speculation")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
