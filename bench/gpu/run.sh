#!/usr/bin/env bash
# Runs ON the H200 machine, from the repository root, once .gpu/part-0 ... part-4 have arrived
# (one per call while the machine stays warm; bench/gpu/README.md). Checks that the GPU computes what
# the CPU computes, then measures; prints a table last. Results also go to $OUT if set.
#
#   bash bench/gpu/run.sh [STEP ...]
#
# Steps (default: fixtures bandwidth mlx peer cpu-check):
#   fixtures   greedy tokens of every test fixture on the GPU == transformers' (f32, TF32 off)
#   bandwidth  device copy bandwidth, the denominator of the memory floor
#   stage-bound  one cuBLAS product per dependent stage of an E4B step in one CUDA graph (no
#              host): the fastest any one-kernel-per-stage design runs here, and one boundary's cost
#   stage-overlap  the same stages as one matrix-vector kernel each (stage_overlap.cu, nvcc):
#              plain launches vs programmatic dependent launch, with and without L2 prefetch
#              of each block's first weights, and vs one persistent kernel with grid-wide
#              barriers: what overlap at the boundaries would win back
#   carveout   whether the L1/shared split changing between kernels costs time at a boundary
#              (carveout.cu, nvcc): chains of nearly empty kernels of a 12B layer's shared sizes,
#              with the driver's carveouts, one fixed carveout, or the device preferring shared
#   gemv       GB/s of one-token products through cuBLAS (PyTorch, CUDA graph): the rate a
#              product can reach with no host in the way
#   mlx        prefill/decode of E4B (prompt 512 and 4096), 12B, E4B 4-bit and 31B; verify cost curve
#   peer       transformers' Gemma4ForCausalLM decode on the E4B config (dynamic cache, then
#              static cache + torch.compile; `peer-static`: the second alone). PEER_TIMEOUT
#              bounds each in seconds (default 400).
#   kernel-check  fused kernels on random bf16 data: decode attention vs MLX's operations
#              (float32 reference), the window post-attention kernel vs the single-token one
#   kernel-cache  where MLX_PTX_CACHE_DIR is unset, mlx-spec keeps compiled kernels under the
#              user's cache directory, its fused kernels among them (MLX would compile those
#              in every process): the default model's generate with a fresh HOME, then again
#              finding the first one's kernels, then with mlx-spec's kernel cache off; then E4B
#              logits from kernels MLX compiled against those mlx-spec compiled, bit for bit
#   cpu-check  E4B shape, the same f32 weights: greedy on the GPU == greedy on the CPU
#   cpu-check-q4  the same with 4-bit weights, for each --fused-kernels value in CPU_Q4_SETS
#              (default: the default set)
#   host       where a pipelined E4B decode step's time goes, with and without our fused kernels
#              (HOST_SETS: the --fused-kernels values), also with one CUDA graph per step
#   large      decode of the 31B and 26B-A4B (MoE) shapes, bf16 (LARGE_MODELS: "31b", "26b-a4b"
#              or both, the default)
#   graph-budget  decode of E4B, 12B and 31B (GRAPH_MODELS) with MLX's CUDA graphs cut at
#              each input budget of GRAPH_BUDGETS (MB, MLX_MAX_MB_PER_BUFFER; default
#              1000 4000 16000 100000), each its own process
#   spec       ngram speculation vs plain greedy decoding of the default model, both prompt sets
#   graph      operations in one E4B decode step, by kind
#   opcost     host time per operation: MLX's add, RMSNorm and product vs our fused kernels
#   q4check    E4B 4-bit decode with and without the fused kernels, pipelined vs step by step
#   repeat     E4B decode repeated from fresh caches (4-bit and bf16): bitwise-equal logits?
#   ffspeed    GB/s of the feed-forward block: MLX's products vs ours at 1, 2, 4 rows per warp
#   profile    device time of one E4B decode step, by kernel (Nsight Compute), with our
#              fused kernels and without (PROFILE_SETS: the --fused-kernels values to profile;
#              PROFILE_ARGS: more mlx-spec options, e.g. --handoff-layers 0;
#              PROFILE_NCU_ARGS: more ncu options, e.g. --cache-control none to keep caches warm)
#   profile-q4 the same for E4B with 4-bit weights (PROFILE_Q4_SETS)
#   waits      what the warps of the 12B's attention-heads, decode-attention and post-attention
#              kernels wait on, reason by reason (Nsight Compute's warp-state metrics,
#              stalls.py): STALLS_MODEL, STALLS_KERNELS, STALLS_SKIP, STALLS_COUNT
#   verify-profile  forwards over k = VERIFY_KS tokens (default 1 2 4), the host's graph
#              building split off, default kernels and none; then a k=1 and a k=4 window
#              (VERIFY_PROFILE_KS) kernel by kernel in Nsight Compute: why k > 1 costs more
#   window     verify windows through the window kernels (in the default --fused-kernels): the
#              post-attention one's values against the single-token kernel's (bench
#              --check-kernels), then E4B forwards over k = VERIFY_KS tokens (default 2 4 8)
#              with and without the fused kernels, each window's logits compared with k
#              single-token steps
#   window-spec  ngram speculation (at most 7 drafts: windows the kernels take) vs plain
#              greedy decoding of the default model, both prompt sets, outputs checked equal;
#              WINDOW_SPEC_BASELINE=1 also runs it without the fused kernels
#   window-default  the default model's verify windows of k = 2 4 8 tokens against k decode
#              steps, with the window kernels (its 8-bit weights loaded dense) and with MLX's
#              operations (mlx-spec-lab --verify-window lets those take the window whole), in the
#              checkpoint's dtype and in bf16: which windows compute what steps compute
#   window-31b  the 31B's verify windows (random bf16 weights, window kernels; its feed-forward
#              takes the window products) of k = WINDOW_31B_KS tokens (default 2 4 5) against
#              k decode steps, then replayed drafts (4 a round, each right with probability
#              1, 0.8, 0.6) vs plain decoding, outputs checked equal
#   drafters   the drafters (DRAFTERS) vs plain on the default model, free-text set, with
#              each --fused-kernels value of DRAFTER_KERNELS (default: none, MLX's operations);
#              DRAFTER_ARGS: more bench options (e.g. --no-auto-off to draft every round)
#   draft-model-cost  a round of E2B (random weights) drafting for E4B (DRAFT_COST_TARGET; random weights)
#   assistant-cost  a round of an E4B-size assistant (random weights) beside E4B's verify
#   block-cost  a round of a block drafter of a released size (random weights): DSpark for the
#              12B and DFlash for the 31B (BLOCK_COST), beside the target's verify
#   assistant  the assistant drafter on the two oracle pairs: `draft` against transformers'
#              first round, and greedy speculation against plain decoding
#   replay     speculation with replayed drafts (`mlx-spec-lab --replay-drafts`: the plain output's own
#              tokens, each right with a set probability) vs plain greedy decoding, E4B bf16
#              and 4-bit (REPLAY_MODELS), drafts of 3 and 7: what the verify loop gives at a
#              known acceptance on a shape no drafter accepts on with random weights;
#              REPLAY_ARGS: more bench options (e.g. --replay-sizings fitted
#              --replay-handoffs 0,3,6: verify windows handed to the device whole or in groups
#              of layers, side by side)
#   sampling   E4B bf16 plain decoding greedy and with four sampling settings, each drawn on
#              the device and on the host (`mlx-spec-lab --compare-sampling`), alternated in one
#              process
#   verify-curve  the E4B bf16 verify cost curve alone (k = 1 ... 32), each window handed to
#              the device whole and in groups of --handoff-layers (VERIFY_CURVE_ARGS: more
#              mlx-spec options, e.g. --handoff-layers 3)
#   window-q4  verify windows of 4-bit E4B through the 4-bit window kernels: forwards over
#              k = VERIFY_KS tokens (default 2 4 8), each window's logits compared with k
#              single-token steps (they must be identical), then the 4-bit verify cost curve
#   stalls     the post-attention kernel (bf16, and 4-bit with affine4) and the default's
#              feed-forward kernels in Nsight Compute's occupancy, scheduler and warp-state
#              sections: why they run at the speed they do
#   timeline   a pipelined E4B decode step as the device runs it (Nsight Systems): each kernel
#              kind's real time a step, and how long the device sits idle between kernels
#              (TIMELINE_SETS: the --fused-kernels values, default "default none"; PROFILE_MODEL:
#              another config of configs/, e.g. gemma-4-12b, also for `profile`)
#   sanitize   Compute Sanitizer: racecheck of the 4-bit quantized products and of our kernels,
#              memcheck of our kernels with the post-attention path
#   quick      E4B bf16 decode with the default fused kernels and with none, alternated in
#              one process, with the default's logit gap to MLX's operations at the first step
#   quick-q4   the same for the 4-bit E4B: MLX's quantized products against the default set
#              QUICK_ROUNDS (default 2; at least 3 are run) and QUICK_TOKENS (default 64) set
#              the rounds of quick and quick-q4 and the tokens decoded in each
#   knobs      E4B decode under MLX's CUDA graph settings (MLX_MAX_OPS_PER_BUFFER, ...)
#
# Steps can be split over several calls (each call's time is limited): the bandwidth, once
# measured, is kept in the results folder for the floor of later `mlx` steps.
set -uo pipefail
STEPS="${*:-fixtures bandwidth mlx peer cpu-check}"
want() { [[ " $STEPS " == *" $1 "* ]]; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
G="$ROOT/.gpu"
RES="${OUT:-$G/results}"
mkdir -p "$G" "$RES"
LOG="$RES/gpu-run.log"
exec > >(tee -a "$LOG") 2>&1

# `carveout` alone needs only the image's nvcc: it runs in the first call of a lease, before
# (or without) the parts.
NVCC_ONLY=0
[[ " $STEPS " == " carveout " ]] && NVCC_ONLY=1
if [[ ! -f "$G/mlx/lib/libmlx.so" && "$NVCC_ONLY" == 0 ]]; then
    cat "$G"/part-[0-9] | xz -dc | tar -C "$G" -xf - || { echo "cannot unpack the CUDA libmlx"; exit 3; }
fi
NV="$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null)"
NVLIBS="$(ls -d "$NV"/*/lib 2>/dev/null | tr '\n' ':')"
export LD_LIBRARY_PATH="$G/mlx/lib:$NVLIBS${LD_LIBRARY_PATH:-}"
for h in /usr/local/cuda "$NV/cu13" "$NV/cuda_runtime"; do
    [[ -f "$h/include/cuda_runtime.h" ]] && export CUDA_HOME="$h" && break
done
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$G/ptx-cache}"
# The kernels a lease compiles (MLX's PTX cache, the driver's cache of what it built from the
# PTX) go with the machine. A lease that ends with KEEP_KERNEL_CACHE=1 leaves them in
# $RES/kernel-cache.tar.xz; carried back as .gpu/kernel-cache.tar.xz, the next lease starts
# with them instead of spending minutes compiling (bench/gpu/README.md).
export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$G/cuda-cache}"
export CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-1073741824}"
if [[ -f "$G/kernel-cache.tar.xz" && ! -d "$MLX_PTX_CACHE_DIR" ]]; then
    xz -dc "$G/kernel-cache.tar.xz" | tar -C "$G" -xf - && echo "kernel cache unpacked"
