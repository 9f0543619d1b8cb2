// How much of the cost of a boundary between two dependent kernels can overlap be won back?
//
// `stage_bound.py` shows that a Gemma 4 decode step run as one kernel per dependent stage
// loses about a third of the memory floor at the boundaries: the memory system idles while
// one grid drains and the next ramps up. CUDA's programmatic dependent launch (PDL) lets the
// next kernel's blocks start while the previous kernel still runs, and wait for its results
// only where they read them; meanwhile they can ask for their own weights, which do not
// depend on the previous stage. MLX's custom-kernel API does not expose that launch
// attribute, so this program measures what it would buy, on the same chain of stages:
//
//   launches      one plain launch per stage (what MLX does)
//   pdl           the same kernels launched with PDL: each lets the next one start at once
//                 and waits for its predecessor before reading its input
//   pdl+prefetch  as pdl, and before waiting each block asks L2 for the first bytes of its
//                 weight rows
//   one kernel    every stage in one cooperative kernel, the stages meeting at grid-wide
//                 barriers (what a persistent kernel can do inside MLX's API), without and
//                 with each block asking for its next stage's first weights before the barrier
//
// All of them run the same arithmetic on the same data, chained (each stage reads the output
// of the one before), the chains of kernels from one CUDA graph; their final outputs must be
// equal bit for bit.
//
// Build and run on the GPU machine (bench/gpu/run.sh stage-overlap does both):
//   nvcc -O3 -arch=sm_90a -o stage_overlap stage_overlap.cu
//   ./stage_overlap SHAPES_FILE [COPY_TB_S]
// SHAPES_FILE holds one "rows cols" line per stage, in order (stage_bound.py --write-shapes).
// Prints a markdown table; the last line sums it up.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 2;
// Bytes of its weight rows a block asks L2 for before it waits (pdl+prefetch). A boundary
// costs about 2 µs; at ~4 TB/s that is ~8 MB over the whole GPU, ~32 KB a block.
constexpr int kPrefetchBytesPerBlock = 32 * 1024;

// Eight bf16 products of a 16-byte piece of a weight row and of the input, in float32.
__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    const uint32_t wv[4] = {w.x, w.y, w.z, w.w};
    const uint32_t xv[4] = {x.x, x.y, x.z, x.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc = fmaf(__uint_as_float(wv[i] << 16), __uint_as_float(xv[i] << 16), acc);
        acc = fmaf(__uint_as_float(wv[i] & 0xffff0000u), __uint_as_float(xv[i] & 0xffff0000u), acc);
    }
    return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// The first bytes of this warp's rows of W ([rows, cols] bf16, two rows a warp at a time as
// `rows_times_input` takes them), up to its share of a block's prefetch budget, asked of L2 one
// 128-byte line a lane at a time. The weights do not depend on the previous stage, so a block
// can ask for them before it waits for that stage.
__device__ __forceinline__ void prefetch_rows(const __nv_bfloat16* w, int rows, int cols, int warp,
                                              int warps, int lane) {
    const size_t row_bytes = static_cast<size_t>(cols) * 2;
    const size_t budget = kPrefetchBytesPerBlock / kWarps;
    size_t asked = 0;
    for (int r = 2 * warp; r < rows && asked < budget; r += 2 * warps) {
        for (int k = 0; k < 2 && r + k < rows && asked < budget; k++) {
            const char* row = reinterpret_cast<const char*>(w) + static_cast<size_t>(r + k) * row_bytes;
            const size_t n = row_bytes < budget - asked ? row_bytes : budget - asked;
            for (size_t off = static_cast<size_t>(lane) * 128; off < n; off += 32 * 128)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
            asked += n;
        }
    }
}

// y = W x for one token: W is [rows, cols] bf16, row-major; cols a multiple of 8. The block
// stages x in shared memory, then a warp takes two rows at a time (grid-stride over rows),
// each lane 16 bytes of each row at a time. A row's sum depends only on the row, not on the
// warp or the grid, so every way of launching gives the same bits.
__device__ __forceinline__ void rows_times_input(const __nv_bfloat16* __restrict__ w,
                                                 const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols,
                                                 uint4* staged, int warp, int warps, int lane) {
    const int chunks = cols / 8;
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    // The input was written by other blocks of this launch in the one-kernel modes: read it
    // from L2 (__ldcg), never through the non-coherent cache that may hold an older copy.
    for (int i = threadIdx.x; i < chunks; i += kThreads) staged[i] = __ldcg(x4 + i);
    __syncthreads();
    for (int r = 2 * warp; r < rows; r += 2 * warps) {
        const bool second = r + 1 < rows;
        const uint4* a = w4 + static_cast<size_t>(r) * chunks;
        const uint4* b = w4 + static_cast<size_t>(second ? r + 1 : r) * chunks;
        float sa = 0.f, sb = 0.f;
#pragma unroll 4
        for (int c = lane; c < chunks; c += 32) {
            const uint4 wa = __ldg(a + c);
            const uint4 wb = __ldg(b + c);
            const uint4 xc = staged[c];
            sa += dot8(wa, xc);
            sb += dot8(wb, xc);
        }
        sa = warp_sum(sa);
        sb = warp_sum(sb);
        if (lane == 0) {
            y[r] = __float2bfloat16(sa);
            if (second) y[r + 1] = __float2bfloat16(sb);
        }
    }
}

