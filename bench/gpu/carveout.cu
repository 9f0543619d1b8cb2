// Does a decode step pay for the multiprocessors' shared-memory carveout changing between
// kernels?
//
// Each multiprocessor splits one on-chip array between L1 and shared memory, and the driver
// picks the split for each kernel from the shared memory its blocks need. A Gemma 4 decode
// layer runs three of mlx-spec's kernels in turn, and they need different amounts: on the
// 12B, the attention heads 7.8 KB a block at 4-5 blocks a multiprocessor, decode attention
// 12.4 KB at one, the post-attention kernel 38.5 KB at two (`compile_check.sh`). If changing
// the split costs time at a kernel boundary, a step pays it three times a layer, and the
// one-kernel-per-stage bound of `stage_overlap.cu` (one kernel, one split) would not show it.
//
// Chains of nearly empty kernels (each block stages a little shared memory and reads 16 KB
// through L1, so there is something to give up), captured in one CUDA graph and replayed:
//
//   same kernel         one kernel, 38.5 KB a block, over and over (no change of kernel)
//   same shared         three kernels of 38.5 KB each, in turn (kernels change, needs do not)
//   layer pattern       7.8 KB x 512 blocks, 12.4 KB x 96, 38.5 KB x 264, in turn (a layer's)
//   ... carveout max    the same, each kernel asking for the largest shared split
//                       (cudaFuncAttributePreferredSharedMemoryCarveout), so none changes
//   ... device prefers shared   the same with no per-kernel attribute but the device's
//                       cache preference set to shared (cudaDeviceSetCacheConfig): the one
//                       route open to kernels MLX compiles, whose handles mlx-spec never sees
//
// Build and run on the GPU machine (bench/gpu/run.sh carveout does both):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o carveout carveout.cu && ./carveout
// Prints a markdown table, µs a kernel (median of the replays); the last line sums it up.

#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kThreads = 256;
// Floats of the input a block reads through L1 (16 KB).
constexpr int kReadFloats = 4096;

// A kernel whose blocks hold SHARED_BYTES of static shared memory (as mlx-spec's do), fill
// it, read their 16 KB through L1 and write one value. TAG tells kernels of the same size apart.
template <int SHARED_BYTES, int TAG>
__global__ void __launch_bounds__(kThreads) staged(const float* in, float* out) {
    constexpr int FLOATS = SHARED_BYTES / 4;
    __shared__ float buf[FLOATS];
    for (int i = threadIdx.x; i < FLOATS; i += kThreads) buf[i] = static_cast<float>(i + TAG);
    float acc = 0.f;
    const float* mine = in + (size_t)(blockIdx.x % 64) * kReadFloats;
    for (int i = threadIdx.x; i < kReadFloats; i += kThreads) acc += __ldg(mine + i);
    __syncthreads();
    acc += buf[(threadIdx.x * 7) % FLOATS];
    // One write a block keeps the work from being optimised away.
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

struct Launch {
    const void* kernel;
    int blocks;
};

// The three sizes of a 12B layer's kernels, and two more of the largest for the control.
const void* const kHeads = reinterpret_cast<const void*>(&staged<7808, 0>);
const void* const kAttention = reinterpret_cast<const void*>(&staged<12444 / 4 * 4, 1>);
const void* const kPost = reinterpret_cast<const void*>(&staged<38528, 2>);
const void* const kPostB = reinterpret_cast<const void*>(&staged<38528, 3>);
const void* const kPostC = reinterpret_cast<const void*>(&staged<38528, 4>);

// Median µs a kernel of `chain` (repeated `rounds` times in one graph) over `replays` replays.
double time_chain(const std::vector<Launch>& chain, int rounds, const float* in, float* out,
                  cudaStream_t stream) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int r = 0; r < rounds; r++) {
        for (const Launch& l : chain) {
            void* args[] = {const_cast<float**>(&in), &out};
            CHECK(cudaLaunchKernel(l.kernel, dim3(l.blocks), dim3(kThreads), args, 0, stream));
        }
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    // Two replays to warm up, then the timed ones.
    for (int i = 0; i < 2; i++) CHECK(cudaGraphLaunch(exec, stream));
    std::vector<double> us;
    const int replays = 21;
    for (int i = 0; i < replays; i++) {
        CHECK(cudaEventRecord(start, stream));
        CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaEventRecord(stop, stream));
        CHECK(cudaEventSynchronize(stop));
        float ms = 0.f;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        us.push_back(1e3 * ms / (rounds * chain.size()));
    }
    std::sort(us.begin(), us.end());
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return us[us.size() / 2];
}