elif [[ -f "$G/kernel-cache.part-0" && ! -d "$MLX_PTX_CACHE_DIR" ]]; then
    # A cache kept in pieces (see below), each carried in a call of its own.
    cat "$G"/kernel-cache.part-[0-9] | xz -dc | tar -C "$G" -xf - && echo "kernel cache unpacked from pieces"
fi
STARTED=$SECONDS
# The binaries and plugins travel packed (bench/gpu/pack.sh): both binaries compress to a
# quarter, which leaves a call room for them beside the working tree.
if [[ -f "$G/bin.tar.xz" ]]; then
    xz -dc "$G/bin.tar.xz" | tar -C "$G" -xf -
fi
BIN="$G/bin/mlx-spec"
# The developer lab: the instruments most steps run (host/lab).
LAB="$G/bin/mlx-spec-lab"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "CUDA_HOME=${CUDA_HOME:-unset}"
if [[ "$NVCC_ONLY" == 0 ]]; then
    chmod +x "$BIN" "$LAB"
    ldd "$BIN" | grep -E "mlx|not found"
fi

ROWS=()
# Each row is printed as it is measured too, so a call cut short by its time limit still
# reports what it measured.
row() { ROWS+=("$*"); echo "row ($((SECONDS - STARTED)) s): $*"; }

