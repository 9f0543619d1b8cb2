"""The fastest a decode step can run on this GPU when every dependent stage is its own kernel.

A Gemma 4 decode token passes through a chain of stages that each need the whole output of the
one before (a norm over the full vector, or every head): per layer the attention inputs
(q, k, v), the attention over the cache, the output product, gate/up, down, and the per-layer
input's two products; then the output head. However well each kernel streams, the memory system
idles at every boundary between two of them while the last blocks of one finish and the first
of the next ramp up. This script measures that on the device, with no host in the way:

* `stages`: one cuBLAS matrix-vector product per stage, with the stage's real weight bytes
  (distinct weights per layer, so nothing stays in L2), attention modelled as one product over
  the layer's key and value bytes, all replayed from one CUDA graph. Norms, RoPE, softmax and
  the activation are left out, so the rate is an upper bound for any design that runs one
  kernel per stage.
* `one stream`: the same bytes as one product per layer type, no boundaries: close to the floor.
* the cost of a boundary: a chain of tiny dependent products in one CUDA graph.

Usage: stage_bound.py CONFIG.json [PROMPT_TOKENS] [COPY_TB_S]. Prints a markdown table.
       stage_bound.py CONFIG.json PROMPT_TOKENS --write-shapes FILE: writes the stages' shapes
       ("rows cols" a line, in order) for stage_overlap.cu, and measures nothing.
"""
import json
import sys

try:
    import torch
except ImportError:  # --write-shapes needs no GPU
    torch = None

BF16 = 2
REPLAYS = 7
# Weights cycled per measurement: several times the H200's L2, so that none is read from it.
L2_CYCLE_BYTES = 4 * 60 * 1024**2


def read_config(path):
    with open(path) as f:
        c = json.load(f)
    return c.get("text_config", c)


def stage_shapes(c, slots_sliding, slots_full):
    """(stage name, rows, columns) of every matrix-vector product of one decode step, in order."""
    hidden = c["hidden_size"]
    layers = c["num_hidden_layers"]
    types = c["layer_types"]
    shared = c.get("num_kv_shared_layers", 0) or 0
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    full_kv = c.get("num_global_key_value_heads") or kv_heads
    ple = c.get("hidden_size_per_layer_input", 0) or 0
    # The per-layer inputs come from one product of the embedded token before the first layer.
    stages = [("per-layer inputs", layers * ple, hidden)] if ple else []
    for i in range(layers):
        full = types[i] == "full_attention"
        d = (c.get("global_head_dim") or c["head_dim"]) if full else c["head_dim"]
        kvh = full_kv if full else kv_heads
        owns_kv = i < layers - shared
        k_eq_v = full and c.get("attention_k_eq_v", False)
        qkv_rows = heads * d + (kvh * d * (1 if k_eq_v else 2) if owns_kv else 0)
        stages.append(("attention inputs", qkv_rows, hidden))
        slots = slots_full if full else slots_sliding
        # Keys and values of the layer's KV heads (read by this layer or shared from an earlier one).
        stages.append(("attention", 2 * kvh * slots, d))
        stages.append(("attention output", hidden, heads * d))
        ff = c["intermediate_size"] * (2 if c.get("use_double_wide_mlp") and i >= layers - shared else 1)
        stages.append(("gate and up", 2 * ff, hidden))
        stages.append(("down", hidden, ff))
        if ple:
            stages.append(("per-layer input gate", ple, hidden))
            stages.append(("per-layer input projection", hidden, ple))
    stages.append(("output head", c["vocab_size"], hidden))
    return stages


def replay_us(run):
    """Median device time of one call of `run`, replayed from a CUDA graph (microseconds)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def products(shapes):
    """A closure running one product per shape (each with its own weight), and its bytes."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _, n, k in shapes]
    inputs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, _, k in shapes}
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _, n, _ in shapes]

    def run():
        for (_, _, k), w, o in zip(shapes, weights, outs):
            torch.matmul(inputs[k], w.t(), out=o)

    return run, sum(n * k * BF16 for _, n, k in shapes)


