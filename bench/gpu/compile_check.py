#!/usr/bin/env python3
"""Compiles the CUDA kernel sources `mlx-spec-lab --dump-kernel-sources` wrote, with NVRTC
and ptxas for the H200 (sm_90a), on a machine with no GPU.

Why: a kernel that does not compile, or whose registers or shared memory leave fewer blocks
resident than a grid-wide barrier needs, otherwise shows up only on the GPU machine, where it
costs a lease. The sources are those MLX 0.32 would compile (its signature typed by the
arrays' dtypes, the template arguments as constants), so a wrongly typed input fails here as
it would there. MLX's own device header is replaced by the stand-in that mlx-spec's kernel
cache compiles against (host/kernels/src/cuda/mlx_device_stand_in.cuh).

Usage: compile_check.py --cuda NVIDIA_DIR DUMP_DIR [DUMP_DIR ...]
NVIDIA_DIR holds the unpacked `nvidia/` tree of the cuda-nvrtc, cuda-nvcc (ptxas),
cuda-runtime and cuda-cccl wheels (`compile_check.sh` fetches them). Prints one row a kernel
and a summary; exits non-zero if any kernel fails to compile or would not keep its grid
resident.
"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

# The H200: 132 multiprocessors, 64 Ki registers and 228 KiB of shared memory each (1 KiB of
# it reserved per block), at most 32 blocks and 2 048 threads.
MULTIPROCESSORS = 132
REGISTERS = 65536
SHARED = 228 * 1024
SHARED_RESERVED = 1024
# Kernels whose blocks meet at grid-wide barriers: every block must be resident at once.
GRID_BARRIER_KERNELS = (
    "custom_kernel_post_attention",
    "custom_kernel_per_layer_input",
    "custom_kernel_window_post_attention",
)

# Stands in for MLX's mlx/backend/cuda/device/utils.cuh: the types and names our kernels use
# (the same file mlx-spec's kernel cache compiles against).
MLX_DEVICE_HEADER = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "host", "kernels",
                                      "src", "cuda", "mlx_device_stand_in.cuh")).read()


def resident_blocks(registers, shared, threads):
    """Blocks of `threads` a multiprocessor holds at once with these resources."""
    warps = (threads + 31) // 32
    # Registers are given out per warp in units of 256.
    per_warp = ((registers * 32 + 255) // 256) * 256
    by_registers = REGISTERS // max(per_warp * warps, 1)
    by_shared = SHARED // (shared + SHARED_RESERVED)
    by_threads = 2048 // threads
    return min(by_registers, by_shared, by_threads, 32)


def compile_one(nvrtc, nvidia, include_dir, path, work):
    src = open(path).read()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), os.path.basename(path).encode(), 0, None, None)
    if rc != 0:
        return None, "nvrtcCreateProgram failed"
    options = [
        b"--device-as-default-execution-space",
        b"--gpu-architecture=compute_90a",
        b"-I" + include_dir.encode(),
        b"-I" + os.path.join(nvidia, "cuda_runtime", "include").encode(),
        b"-I" + os.path.join(nvidia, "cuda_cccl", "include").encode(),
        b"-I" + os.path.join(nvidia, "cuda_nvcc", "include").encode(),
    ]
    array = (ctypes.c_char_p * len(options))(*options)
    rc = nvrtc.nvrtcCompileProgram(prog, len(options), array)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        return None, log.value.decode(errors="replace")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    ptx_path = os.path.join(work, "k.ptx")
    with open(ptx_path, "wb") as f:
        f.write(ptx.value)
    ptxas = os.path.join(nvidia, "cuda_nvcc", "bin", "ptxas")
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", os.path.join(work, "k.cubin")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stderr
    info = {"registers": 0, "shared": 0, "spill": 0}
    for line in out.stderr.splitlines():
        if "Used" in line:
            parts = line.split("Used", 1)[1].split(",")
            for p in parts:
                p = p.strip()
                if p.endswith("registers"):
                    info["registers"] = int(p.split()[0])
                elif "bytes smem" in p:
                    info["shared"] = int(p.split()[0])
        if "spill stores" in line:
            info["spill"] += int(line.split("bytes spill stores")[0].split(",")[-1].strip())
    return info, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", required=True, help="folder holding the unpacked nvidia/ wheels")
    parser.add_argument("dumps", nargs="+", help="folders written by mlx-spec-lab --dump-kernel-sources")
    args = parser.parse_args()
    nvidia = os.path.join(args.cuda, "nvidia")
    nvrtc = ctypes.CDLL(os.path.join(nvidia, "cuda_nvrtc", "lib", "libnvrtc.so.12"))
    failures = 0
    rows = []
    with tempfile.TemporaryDirectory() as work:
        include_dir = os.path.join(work, "include")
        os.makedirs(os.path.join(include_dir, "mlx", "backend", "cuda", "device"))
        with open(os.path.join(include_dir, "mlx", "backend", "cuda", "device", "utils.cuh"), "w") as f:
            f.write(MLX_DEVICE_HEADER)
        for dump in args.dumps:
            listing = os.path.join(dump, "kernels.tsv")
            if not os.path.exists(listing):
                print(f"{dump}: no kernels.tsv (not a --dump-kernel-sources folder)")
                failures += 1
                continue
            lines = open(listing).read().splitlines()[1:]
            for line in lines:
                # A fifth column (newer dumps): the dynamic shared memory of a block.
                file, kernel, threads, blocks, *dynamic = line.split("\t")
                threads, blocks = int(threads), int(blocks)
                dynamic_shared = int(dynamic[0]) if dynamic else 0
                info, error = compile_one(nvrtc, nvidia, include_dir, os.path.join(dump, file), work)
                where = f"{os.path.basename(os.path.normpath(dump))}/{file}"
                if error is not None:
                    failures += 1
                    print(f"FAILED {where}\n{error[:3000]}")
                    continue
                resident = resident_blocks(info["registers"], info["shared"] + dynamic_shared, threads)
                verdict = "ok"
                if kernel.startswith(GRID_BARRIER_KERNELS) and blocks > resident * MULTIPROCESSORS:
                    verdict = f"NOT RESIDENT: {blocks} blocks, {resident * MULTIPROCESSORS} fit"
                    failures += 1
                if info["spill"] > 0:
                    verdict += f" (spills {info['spill']} bytes)"
                rows.append((where, info["registers"], info["shared"] + dynamic_shared, resident, blocks, verdict))
    print("| kernel | registers | shared bytes | blocks a multiprocessor | grid | verdict |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %d | %d | %d | %s |" % r)
    print(f"{len(rows)} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