# 1. The GPU computes the same function: greedy tokens on every fixture (f32, TF32 off)
#    equal the transformers continuation in the fixture's golden file, which the CPU build
#    reproduces in the test suite.
export MLX_ENABLE_TF32=0
fixtures() {
    local label="$1"; shift
    local same=0 total=0 f name ids want n got
    for f in "$ROOT"/tests/fixtures/*/; do
        name="$(basename "$f")"
        # Model fixtures only (tests/fixtures also holds the assistant's oracle pairs).
        [[ -f "$f/golden.safetensors" ]] || continue
        read -r ids want < <(python3 -c 'import sys
from safetensors.numpy import load_file
g = load_file(sys.argv[1])
print(",".join(map(str, g["prompt_ids"].tolist())), ",".join(map(str, g["greedy_ids"].tolist())))' "$f/golden.safetensors")
        n="$(tr ',' '\n' <<<"$want" | wc -l)"
        got="$(timeout 300 "$BIN" generate --model "$f" --prompt-ids "$ids" --max-tokens "$n" --ignore-eos --dtype f32 \
            --device gpu --json "$@" 2>>"$RES/greedy.err" | python3 -c 'import json, sys; print(",".join(map(str, json.load(sys.stdin)["tokens"])))')"
        total=$((total + 1))
        if [[ -n "$want" && "$got" == "$want" ]]; then same=$((same + 1)); else echo "MISMATCH $name: got ${got:-nothing} want ${want:-nothing (unreadable golden)}"; fi
    done
    row "$label | $same / $total fixtures"
}
if want fixtures; then
    fixtures "greedy tokens on GPU == transformers (f32, TF32 off)"
fi
unset MLX_ENABLE_TF32

# 2. The memory floor's denominator: device-to-device copy bandwidth (bytes read + written).
if want bandwidth; then
    python3 "$ROOT/bench/gpu/copy_bandwidth.py" >"$RES/bandwidth.txt" 2>/dev/null
    row "device copy bandwidth (read + write) | $(cat "$RES/bandwidth.txt") TB/s"
fi
BW="$(cat "$RES/bandwidth.txt" 2>/dev/null)"
if want stage-bound; then
    # The best a design of one kernel per dependent stage can do on this device: one cuBLAS
    # product per stage of an E4B step (attention as a product over its key and value bytes),
    # from one CUDA graph with no host; the same bytes in a few products; one boundary's cost.
    python3 "$ROOT/bench/gpu/stage_bound.py" "$ROOT/configs/gemma-4-e4b.json" 512 ${BW:-} | tee "$RES/stage-bound.md"
    row "E4B step as one cuBLAS product per stage, one CUDA graph | $(tail -n 1 "$RES/stage-bound.md")"
fi
if want stage-overlap; then
    # What launching the same stages with programmatic dependent launch would win back (MLX's
    # custom kernels cannot ask for it): one matrix-vector kernel per stage of a decode step,
    # plain launches against PDL and PDL with L2 prefetch of each block's first weights
    # (stage_overlap.cu, built here with the image's nvcc). STAGE_MODELS: the configs of
    # configs/ whose steps are run (default gemma-4-e4b; e.g. "gemma-4-e4b gemma-4-12b").
    NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    if "$NVCC" -O3 -std=c++17 -arch=sm_90a -o "$G/stage_overlap" "$ROOT/bench/gpu/stage_overlap.cu" 2>"$RES/stage-overlap.err"; then
        for model in ${STAGE_MODELS:-gemma-4-e4b}; do
            python3 "$ROOT/bench/gpu/stage_bound.py" "$ROOT/configs/$model.json" 512 --write-shapes "$RES/stage-shapes-$model.txt"
            echo "## $model" | tee -a "$RES/stage-overlap.md"
            "$G/stage_overlap" "$RES/stage-shapes-$model.txt" ${BW:-} 2>>"$RES/stage-overlap.err" | tee -a "$RES/stage-overlap.md"
            row "$model stages, plain launches vs programmatic dependent launch | $(tail -n 1 "$RES/stage-overlap.md") $(tail -n 1 "$RES/stage-overlap.err")"
        done
    else
        row "stages, plain launches vs programmatic dependent launch | build failed: $(head -n 3 "$RES/stage-overlap.err")"
    fi
fi
if want carveout; then
    # Whether a change of the multiprocessors' L1/shared split between kernels costs time at a
    # boundary (a decode layer's three kernels need 7.8, 12.4 and 38.5 KB a block on the 12B):
    # chains of nearly empty kernels in one CUDA graph, with the driver's carveouts and with
    # one fixed (carveout.cu, built here with the image's nvcc).
    NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    if "$NVCC" -O3 -std=c++17 -arch=sm_90a -o "$G/carveout" "$ROOT/bench/gpu/carveout.cu" 2>"$RES/carveout.err"; then
        "$G/carveout" 2>>"$RES/carveout.err" | tee "$RES/carveout.md"
        row "kernel boundaries with and without carveout changes | $(tail -n 1 "$RES/carveout.md") $(tail -n 1 "$RES/carveout.err")"
    else
        row "kernel boundaries with and without carveout changes | build failed: $(head -n 3 "$RES/carveout.err")"
    fi
fi
if want gemv; then
    # What cuBLAS reaches on one token's products, back to back in a CUDA graph (no host).
    python3 "$ROOT/bench/gpu/gemv_bandwidth.py" | tee "$RES/gemv.md"
    row "one-token products through cuBLAS (PyTorch, CUDA graph) | printed above, kept in gemv.md"
fi

# 3. Plain decode speed of real Gemma 4 shapes with random weights, and the verify cost curve.
bench() {
    local label="$1"; shift
    local json
    # BENCH_ENV: extra VAR=value settings for this one run; BENCH_TIMEOUT: its limit in
    # seconds (default 240).
    if json="$(env ${BENCH_ENV:-} timeout "${BENCH_TIMEOUT:-240}" "$LAB" --device gpu --random-weights --json "$@" 2>"$RES/bench.err")"; then
        echo "$json" >>"$RES/bench.jsonl"
        row "$label | $(python3 -c 'import json, sys
j, bw = json.loads(sys.argv[1]), sys.argv[2]
curve = " ".join("k=%d %.1fms (host %.1f; handed over %.1fms)" % (c["k"], c["ms"], c.get("build_ms", float("nan")), c.get("handed_over_ms", float("nan"))) for c in j.get("verify_curve", []))
curve = ("verify cost, whole (handed over %s layers at a time): %s" % (j.get("handoff_layers", "?"), curve)) if curve else curve
read = j["weight_bytes_read_per_token"]
floor = "floor %.0f tok/s (%.2f GB read per token), decode at %.1f %% of it" % (
    float(bw) * 1e12 / read, read / 1e9, 100 * j["decode_tokens_per_s"] * read / (float(bw) * 1e12)) if bw else "no bandwidth measured"
host = j["pipelined_host_ms"]
fused = " ".join("[%s] %.1f tok/s (rounds %.0f-%.0f; host %.2f + %.2f ms, waiting %.2f)%s, logits %.2g from none" % (f["kernels"], f["decode_tokens_per_s"], f.get("slowest_round_tokens_per_s", float("nan")), f.get("fastest_round_tokens_per_s", float("nan")), f["host_ms"]["build"], f["host_ms"]["submit"], f["host_ms"]["wait"], "" if f["same_tokens_as_none"] else " (tokens differ)", f.get("first_step_logit_gap", float("nan"))) for f in j.get("fused_comparison", []))
curve = (curve + " | fused kernels, alternated in one process: " + fused) if fused else curve
print("prefill %.0f tok/s | decode %.1f tok/s (host per step: build %.2f ms, submit %.2f ms, wait %.2f ms; one synchronised step at a time: %.1f tok/s) | %s %s" % (
    j["prefill_tokens_per_s"], j["decode_tokens_per_s"], host["build"], host["submit"], host["wait"],
    j["stepwise_decode_tokens_per_s"], floor, curve))' "$json" "${BW:-}")"
    else
        row "$label | failed: $(tail -n 1 "$RES/bench.err")"
    fi
}
if want mlx; then
    bench "mlx-spec E4B bf16" --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 2 --verify-curve
    bench "mlx-spec E4B bf16, prompt 4096" --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 --prompt-tokens 4096 --gen-tokens 64 --repeats 1
    bench "mlx-spec 12B bf16" --model "$ROOT/configs/gemma-4-12b.json" --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 2
    bench "mlx-spec E4B 4-bit g64" --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 --random-bits 4 --prompt-tokens 512 --gen-tokens 64 --repeats 2
    # The largest dense shape: about 30 s on an H200 (61 GB of random weights drawn on it).
    bench "mlx-spec 31B bf16" --model "$ROOT/configs/gemma-4-31b.json" --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 2
fi

if want sampling; then
    echo "## sampled decoding, E4B bf16, prompt 512, 128 tokens" | tee -a "$RES/sampling.md"
    timeout 300 "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 \
        --prompt-tokens 512 --gen-tokens 128 --repeats 3 --compare-sampling 2>>"$RES/sampling.err" \
        | tee -a "$RES/sampling.md" || tail -n 3 "$RES/sampling.err"
    row "sampled decoding, drawn on the device and on the host, E4B | printed above, kept in sampling.md"
fi

if want verify-curve; then
    # shellcheck disable=SC2086 # VERIFY_CURVE_ARGS is a list of options
    bench "mlx-spec E4B bf16 ${VERIFY_CURVE_ARGS:-}" --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 --prompt-tokens 512 \
        --gen-tokens 32 --repeats 3 --verify-curve ${VERIFY_CURVE_ARGS:-}
fi

if want window-q4; then
    # The 4-bit window kernels: each window's logits against k decode steps' (the bench prints
    # "identical" or how many differ), then what a window costs against a step.
    for k in ${VERIFY_KS:-2 4 8}; do
        echo "## 4-bit verify window k=$k" | tee -a "$RES/window-q4.md"
        timeout 200 "$LAB" --device gpu --random-weights --random-bits 4 --model "$ROOT/configs/gemma-4-e4b.json" \
            --dtype bf16 --prompt-tokens 512 --repeats 5 --verify-window "$k" \
            2>>"$RES/window-q4.err" | tee -a "$RES/window-q4.md" || tail -n 3 "$RES/window-q4.err"
    done
    row "4-bit verify windows against single-token steps | printed above, kept in window-q4.md"
    # shellcheck disable=SC2086 # VERIFY_CURVE_ARGS is a list of options
    bench "mlx-spec E4B 4-bit g64 ${VERIFY_CURVE_ARGS:-}" --random-bits 4 --model "$ROOT/configs/gemma-4-e4b.json" \
        --dtype bf16 --prompt-tokens 512 --gen-tokens 32 --repeats 3 --verify-curve ${VERIFY_CURVE_ARGS:-}
fi

if want q4check; then
    # Which kernel set makes pipelined and step-by-step greedy decoding of the 4-bit E4B shape
    # disagree (the bench refuses to report a speed when they do).
    # Q4_SETS: the --fused-kernels values to run (default: both), each in a process of its own, so a set
    # named N times counts how often a process's first decode goes wrong; Q4_TOKENS (default
    # 64) the tokens each decodes (the first is the prefill's pick).
    for fused in ${Q4_SETS:-none default}; do
        bench "mlx-spec E4B 4-bit g64, --fused-kernels $fused" --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 \
            --random-bits 4 --prompt-tokens 512 --gen-tokens "${Q4_TOKENS:-64}" --repeats 1 --fused-kernels "$fused"
    done
fi

if want repeat; then
    # Is each decode bitwise repeatable on the device? Pipelined runs first in the process
    # (where the one 4-bit disagreement was seen), then step-by-step runs fed the same tokens;
    # each compared with the first step-by-step run.
    for spec in "4-bit none" "4-bit default" "bf16 none" "bf16 default"; do
        read -r kind fused <<<"$spec"
        quant=(); [[ "$kind" == 4-bit ]] && quant=(--random-bits 4)
        echo "## repeatability: E4B $kind, --fused-kernels $fused"
        timeout 240 "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 \
            "${quant[@]}" --prompt-tokens 512 --gen-tokens 48 --repeatability 3 --fused-kernels "$fused" 2>"$RES/repeat.err" \
            | tee -a "$RES/repeat.txt" | grep -v "reference tokens" || tail -n 2 "$RES/repeat.err"
    done
    row "repeatability of E4B decode | printed above, kept in repeat.txt"
fi

if want profile; then
    # Device time of one E4B decode step, kernel by kernel (Nsight Compute, clocks unlocked so
    # durations are those of a normal run): what the device does when no host is in the way.
    NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
    for fused in ${PROFILE_SETS:-default none}; do
        # MLX_SPEC_PROFILE_DECODE: mlx-spec starts the capture after the prefill, so the
        # thousands of kernels of the weight generation and the prefill are not profiled.
        MLX_SPEC_PROFILE_DECODE=1 timeout 240 "$NCU" --csv --profile-from-start off --clock-control none ${PROFILE_NCU_ARGS:-} \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum \
            "$BIN" generate --device gpu --random-weights --model "$ROOT/configs/${PROFILE_MODEL:-gemma-4-e4b}.json" --dtype bf16 \
            --prompt-ids "$(seq -s, 2 513)" --max-tokens 4 --ignore-eos --json --fused-kernels "$fused" ${PROFILE_ARGS:-} \
            >"$RES/profile-${fused//,/_}.csv" 2>"$RES/profile-${fused//,/_}.err"
        python3 "$ROOT/bench/gpu/profile_step.py" "$RES/profile-${fused//,/_}.csv" "${PROFILE_MODEL:-gemma-4-e4b} bf16, --fused-kernels $fused" \
            | tee -a "$RES/profile.md" || tail -n 3 "$RES/profile-${fused//,/_}.err"
    done
    row "device time of one ${PROFILE_MODEL:-gemma-4-e4b} decode step (Nsight Compute) | printed above, kept in profile.md"
fi

if want waits; then
    # What the warps of our decode kernels wait on (Nsight Compute's warp-state metrics): one
    # layer pattern's attention-heads, decode-attention and post-attention kernels of the second
    # decode step, STALLS_MODEL (default the 12B), dense weights. STALLS_KERNELS: a regular
    # expression of the kernels to profile; STALLS_SKIP and STALLS_COUNT: the launches skipped
    # (one step's) and profiled (one period of the layer pattern's).
    NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
    MLX_SPEC_PROFILE_DECODE=1 timeout 300 "$NCU" --csv --profile-from-start off --clock-control none \
        --cache-control none --kernel-name "regex:${STALLS_KERNELS:-post_attention|decode_attention|attention_heads}" \
        --launch-skip "${STALLS_SKIP:-144}" --launch-count "${STALLS_COUNT:-18}" \
        --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed" \
        "$BIN" generate --device gpu --random-weights --model "$ROOT/configs/${STALLS_MODEL:-gemma-4-12b}.json" --dtype bf16 \
        --prompt-ids "$(seq -s, 2 513)" --max-tokens 4 --ignore-eos --json >"$RES/stalls.csv" 2>"$RES/stalls.err"
    python3 "$ROOT/bench/gpu/stalls.py" "$RES/stalls.csv" "${STALLS_MODEL:-gemma-4-12b} bf16 decode kernels" \
        | tee -a "$RES/stalls.md" || tail -n 5 "$RES/stalls.err"
    row "warp stalls of ${STALLS_MODEL:-gemma-4-12b}'s decode kernels (Nsight Compute) | printed above, kept in stalls.md"
fi

if want verify-profile; then
    # Why a verify window (k > 1, MLX's operations) costs several decode steps: forwards over
    # VERIFY_KS tokens, timed with the host's graph building split off, for the default kernel
    # set and for none; then one window of each size in Nsight Compute, kernel by kernel
    # (the capture starts after a warm-up window; profile_step.py takes the last forward).
    NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
    for k in ${VERIFY_KS:-1 2 4}; do
        for fused in default none; do
            echo "## verify window k=$k, --fused-kernels $fused" | tee -a "$RES/verify-profile.md"
            timeout 200 "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" \
                --dtype bf16 --prompt-tokens 512 --repeats 5 --fused-kernels "$fused" --verify-window "$k" \
                2>>"$RES/verify-profile.err" | tee -a "$RES/verify-profile.md"
        done
    done
    for k in ${VERIFY_PROFILE_KS:-1 4}; do
        tag="verify-profile-k$k"
        MLX_SPEC_PROFILE_DECODE=1 timeout 240 "$NCU" --csv --profile-from-start off --clock-control none \
            --cache-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \
            "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 \
            --prompt-tokens 512 --repeats 2 --fused-kernels none --verify-window "$k" \
            >"$RES/$tag.csv" 2>"$RES/$tag.err"
        python3 "$ROOT/bench/gpu/profile_step.py" "$RES/$tag.csv" "E4B bf16, verify window k=$k, --fused-kernels none" \
            | tee -a "$RES/verify-profile.md" || tail -n 3 "$RES/$tag.err"
    done
    row "verify windows: host and device split, kernel by kernel | printed above, kept in verify-profile.md"
fi

if want window; then
    # What the window kernels change for a verify window: first the post-attention kernel's
    # bits against the single-token kernel's, token by token; then E4B forwards over k tokens
    # with and without the fused kernels, each in its own process, each window's logits
    # compared with k single-token steps from the same cache.
    timeout 300 "$LAB" --device gpu --check-kernels 2>"$RES/window.err" | tee -a "$RES/window.md"
    for k in ${VERIFY_KS:-2 4 8}; do
        for fused in default none; do
            echo "## verify window k=$k, --fused-kernels $fused" | tee -a "$RES/window.md"
            timeout 200 "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" \
                --dtype bf16 --prompt-tokens 512 --repeats 5 --fused-kernels "$fused" --verify-window "$k" \
                2>>"$RES/window.err" | tee -a "$RES/window.md"
        done
    done
    # A window that makes the buffers grow where the decode steps would not (prompt 765, a
    # window of 4 past the 768 slots prefill leaves): with aligned shares its queries must
    # group their slots as decode steps do.
    echo "## verify window k=4 across a buffer growth" | tee -a "$RES/window.md"
    timeout 200 "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" \
        --dtype bf16 --prompt-tokens 765 --repeats 2 --verify-window 4 \
        2>>"$RES/window.err" | tee -a "$RES/window.md"
    row "verify windows with and without the fused kernels | printed above, kept in window.md"
fi
if want window-31b; then
    # Whether the 31B's windows compute what its decode steps compute, and what speculation
    # then gains on it at known acceptance rates.
    for k in ${WINDOW_31B_KS:-2 4 5}; do
        line="$(timeout 200 "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-31b.json" \
            --dtype bf16 --prompt-tokens 512 --repeats 2 --verify-window "$k" \
            2>>"$RES/window-31b.err" | tee -a "$RES/window-31b.md" | tail -n 1)"
        row "31B bf16 (random) verify window of $k vs $k decode steps | ${line:-failed: $(tail -n 1 "$RES/window-31b.err")}"
    done
    echo "## replayed drafts, 31B bf16, prompt 512, 64 tokens" | tee -a "$RES/window-31b.md"
    timeout 280 "$LAB" --device gpu --random-weights --model "$ROOT/configs/gemma-4-31b.json" \
        --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 1 \
        --replay-drafts "${REPLAY_RATES:-1,0.8,0.6}" --replay-draft-lengths 4 \
        2>>"$RES/window-31b.err" | tee -a "$RES/window-31b.md" || tail -n 3 "$RES/window-31b.err"
    row "speculation with replayed drafts vs plain, 31B bf16 | printed above, kept in window-31b.md"
fi

if want window-default; then
    # Which verify windows compute what decode steps compute on the default model: the loop
    # runs a window whole on a GPU only through the window kernels (a window through MLX's
    # operations verifies a token at a time), and this is the check behind that.
    for dtype in auto bf16; do
        for fused in default none; do
            for k in 2 4 8; do
                line="$(timeout 120 "$LAB" --device gpu --model "$ROOT/models/gemma4-code-25m-v2" --dtype "$dtype" \
                    --fused-kernels "$fused" --prompt-tokens 64 --repeats 3 --verify-window "$k" \
                    2>>"$RES/window-default.err" | tail -n 1)"
                row "default model ($dtype), --fused-kernels $fused, window of $k vs steps | ${line:-failed: $(tail -n 1 "$RES/window-default.err")}"
            done
        done
    done
fi

if want window-spec; then
    # Speculation with windows the kernels take (at most 7 drafts and the last token) on the
    # default model; the bench checks the outputs against plain decoding and fails otherwise.
    SETS=(default)
    [[ "${WINDOW_SPEC_BASELINE:-0}" == 1 ]] && SETS+=(none)
    for set in free_text code_edit; do
        for fused in "${SETS[@]}"; do
            line="$(timeout 240 "$LAB" --device gpu --drafter ngram --plugins-dir "$G/bin/plugins" --num-draft-tokens 7 \
                --fused-kernels "$fused" --prompt-set "$ROOT/bench/prompts/$set.jsonl" --gen-tokens 128 --repeats 1 \
                2>>"$RES/window.err" | tail -n 1)"
            how="window kernels"
            [[ "$fused" == default ]] || how="MLX's operations"
            row "ngram (7) vs plain, default model, $set set, $how | ${line:-failed: $(tail -n 1 "$RES/window.err")}"
        done
    done
fi

if want replay; then
    # The verify loop at a known acceptance on real shapes: drafts replayed from the plain
    # output, each right with probability P; plain and speculative runs alternate in one
    # process and the bench fails if their outputs differ.
    IFS=';' read -ra REPLAY_PICKED <<<"${REPLAY_MODELS:-E4B bf16;E4B 4-bit g64}"
    for model in "${REPLAY_PICKED[@]}"; do
        quant=(); [[ "$model" == *4-bit* ]] && quant=(--random-bits 4)
        echo "## replayed drafts, $model, prompt 512, 128 tokens" | tee -a "$RES/replay.md"
        timeout 280 "$LAB" --device gpu --random-weights "${quant[@]}" --model "$ROOT/configs/gemma-4-e4b.json" \
            --dtype bf16 --prompt-tokens 512 --gen-tokens 128 --repeats "${REPLAY_REPEATS:-2}" \
            --replay-drafts "${REPLAY_RATES:-1,0.8,0.6,0.4,0}" --replay-draft-lengths "${REPLAY_KS:-3,7}" ${REPLAY_ARGS:-} \
            2>>"$RES/replay.err" | tee -a "$RES/replay.md" || tail -n 3 "$RES/replay.err"
    done
    row "speculation with replayed drafts vs plain, E4B | printed above, kept in replay.md"
fi

if want profile-q4; then
    # The same for E4B with 4-bit weights: the default set (the post-attention kernel over
    # 4-bit rows), and none, where MLX's quantized products do the layer's products.
    NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
    for fused in ${PROFILE_Q4_SETS:-default none}; do
        tag="profile-q4-${fused//,/_}"
        MLX_SPEC_PROFILE_DECODE=1 timeout 200 "$NCU" --csv --profile-from-start off --clock-control none ${PROFILE_NCU_ARGS:-} \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum \
            "$BIN" generate --device gpu --random-weights --random-bits 4 --model "$ROOT/configs/gemma-4-e4b.json" \
            --dtype bf16 --prompt-ids "$(seq -s, 2 513)" --max-tokens 4 --ignore-eos --json --fused-kernels "$fused" ${PROFILE_ARGS:-} \
            >"$RES/$tag.csv" 2>"$RES/$tag.err"
        python3 "$ROOT/bench/gpu/profile_step.py" "$RES/$tag.csv" "E4B 4-bit g64, --fused-kernels $fused" \
            | tee -a "$RES/profile.md" || tail -n 3 "$RES/$tag.err"
    done
    row "device time of one E4B 4-bit decode step (Nsight Compute) | printed above, kept in profile.md"
fi

if want stalls; then
    # Why the post-attention kernel runs as fast as it does: Nsight Compute's occupancy,
    # scheduler and warp-state sections for one call of it, over dense bf16 and over 4-bit
    # weights (affine4): registers, issue-slot use, and where warps wait.
    NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
    for spec in "bf16 default post_attention 1" "4-bit default post_attention 1"; do
        read -r kind fused kernels count <<<"$spec"
        quant=(); [[ "$kind" == 4-bit ]] && quant=(--random-bits 4)
        tag="stalls-$kind-${fused//,/_}"
        echo "## $kernels, E4B $kind, --fused-kernels $fused: Nsight Compute sections"
        MLX_SPEC_PROFILE_DECODE=1 timeout 200 "$NCU" --profile-from-start off --clock-control none \
            -k "regex:$kernels" -s 10 -c "$count" --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section SchedulerStats --section WarpStateStats --print-details all \
            "$BIN" generate --device gpu --random-weights "${quant[@]}" --model "$ROOT/configs/gemma-4-e4b.json" \
            --dtype bf16 --prompt-ids "$(seq -s, 2 513)" --max-tokens 3 --ignore-eos --json --fused-kernels "$fused" \
            >"$RES/$tag.txt" 2>"$RES/$tag.err"
        grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Stall|stall|Memory Throughput|Compute \(SM\)" \
            "$RES/$tag.txt" | sed 's/^ *//' | cut -c1-220 | head -n $((60 * count)) || tail -n 5 "$RES/$tag.err"
    done
    row "post-attention kernel stalls (Nsight Compute) | printed above, kept in stalls-*.txt"
fi

if want timeline; then
    # Nsight Systems traces a normal pipelined decode (MLX's CUDA graphs traced node by node),
    # from the end of the prefill (MLX_SPEC_PROFILE_DECODE) to the end of the run.
    NSYS="$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)"
    if [[ -z "$NSYS" ]]; then
        row "decode step timeline (Nsight Systems) | no nsys on this machine"
    else
        # TIMELINE_SETS: --fused-kernels sets ("default": the default, no flag); PROFILE_MODEL:
        # the config under configs/ (default gemma-4-e4b).
        model="${PROFILE_MODEL:-gemma-4-e4b}"
        for fused in ${TIMELINE_SETS:-default none}; do
            tag="timeline-$model-${fused//,/+}"
            fused_flag=()
            [[ "$fused" == default ]] || fused_flag=(--fused-kernels "$fused")
            MLX_SPEC_PROFILE_DECODE=1 timeout 240 "$NSYS" profile --capture-range=cudaProfilerApi \
                --cuda-graph-trace=node --trace=cuda --force-overwrite true -o "$RES/$tag" \
                "$BIN" generate --device gpu --random-weights --model "$ROOT/configs/$model.json" --dtype bf16 \
                --prompt-ids "$(seq -s, 2 513)" --max-tokens 48 --ignore-eos --json "${fused_flag[@]}" ${PROFILE_ARGS:-} \
                >"$RES/$tag.out" 2>"$RES/$tag.err"
            "$NSYS" stats --report cuda_gpu_trace --format csv --force-export true "$RES/$tag.nsys-rep" \
                >"$RES/$tag.csv" 2>>"$RES/$tag.err"
            python3 "$ROOT/bench/gpu/timeline_step.py" "$RES/$tag.csv" "$model bf16, --fused-kernels $fused ${PROFILE_ARGS:-}" \
                | tee -a "$RES/timeline.md" || tail -n 3 "$RES/$tag.err"
            rm -f "$RES/$tag.nsys-rep" "$RES/$tag.sqlite"
        done
        row "decode step timeline (Nsight Systems) | printed above, kept in timeline.md"
    fi
fi

if want sanitize; then
    # Compute Sanitizer (the image's CUDA toolkit) over a short E4B decode: racecheck on the
    # 4-bit quantized products (a shared-memory race in MLX's quantized matmul would explain
    # the rare 4-bit disagreement) and on our default kernels; memcheck on our kernels with
    # the post-attention path (racecheck may run blocks one after another, which a grid-wide
    # barrier cannot survive).
    CS="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    ids="$(seq -s, 2 65)"
    sanitize() {
        local label="$1" file="$2"; shift 2
        timeout 400 "$CS" "$@" "$BIN" generate --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" \
            --dtype bf16 --prompt-ids "$ids" --max-tokens 3 --ignore-eos --json "${GEN_ARGS[@]}" >"$RES/$file" 2>&1
        echo "## $label (exit $?)"
        grep -E "SUMMARY|Race reported|Error: |Invalid|hazard" "$RES/$file" | sort | uniq -c | head -n 12
        row "$label | $(grep -E "SUMMARY" "$RES/$file" | tail -n 1 || echo "no summary, see $file")"
    }
    GEN_ARGS=(--random-bits 4 --fused-kernels none)
    sanitize "racecheck, 4-bit quantized products" race-q4.txt --tool racecheck --kernel-name kns=qm --print-limit 20
    GEN_ARGS=()
    sanitize "racecheck, our kernels (default set)" race-ours.txt --tool racecheck --kernel-name kns=custom_kernel --print-limit 20
    sanitize "memcheck, our kernels (default set)" memcheck-ours.txt --tool memcheck --kernel-name kns=custom_kernel --print-limit 20
fi

if want quick; then
    # Two sets, four rounds each, and a compile of the kernels: possibly minutes on a cold
    # kernel cache.
    # -v: each set's rate is logged as it comes (bench.err), kept should a set end the process.
    # QUICK_MODEL: another config of configs/ (default gemma-4-e4b), e.g. gemma-4-12b.
    BENCH_TIMEOUT="${QUICK_TIMEOUT:-480}" bench "mlx-spec ${QUICK_MODEL:-gemma-4-e4b} bf16 (quick)" -v --model "$ROOT/configs/${QUICK_MODEL:-gemma-4-e4b}.json" --dtype bf16 --prompt-tokens 512 --gen-tokens "${QUICK_TOKENS:-64}" --repeats "${QUICK_ROUNDS:-2}" --compare-fused
fi

if want quick-q4; then
    # The 4-bit E4B: MLX's quantized products against our kernels over 4-bit rows,
    # alternated in one process.
    BENCH_TIMEOUT="${QUICK_TIMEOUT:-400}" bench "mlx-spec E4B 4-bit g64 (quick)" -v --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 \
        --random-bits 4 --prompt-tokens 512 --gen-tokens "${QUICK_TOKENS:-64}" --repeats "${QUICK_ROUNDS:-2}" --compare-fused
fi

if want host; then
    # With one CUDA graph per step MLX never waits for the device inside async_eval (it does
    # once more than 10 committed graphs are in flight), so "submit" is the host's own work and
    # a synchronised step is build + submit + the device's own time.
    ONE_GRAPH="MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000"
    for fused in ${HOST_SETS:-default none}; do
        bench "mlx-spec E4B bf16, --fused-kernels $fused" --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 \
            --prompt-tokens 512 --gen-tokens 64 --repeats 2 --fused-kernels "$fused"
        BENCH_ENV="$ONE_GRAPH" bench "mlx-spec E4B bf16, --fused-kernels $fused, one graph per step" \
            --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 2 \
            --fused-kernels "$fused"
    done
fi

if want large; then
    # LARGE_MODELS: which of the two (default both; "31b" alone fits a call with room).
    if [[ " ${LARGE_MODELS:-31b 26b-a4b} " == *" 31b "* ]]; then
        bench "mlx-spec 31B bf16" --model "$ROOT/configs/gemma-4-31b.json" --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 2
    fi
    if [[ " ${LARGE_MODELS:-31b 26b-a4b} " == *" 26b-a4b "* ]]; then
        bench "mlx-spec 26B-A4B bf16 (MoE)" --model "$ROOT/configs/gemma-4-26b-a4b.json" --dtype bf16 --prompt-tokens 512 --gen-tokens 32 --repeats 1
    fi
fi

if want graph-budget; then
    # How many bytes of inputs MLX lets one CUDA graph hold before it commits it
    # (MLX_MAX_MB_PER_BUFFER, 1 000 MB by default on CUDA): a step reads its weights once, so
    # the budget sets how many graphs a step is cut into. Each budget in GRAPH_BUDGETS (MB)
    # for each model in GRAPH_MODELS (config names without gemma-4-), in turn, each its own
    # process (MLX reads the variable once).
    for model in ${GRAPH_MODELS:-e4b 12b 31b}; do
        for mb in ${GRAPH_BUDGETS:-1000 4000 16000 100000}; do
            BENCH_ENV="MLX_MAX_MB_PER_BUFFER=$mb" bench "mlx-spec ${model^^} bf16, graphs of up to $mb MB" \
                --model "$ROOT/configs/gemma-4-$model.json" --dtype bf16 --prompt-tokens 512 \
                --gen-tokens 64 --repeats "${GRAPH_REPEATS:-3}"
        done
    done
fi

if want assistant; then
    # The assistant drafter on the GPU, on the two oracle pairs (tests/fixtures/assistant-oracle,
    # f32): `draft` must give transformers' first round, and speculating with it must leave the
    # greedy output of the GPU's plain decoding unchanged. With MLX's operations alone
    # (--fused-kernels none): the fused path takes float32 windows a token at a time, where
    # drafting is switched off.
    for pair in e dense; do
        dir="$ROOT/tests/fixtures/assistant-oracle/$pair"
        read -r prompt anchor drafts < <(python3 -c 'import json, sys
o = json.load(open(sys.argv[1])); n = o["prompt_len"]; g = o["generate_output"]
print(",".join(map(str, g[:n])), g[n], ",".join(map(str, o["rounds"][0]["draft_tokens"])))' "$dir/oracle.json")
        common=(--device gpu --fused-kernels none --model "$dir/target" --dtype f32 --prompt-ids "$prompt")
        drafter=(--plugins-dir "$G/bin/plugins" --drafter assistant --drafter-set "checkpoint=$dir/assistant")
        got="$(timeout 120 "$BIN" draft "${common[@]}" "${drafter[@]}" --num-draft-tokens 4 --json 2>"$RES/assistant.err")"
        want_json="{\"anchor\":$anchor,\"drafts\":[$drafts]}"
        [[ "$got" == "$want_json" ]] && verdict="equal" || verdict="DIFFERENT: $got vs $want_json"
        row "assistant draft on the GPU, oracle pair $pair | transformers' first round: $verdict"
        plain="$(timeout 120 "$BIN" generate "${common[@]}" --max-tokens 48 --ignore-eos --json 2>>"$RES/assistant.err" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')"
        spec="$(timeout 120 "$BIN" generate "${common[@]}" "${drafter[@]}" --no-auto-off --max-tokens 48 --ignore-eos --json 2>>"$RES/assistant.err" | python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; print(d["tokens"], s["num_drafts"], s["drafter_error"])')"
        [[ "$spec" == "$plain "* && "$spec" == *" None" ]] && verdict="equal (${spec#"$plain "})" || verdict="DIFFERENT: $spec vs $plain"
        row "assistant speculation on the GPU, oracle pair $pair, 48 greedy tokens | vs plain: $verdict"
    done
fi

if want drafters; then
    # The default model's drafters side by side on the GPU, free-text set, with each kernel set
    # of DRAFTER_KERNELS (default: MLX's operations alone; `default` adds the fused kernels,
    # with which the 8-bit default model's verify windows go a token at a time and nothing is
    # drafted). The checkpoints come from the checkout (.gpu/bin/plugins holds manifests and
    # libraries only): slim.sh must leave the named drafters' checkpoints in the tree.
    for kernels in ${DRAFTER_KERNELS:-none}; do
        for drafter in ${DRAFTERS:-ngram assistant glm-mtp deepspec draft-model}; do
            extra=()
            [[ "$drafter" != ngram ]] && extra=(--drafter-set "checkpoint=\"$ROOT/plugins/$drafter/checkpoint\"")
            line="$(timeout 280 "$BIN" bench --device gpu --fused-kernels "$kernels" --drafter "$drafter" \
                --plugins-dir "$G/bin/plugins" "${extra[@]}" --prompt-set "$ROOT/bench/prompts/free_text.jsonl" \
                --gen-tokens 128 --repeats 1 ${DRAFTER_ARGS:-} 2>"$RES/drafters.err" | tail -n 1)"
            row "$drafter vs plain, default model, free_text set, kernels $kernels ${DRAFTER_ARGS:-}| ${line:-failed: $(tail -n 1 "$RES/drafters.err")}"
        done
    done
fi

if want draft-model-cost; then
    # What a round of the draft-model drafter costs at released sizes: E2B drafting for a
    # larger target, both with random bf16 weights (the plugin's `random_weights_seed`), 4 drafts every
    # round. Random drafts are all rejected, so each round emits one token: the spec rate is
    # the price of a round and the drafter column the drafting part of it.
    # DRAFT_COST_KERNELS: the --fused-kernels values of the target (default: the default set;
    # with `none` a GPU drafts nothing); DRAFT_COST_TARGET: the target's config (default: e4b;
    # the 31B's windows verify a token at a time, so it drafts nothing today).
    target="${DRAFT_COST_TARGET:-e4b}"
    for fused in ${DRAFT_COST_KERNELS:-default}; do
        line="$(timeout 400 "$BIN" bench --device gpu --random-weights --model "$ROOT/configs/gemma-4-$target.json" \
            --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 1 --plugins-dir "$G/bin/plugins" \
            --fused-kernels "$fused" --drafter draft-model --drafter-set "checkpoint=\"$ROOT/configs/gemma-4-e2b.json\"" \
            --drafter-set random_weights_seed=1 --num-draft-tokens 4 --no-auto-off \
            2>"$RES/draft-model-cost-$fused.err" | tail -n 1)"
        row "draft-model E2B (random) for $target bf16 (random), 4 drafts every round, kernels $fused | ${line:-failed: $(grep -m1 -E 'panicked|error|what' "$RES/draft-model-cost-$fused.err")}"
    done
fi

if want block-cost; then
    # What a round of a block drafter of a released size costs beside its target: DeepSeek's
    # DSpark for the 12B (3.4 B parameters, blocks of 7) and z-lab's DFlash for the 31B (1.5 B,
    # blocks of 16), random bf16 weights for drafter and target (random_block_drafter.py), every
    # round drafting with --no-auto-off. Random drafts are all rejected, so each round emits one
    # token: the spec rate is the price of a round and the drafter column the block's part.
    # BLOCK_COST: the pairs to run (default "dspark:12b dflash:31b").
    for pair in ${BLOCK_COST:-dspark:12b dflash:31b}; do
        format="${pair%%:*}"; target="${pair##*:}"; plugin=deepspec
        [[ "$format" == dflash ]] && plugin=dflash
        dir="$G/$format-$target"
        python3 "$ROOT/bench/gpu/random_block_drafter.py" "$format" "$ROOT/configs/gemma-4-$target.json" "$dir" \
            >"$RES/block-cost-$format.err" 2>&1
        line="$(timeout 300 "$BIN" bench --device gpu --random-weights --model "$ROOT/configs/gemma-4-$target.json" \
            --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 1 --plugins-dir "$G/bin/plugins" \
            --drafter "$plugin" --drafter-set "checkpoint=\"$dir\"" --no-auto-off \
            2>>"$RES/block-cost-$format.err" | tail -n 1)"
        row "$format block drafter of released size (random) on $target bf16 (random), drafting every round | ${line:-failed: $(grep -m1 -E 'panicked|error|what|Error' "$RES/block-cost-$format.err")}"
        rm -rf "$dir"
    done