def main():
    config = read_config(sys.argv[1])
    prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    if len(sys.argv) > 4 and sys.argv[3] == "--write-shapes":
        sliding = min(prompt, config["sliding_window"])
        with open(sys.argv[4], "w") as f:
            for _, n, k in stage_shapes(config, sliding, prompt):
                f.write(f"{n} {k}\n")
        return
    copy_tb_s = float(sys.argv[3]) if len(sys.argv) > 3 else None
    sliding = min(prompt, config["sliding_window"])
    shapes = stage_shapes(config, sliding, prompt)
    run, step_bytes = products(shapes)
    staged_us = replay_us(run)
    del run
    torch.cuda.empty_cache()

    # The same bytes with as few boundaries as the shapes allow: one product per distinct
    # column count, rows added up (the weights stream back to back inside one kernel).
    merged = {}
    for _, n, k in shapes:
        merged[k] = merged.get(k, 0) + n
    run, merged_bytes = products([("merged", n, k) for k, n in merged.items()])
    merged_us = replay_us(run)
    del run
    torch.cuda.empty_cache()

    # A boundary alone: a chain of dependent products too small to take any time by bytes.
    chain = 512
    tiny = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    vec = [torch.randn(1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(chain + 1)]

    def tiny_chain():
        for i in range(chain):
            torch.matmul(vec[i], tiny, out=vec[i + 1])

    boundary_us = replay_us(tiny_chain) / chain

    def rate(us):
        return 1e6 / us

    def floor_share(us, nbytes):
        if not copy_tb_s:
            return "no copy bandwidth given"
        floor_us = nbytes / (copy_tb_s * 1e12) * 1e6
        return f"{100 * floor_us / us:.1f} % of the floor ({floor_us:.0f} µs at {copy_tb_s:.2f} TB/s)"

    # Each kind of stage alone: its products of one step back to back (one boundary each),
    # the figure to hold a kernel of that stage against.
    by_stage = {}
    for name, n, k in shapes:
        by_stage.setdefault(name, []).append((name, n, k))
    print(f"Stages of one decode step of {sys.argv[1]} (prompt {prompt}), one kernel each:")
    print()
    print("| stage | products a step | MB a step | µs each, alone | TB/s |")
    print("|---|---|---|---|---|")
    for name, kind in by_stage.items():
        nbytes = sum(n * k * BF16 for _, n, k in kind)
        # Small stages are repeated with other weights until they cannot stay in L2 (60 MB).
        copies = kind * max(1, -(-L2_CYCLE_BYTES // nbytes))
        run, _ = products(copies)
        us = replay_us(run) / len(copies)
        del run
        torch.cuda.empty_cache()
        print(f"| {name} | {len(kind)} | {nbytes / 1e6:.1f} | {us:.2f} | {nbytes / len(kind) / us / 1e6:.2f} |")
    print()
    print("| measurement (one CUDA graph, no host) | µs a step | tok/s | share of the floor |")
    print("|---|---|---|---|")
    print(f"| {len(shapes)} stages, one cuBLAS product each | {staged_us:.0f} | {rate(staged_us):.1f} | "
          f"{floor_share(staged_us, step_bytes)} |")
    print(f"| the same bytes in {len(merged)} products | {merged_us:.0f} | {rate(merged_us):.1f} | "
          f"{floor_share(merged_us, merged_bytes)} |")
    print(f"| one boundary (a chain of {chain} tiny dependent products) | {boundary_us:.2f} | | |")
    print()
    print(f"stage-bound: {len(shapes)} stages {staged_us:.0f} us ({rate(staged_us):.1f} tok/s), "
          f"{step_bytes / 1e9:.2f} GB; same bytes merged {merged_us:.0f} us; "
          f"boundary {boundary_us:.2f} us; {floor_share(staged_us, step_bytes)}")


if __name__ == "__main__":
    main()