// One stage as one kernel. The input comes from the previous stage: it is read only after
// `griddepcontrol.wait`, which returns once the previous grid has finished and its writes are
// visible (with PDL; without, the stream orders the kernels). With PREFETCH a block asks L2
// for the first bytes of its rows before waiting.
template <bool PDL, bool PREFETCH>
__global__ void __launch_bounds__(kThreads, 2 * kBlocksPerSm)
    matvec(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
           __nv_bfloat16* __restrict__ y, int rows, int cols) {
    // Let the next stage's blocks be scheduled now: they wait for this grid to finish before
    // they read what it writes.
    if (PDL) asm volatile("griddepcontrol.launch_dependents;");
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
    const int warps = gridDim.x * kWarps;
    if (PREFETCH) prefetch_rows(w, rows, cols, warp, warps, lane);
    if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    extern __shared__ uint4 staged[];
    rows_times_input(w, x, y, rows, cols, staged, warp, warps, lane);
}

struct StageOnDevice {
    const __nv_bfloat16* weight;
    int rows;
    int cols;
};

// Every stage in one kernel whose blocks all stay resident (a cooperative launch) and meet at
// a grid-wide barrier between stages: no launch at the boundaries, but the same drain. With
// PREFETCH a block that has finished its rows of one stage asks L2 for the first bytes of its
// rows of the next before it arrives at the barrier, so its next weights are on their way
// while the slowest blocks finish. Stage i reads buffer i % 2 (stage 0: `first`) and writes
// buffer (i + 1) % 2, as the chain of kernels does.
template <bool PREFETCH>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    all_stages(const StageOnDevice* __restrict__ stages, int count, const __nv_bfloat16* first,
               __nv_bfloat16* buffer0, __nv_bfloat16* buffer1) {
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
    const int warps = gridDim.x * kWarps;
    extern __shared__ uint4 staged[];
    for (int i = 0; i < count; i++) {
        const StageOnDevice s = stages[i];
        const __nv_bfloat16* in = i == 0 ? first : (i % 2 ? buffer1 : buffer0);
        __nv_bfloat16* out = (i + 1) % 2 ? buffer1 : buffer0;
        rows_times_input(s.weight, in, out, s.rows, s.cols, staged, warp, warps, lane);
        if (i + 1 < count) {
            if (PREFETCH) {
                const StageOnDevice next = stages[i + 1];
                prefetch_rows(next.weight, next.rows, next.cols, warp, warps, lane);
            }
            grid.sync();
        }
    }
}

// Pseudo-random bf16 values in (-scale, scale), from the element's index and a seed.
__global__ void fill(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = __float2bfloat16(scale * ((h & 0xffffff) / 8388608.f - 1.f));
    }
}

struct Stage {
    int rows;
    int cols;
    __nv_bfloat16* weight;
};

enum class Mode { Launches, Pdl, PdlPrefetch, OneKernel, OneKernelPrefetch };

const char* mode_name(Mode m) {
    switch (m) {
        case Mode::Launches: return "launches";
        case Mode::Pdl: return "pdl";
        case Mode::PdlPrefetch: return "pdl+prefetch";
        case Mode::OneKernel: return "one kernel, grid barriers";
        case Mode::OneKernelPrefetch: return "one kernel, grid barriers, prefetch";
    }
    return "?";
}

bool one_kernel(Mode m) { return m == Mode::OneKernel || m == Mode::OneKernelPrefetch; }