fi

if want assistant-cost; then
    # What a round of an assistant of the released E4B assistant's size costs beside E4B's own
    # verify: random weights for both (bench/gpu/random_assistant.py: 4 layers, hidden 256,
    # centroid head over 262 144 tokens), bf16 target, every round drafting 6 tokens (random
    # drafts are all rejected, so each round emits one token: the bench's spec rate is the
    # price of a round and its drafter column the drafting part of it).
    python3 "$ROOT/bench/gpu/random_assistant.py" "$ROOT/configs/gemma-4-e4b.json" "$G/assistant-e4b" \
        >"$RES/assistant-cost.err" 2>&1
    line="$(timeout 300 "$BIN" bench --device gpu --random-weights --model "$ROOT/configs/gemma-4-e4b.json" \
        --dtype bf16 --prompt-tokens 512 --gen-tokens 64 --repeats 1 --plugins-dir "$G/bin/plugins" \
        --drafter assistant --drafter-set "checkpoint=\"$G/assistant-e4b\"" --num-draft-tokens 6 \
        --no-auto-off 2>>"$RES/assistant-cost.err" | tail -n 1)"
    row "assistant of E4B size (random) on E4B bf16 (random), 6 drafts every round | ${line:-failed: $(tail -n 1 "$RES/assistant-cost.err")}"