void set_carveout(int percent) {
    for (const void* k : {kHeads, kAttention, kPost, kPostB, kPostC}) {
        CHECK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, percent));
    }
}

}  // namespace

int main() {
    int device = 0, sms = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    float* in = nullptr;
    float* out = nullptr;
    CHECK(cudaMalloc(&in, 64 * kReadFloats * sizeof(float)));
    CHECK(cudaMemset(in, 0, 64 * kReadFloats * sizeof(float)));
    CHECK(cudaMalloc(&out, 4096 * sizeof(float)));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    // Grids as on the 12B: four heads blocks a multiprocessor (512 on 132), one attention
    // block on most, two post-attention blocks on each.
    const int heads_blocks = std::min(512, 4 * sms);
    const int attention_blocks = 96;
    const int post_blocks = 2 * sms;
    const std::vector<Launch> same_kernel = {{kPost, post_blocks}};
    const std::vector<Launch> same_shared = {{kPostB, heads_blocks}, {kPostC, attention_blocks}, {kPost, post_blocks}};
    const std::vector<Launch> layer = {{kHeads, heads_blocks}, {kAttention, attention_blocks}, {kPost, post_blocks}};
    const int rounds = 100;

    struct Row {
        const char* name;
        double us;
    };
    std::vector<Row> rows;
    set_carveout(cudaSharedmemCarveoutDefault);
    CHECK(cudaDeviceSetCacheConfig(cudaFuncCachePreferNone));
    rows.push_back({"same kernel (38.5 KB a block)", time_chain(same_kernel, 3 * rounds, in, out, stream)});
    rows.push_back({"same shared (three kernels of 38.5 KB)", time_chain(same_shared, rounds, in, out, stream)});
    rows.push_back({"layer pattern (7.8, 12.4, 38.5 KB), driver's carveouts", time_chain(layer, rounds, in, out, stream)});
    CHECK(cudaDeviceSetCacheConfig(cudaFuncCachePreferShared));
    rows.push_back({"layer pattern, device prefers shared", time_chain(layer, rounds, in, out, stream)});
    CHECK(cudaDeviceSetCacheConfig(cudaFuncCachePreferNone));
    set_carveout(cudaSharedmemCarveoutMaxShared);
    rows.push_back({"layer pattern, every kernel's carveout max shared", time_chain(layer, rounds, in, out, stream)});
    set_carveout(cudaSharedmemCarveoutDefault);
    rows.push_back({"layer pattern, driver's carveouts again", time_chain(layer, rounds, in, out, stream)});

    std::printf("| chain (%d multiprocessors, nearly empty kernels, one CUDA graph) | µs a kernel |\n", sms);
    std::printf("|---|---|\n");
    for (const Row& r : rows) std::printf("| %s | %.2f |\n", r.name, r.us);
    const double driver = std::min(rows[2].us, rows[5].us);
    const double best_fixed = std::min(rows[3].us, rows[4].us);
    std::printf("carveout changes cost %.2f µs a kernel boundary over one fixed carveout (%.2f µs over kernels of one size)\n",
                driver - best_fixed, driver - rows[1].us);
    CHECK(cudaFree(in));
    CHECK(cudaFree(out));
    return 0;
}