// Launches the whole chain on `stream`: stage i reads buffer i % 2 (stage 0 reads `first`)
// and writes buffer (i + 1) % 2.
void launch_chain(const std::vector<Stage>& stages, Mode mode, const __nv_bfloat16* first,
                  __nv_bfloat16* const buffers[2], int grid, cudaStream_t stream) {
    for (size_t i = 0; i < stages.size(); i++) {
        const Stage& s = stages[i];
        const __nv_bfloat16* in = i == 0 ? first : buffers[i % 2];
        __nv_bfloat16* out = buffers[(i + 1) % 2];
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(grid);
        config.blockDim = dim3(kThreads);
        config.dynamicSmemBytes = static_cast<size_t>(s.cols) * 2;
        config.stream = stream;
        cudaLaunchAttribute attribute[1];
        attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute[0].val.programmaticStreamSerializationAllowed = 1;
        if (mode != Mode::Launches) {
            config.attrs = attribute;
            config.numAttrs = 1;
        }
        switch (mode) {
            case Mode::Launches:
                CHECK(cudaLaunchKernelEx(&config, matvec<false, false>, s.weight, in, out, s.rows, s.cols));
                break;
            case Mode::Pdl:
                CHECK(cudaLaunchKernelEx(&config, matvec<true, false>, s.weight, in, out, s.rows, s.cols));
                break;
            case Mode::PdlPrefetch:
                CHECK(cudaLaunchKernelEx(&config, matvec<true, true>, s.weight, in, out, s.rows, s.cols));
                break;
            default:  // the one-kernel modes do not launch a chain
                break;
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s SHAPES_FILE [COPY_TB_S]\n", argv[0]);
        return 2;
    }
    const double copy_tb_s = argc > 2 ? std::atof(argv[2]) : 0.0;
    FILE* f = std::fopen(argv[1], "r");
    if (!f) {
        std::fprintf(stderr, "cannot open %s\n", argv[1]);
        return 2;
    }
    std::vector<Stage> stages;
    int rows = 0, cols = 0;
    while (std::fscanf(f, "%d %d", &rows, &cols) == 2) {
        if (rows <= 0 || cols <= 0 || cols % 8 != 0) {
            std::fprintf(stderr, "%s: bad stage %d x %d (columns must be a multiple of 8)\n", argv[1], rows, cols);
            return 2;
        }
        stages.push_back({rows, cols, nullptr});
    }
    std::fclose(f);
    if (stages.empty()) {
        std::fprintf(stderr, "%s: no stages\n", argv[1]);
        return 2;
    }

    int device = 0, sms = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int grid = sms * kBlocksPerSm;
    int widest = 0, tallest = 0;
    double bytes = 0;
    for (size_t i = 0; i < stages.size(); i++) {
        Stage& s = stages[i];
        const size_t n = static_cast<size_t>(s.rows) * s.cols;
        CHECK(cudaMalloc(&s.weight, n * 2));
        fill<<<1024, 256>>>(s.weight, n, 0x9e3779b9u * static_cast<uint32_t>(i + 1), 1.f / std::sqrt(static_cast<float>(s.cols)));
        CHECK(cudaGetLastError());
        widest = std::max(widest, s.cols);
        tallest = std::max(tallest, s.rows);
        bytes += static_cast<double>(n) * 2;
    }
    // The buffers hold a stage's output and the next one's input: wide enough for both.
    const size_t span = static_cast<size_t>(std::max(widest, tallest));
    __nv_bfloat16 *first = nullptr, *buffers[2] = {nullptr, nullptr};
    CHECK(cudaMalloc(&first, span * 2));
    fill<<<64, 256>>>(first, span, 12345u, 1.f);
    for (auto& b : buffers) CHECK(cudaMalloc(&b, span * 2));
    // A stage may read more of a buffer than the one before it wrote: each way of launching
    // starts from the same contents, so that their outputs can be compared bit for bit.
    auto reset_buffers = [&] {
        for (auto& b : buffers) fill<<<64, 256>>>(b, span, 777u, 1.f);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
    };
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // The one-kernel modes: the stages' descriptions in device memory, and a grid that fits on
    // the device at once (a cooperative launch refuses one that does not).
    std::vector<StageOnDevice> described;
    for (const Stage& s : stages) described.push_back({s.weight, s.rows, s.cols});
    StageOnDevice* on_device = nullptr;
    CHECK(cudaMalloc(&on_device, described.size() * sizeof(StageOnDevice)));
    CHECK(cudaMemcpy(on_device, described.data(), described.size() * sizeof(StageOnDevice), cudaMemcpyHostToDevice));
    int resident = 0;
    using OneKernel = void (*)(const StageOnDevice*, int, const __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*);
    for (OneKernel kernel : {all_stages<false>, all_stages<true>}) {
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, widest * 2));
        int per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, widest * 2));
        resident = resident == 0 ? per_sm : std::min(resident, per_sm);
    }
    const int one_kernel_grid = std::min(resident, kBlocksPerSm) * sms;
    int count = static_cast<int>(stages.size());
    auto launch_one_kernel = [&](Mode mode) {
        void* args[] = {&on_device, &count, &first, &buffers[0], &buffers[1]};
        const void* kernel = mode == Mode::OneKernelPrefetch ? reinterpret_cast<const void*>(all_stages<true>)
                                                              : reinterpret_cast<const void*>(all_stages<false>);
        CHECK(cudaLaunchCooperativeKernel(kernel, dim3(one_kernel_grid), dim3(kThreads), args,
                                          static_cast<size_t>(widest) * 2, stream));
    };

    using Kernel = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, int, int);
    for (Kernel kernel : {matvec<false, false>, matvec<true, false>, matvec<true, true>})
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, widest * 2));
    CHECK(cudaDeviceSynchronize());

    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    const size_t last = stages.size() % 2;  // the buffer the last stage writes
    std::vector<__nv_bfloat16> reference(stages.back().rows), result(stages.back().rows);

    std::printf("%zu dependent stages, %.2f GB of weights, %d blocks of %d threads a stage (%d in the one kernel)\n\n",
                stages.size(), bytes / 1e9, grid, kThreads, one_kernel_grid);
    std::printf("| launch | µs a step | steps/s | share of the floor | µs lost a boundary | output |\n");
    std::printf("|---|---|---|---|---|---|\n");
    double base_us = 0;
    double pdl_us = 0;
    for (Mode mode : {Mode::Launches, Mode::Pdl, Mode::PdlPrefetch, Mode::OneKernel, Mode::OneKernelPrefetch}) {
        // The chains of kernels replay from a CUDA graph; the one kernel is launched as it is.
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        if (!one_kernel(mode)) {
            CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            launch_chain(stages, mode, first, buffers, grid, stream);
            CHECK(cudaStreamEndCapture(stream, &graph));
            CHECK(cudaGraphInstantiate(&exec, graph, 0));
        }
        auto one_step = [&] {
            if (exec) {
                CHECK(cudaGraphLaunch(exec, stream));
            } else {
                launch_one_kernel(mode);
            }
        };
        reset_buffers();
        for (int i = 0; i < 3; i++) one_step();
        CHECK(cudaStreamSynchronize(stream));
        std::vector<float> times;
        for (int i = 0; i < 9; i++) {
            CHECK(cudaEventRecord(start, stream));
            one_step();
            CHECK(cudaEventRecord(stop, stream));
            CHECK(cudaEventSynchronize(stop));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, start, stop));
            times.push_back(ms * 1000.f);
        }
        std::sort(times.begin(), times.end());
        const double us = times[times.size() / 2];
        auto& out = mode == Mode::Launches ? reference : result;
        CHECK(cudaMemcpy(out.data(), buffers[last], out.size() * 2, cudaMemcpyDeviceToHost));
        const bool same = mode == Mode::Launches ||
                          std::memcmp(reference.data(), result.data(), out.size() * 2) == 0;
        if (mode == Mode::Launches) base_us = us;
        const double floor_us = copy_tb_s > 0 ? bytes / (copy_tb_s * 1e12) * 1e6 : 0;
        char share[64] = "no copy bandwidth given", lost[32] = "";
        if (floor_us > 0) {
            std::snprintf(share, sizeof share, "%.1f %%", 100 * floor_us / us);
            std::snprintf(lost, sizeof lost, "%.2f", (us - floor_us) / stages.size());
        }
        std::printf("| %s | %.0f | %.1f | %s | %s | %s |\n", mode_name(mode), us, 1e6 / us, share, lost,
                    same ? (mode == Mode::Launches ? "reference" : "equal") : "DIFFERS");
        if (exec) {
            CHECK(cudaGraphExecDestroy(exec));
            CHECK(cudaGraphDestroy(graph));
        }
        if (!same) {
            std::fprintf(stderr, "%s: the output differs from plain launches: a dependency was not waited for\n",
                         mode_name(mode));
            return 1;
        }
        if (mode == Mode::PdlPrefetch) pdl_us = us;
        if (mode == Mode::OneKernelPrefetch)
            std::printf("\nstage-overlap: %zu stages; launches %.0f us, pdl+prefetch %.0f us (%.1f %% less), "
                        "one kernel with prefetch %.0f us (%.1f %% less)\n",
                        stages.size(), base_us, pdl_us, 100 * (1 - pdl_us / base_us), us, 100 * (1 - us / base_us));
    }
    return 0;
}