fi

if want spec; then
    for set in free_text code_edit; do
        line="$(timeout 240 "$LAB" --device gpu --drafter ngram --plugins-dir "$G/bin/plugins" \
            --prompt-set "$ROOT/bench/prompts/$set.jsonl" --gen-tokens 128 --repeats 1 2>"$RES/spec.err" | tail -n 1)"
        row "ngram vs plain, default model, $set set | ${line:-failed: $(tail -n 1 "$RES/spec.err")}"
    done
fi

# 4. The peer: transformers' Gemma4ForCausalLM, same config, random bf16 weights, greedy.
peer() {
    local label="$1"; shift
    local line
    local status
    line="$(timeout "${PEER_TIMEOUT:-400}" python3 "$ROOT/bench/gpu/transformers_peer.py" "$@" 2>"$RES/peer.err" | tail -n 1)"
    status="${PIPESTATUS[0]}"
    if [[ "$status" == 0 && -n "$line" ]]; then
        row "$label | $line"
    elif [[ "$status" == 124 ]]; then
        row "$label | failed: not done within PEER_TIMEOUT=${PEER_TIMEOUT:-400} s (torch.compile on a cold machine takes minutes)"
    else
        row "$label | failed (exit $status): $(grep -v -i warn "$RES/peer.err" | tail -n 1)"
    fi
}
# 6. Where a decode step's time goes: its operations, and MLX's CUDA graph batching.
if want graph; then
    line="$(timeout 240 "$LAB" --device gpu --random-weights --dtype bf16 --model "$ROOT/configs/gemma-4-e4b.json" \
        --prompt-tokens 512 --gen-tokens 8 --repeats 1 --dump-step-graph "$RES/e4b-step.dot" 2>"$RES/graph.err" | tail -n 1)"
    row "E4B bf16, graph of one decode step | ${line:-failed: $(tail -n 1 "$RES/graph.err")}"
