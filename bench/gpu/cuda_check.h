// CHECK(call): the CUDA runtime call, or its error (file, line, the call) on stderr and exit 1.
// Shared by the standalone benchmarks of bench/gpu (stage_overlap.cu, carveout.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                       \
    do {                                                                                  \
        cudaError_t err_ = (call);                                                        \
        if (err_ != cudaSuccess) {                                                        \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,            \
                         cudaGetErrorString(err_));                                       \
            std::exit(1);                                                                 \
        }                                                                                 \
    } while (0)