fi
if want opcost; then
    # Also with one CUDA graph per chain, so async_eval never waits for the device.
    for env in "" "MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000"; do
        echo "## mlx-spec-lab --op-cost ${env:-(default graph sizes)}"
        env $env timeout 240 "$LAB" --device gpu --op-cost --repeats 3 2>"$RES/opcost.err" | tee -a "$RES/opcost.md"
        row "host µs per operation${env:+ ($env)} | printed above, kept in opcost.md"
    done
fi
if want ffspeed; then
    # Weight streaming rate of the feed-forward block (85 % of E4B's bytes), MLX's operations vs
    # the fused products at 1, 2 and 4 rows per warp, then with the attention output product
    # as three fused products vs the one post-attention kernel; E4B and 12B shapes.
    for m in gemma-4-e4b gemma-4-12b; do
        echo "## mlx-spec-lab --feed-forward-speed ($m)"
        timeout 240 "$LAB" --device gpu --feed-forward-speed --model "$ROOT/configs/$m.json" --repeats 3 \
            2>"$RES/ffspeed.err" | tee -a "$RES/ffspeed.md"
        row "feed-forward GB/s ($m) | printed above, kept in ffspeed.md"
    done
fi
if want knobs; then
    for knob in "MLX_MAX_OPS_PER_BUFFER=20" "MLX_MAX_OPS_PER_BUFFER=60" "MLX_MAX_OPS_PER_BUFFER=120" \
        "MLX_MAX_OPS_PER_BUFFER=250" "MLX_CUDA_GRAPH_CACHE_SIZE=2000" "MLX_USE_CUDA_GRAPHS=0"; do
        BENCH_ENV="$knob" bench "mlx-spec E4B bf16, $knob" --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 \
            --prompt-tokens 512 --gen-tokens 64 --repeats 2
    done
fi

if want peer; then
    peer "transformers E4B bf16, dynamic cache" "$ROOT/configs/gemma-4-e4b.json" 512 64 dynamic
fi
if want peer || want peer-static; then
    peer "transformers E4B bf16, static cache + torch.compile" "$ROOT/configs/gemma-4-e4b.json" 512 64 static
fi

# 5. The GPU path computes the function the CPU path computes at the E4B shape: the same
#    random f32 weights (one process), greedy on the GPU with TF32 off, then on the CPU.
if want kernel-check; then
    # Fused kernels on random bf16 data (mlx-spec-lab --check-kernels): decode attention against MLX's
    # operations (float32 reference; heads of 256 and 512, buffers of 40 to 4096 slots, wide
    # and narrow rounds), and the 4-bit feed-forward products with integer dots against float
    # unpacking.
    timeout 300 "$LAB" --device gpu --check-kernels >"$RES/kernel-check.md" 2>"$RES/kernel-check.err"
    cat "$RES/kernel-check.md"
    row "fused kernels on random bf16 data (mlx-spec-lab --check-kernels) | $(tail -n 1 "$RES/kernel-check.md" 2>/dev/null || true) $(tail -n 1 "$RES/kernel-check.err")"
fi

if want kernel-cache; then
    # 1. Time to the first token of fresh processes with a fresh $HOME, MLX_PTX_CACHE_DIR
    #    unset (so mlx-spec's default cache folder): the first run compiles every kernel, the
    #    second finds them all; the third has mlx-spec's kernel cache off, so only MLX's own
    #    reading of its cache can find our kernels' modules (a fast third run shows that MLX
    #    names them as mlx-spec does). Part 2's first process of each model is the time of
    #    compiling without the cache, as every process did.
    KC_HOME="$(mktemp -d)"
    n=0
    for spec in "first|on" "second|on" "third, mlx-spec's kernel cache off (MLX alone reads the modules)|off"; do
        IFS='|' read -r run switch <<<"$spec"
        n=$((n + 1))
        t0=$SECONDS
        line="$(env -u MLX_PTX_CACHE_DIR HOME="$KC_HOME" XDG_CACHE_HOME= MLX_SPEC_KERNEL_CACHE=$switch timeout 240 \
            "$BIN" -v generate --device gpu --prompt "def read_config(path):" --max-tokens 16 --ignore-eos --json \
            2>"$RES/kernel-cache-$n.err" | grep -o '"prefill_seconds":[0-9.]*')"
        kept="$(find "$KC_HOME/.cache/mlx-spec" -name '*.ptx' 2>/dev/null | wc -l)"
        row "default model generate, $run run with a fresh HOME | $((SECONDS - t0)) s, $kept modules in the kernel cache, ${line:-failed: $(tail -n 1 "$RES/kernel-cache-$n.err")}"
    done
    # 2. The kernels mlx-spec compiles compute what MLX's compile of them computes, bit for
    #    bit: E4B (bf16, then 4-bit: KC_MODELS) from a 6-token prompt (the window kernels) and
    #    8 decode steps, in a fresh MLX cache with mlx-spec's kernel cache off (MLX compiles
    #    everything), a fresh one with it on (mlx-spec compiles its kernels), the same again
    #    (every module found). The logits' digests must be equal.
    for spec in ${KC_MODELS:-bf16 4-bit}; do
        quant=(); [[ "$spec" == 4-bit ]] && quant=(--random-bits 4)
        digests=() times=()
        KC_DIR="$(mktemp -d)"
        for switch in off on on; do
            dir="$KC_DIR/$switch"
            t0=$SECONDS
            digest="$(MLX_PTX_CACHE_DIR="$dir" MLX_SPEC_KERNEL_CACHE=$switch timeout 300 "$LAB" --device gpu \
                --random-weights --model "$ROOT/configs/gemma-4-e4b.json" --dtype bf16 "${quant[@]}" --prompt-tokens 6 \
                --gen-tokens 8 --repeatability 2 2>"$RES/kernel-cache-e4b.err" | grep -o 'logits digest [0-9a-f]*')"
            digests+=("${digest:-failed: $(tail -n 1 "$RES/kernel-cache-e4b.err")}")
            times+=("$((SECONDS - t0)) s")
        done
        same="differ"
        [[ "${digests[0]}" == "${digests[1]}" && "${digests[1]}" == "${digests[2]}" && "${digests[0]}" == logits* ]] && same="equal"
        row "E4B $spec, kernels compiled by MLX vs by mlx-spec's cache vs found in it | logits $same (${digests[*]}); process times ${times[*]}"
    done
fi

if want cpu-check; then
    line="$(MLX_ENABLE_TF32=0 timeout 500 "$LAB" --device gpu --random-weights --dtype f32 \
        --model "$ROOT/configs/gemma-4-e4b.json" --prompt-tokens 16 --gen-tokens 2 --repeats 1 --check-cpu 8 \
        2>"$RES/cpu-check.err" | tail -n 1)"
    row "E4B shape, f32 random weights: GPU (TF32 off) vs CPU | ${line:-failed: $(tail -n 1 "$RES/cpu-check.err")}"
fi

if want cpu-check-q4; then
    # The 4-bit kernels at a real shape: E4B with 4-bit weights (groups of 64) and float32
    # activations, greedy on the GPU with the 4-bit kernels == greedy on the CPU
    # (MLX's quantized products there), the same weight arrays.
    for fused in ${CPU_Q4_SETS:-default}; do
        line="$(MLX_ENABLE_TF32=0 timeout 300 "$LAB" --device gpu --random-weights --random-bits 4 --dtype f32 \
            --model "$ROOT/configs/gemma-4-e4b.json" --prompt-tokens 16 --gen-tokens 2 --repeats 1 --check-cpu 8 \
            --fused-kernels "$fused" 2>"$RES/cpu-check-q4.err" | tail -n 1)"
        row "E4B shape, 4-bit weights, f32: GPU (TF32 off, --fused-kernels $fused) vs CPU | ${line:-failed: $(tail -n 1 "$RES/cpu-check-q4.err")}"
    done
fi

if [[ "${KEEP_KERNEL_CACHE:-0}" == 1 ]]; then
    (cd "$G" && tar cf - "$(basename "$MLX_PTX_CACHE_DIR")" "$(basename "$CUDA_CACHE_PATH")" 2>/dev/null) \
        | xz -T0 -6 >"$RES/kernel-cache.tar.xz"
    echo "kernel cache kept: $(du -h "$RES/kernel-cache.tar.xz" | cut -f1)"
    # A file much over 14 MB does not come back from a lease (a cache with the 4-bit window
    # kernels reached 26 MB), nor fits one call with the working tree: pieces of 12 MB do.
    if [[ $(stat -c %s "$RES/kernel-cache.tar.xz") -gt $((12 * 1024 * 1024)) ]]; then
        split -b 12M -d -a 1 "$RES/kernel-cache.tar.xz" "$RES/kernel-cache.part-"
        rm "$RES/kernel-cache.tar.xz"
        echo "kernel cache kept in pieces: $(cd "$RES" && ls kernel-cache.part-*)"
    fi
fi

echo
echo "| measurement | result |"
echo "|---|---|"
for r in "${ROWS[@]}"; do echo "| $r |"; done
