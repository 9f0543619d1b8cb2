// What our fused kernels need of MLX's device header, `mlx/backend/cuda/device/utils.cuh`,
// which MLX 0.32 places first in every custom kernel's source. MLX keeps that header inside
// libmlx, out of reach, so where mlx-spec compiles a kernel itself (the kernel cache,
// host/src/kernels/kernel_cache.rs; bench/gpu/compile_check.py) NVRTC gets this file under
// the same name instead. Our kernels use only the half-precision types, numeric limits and
// fixed-width integers from it; a kernel whose signature takes MLX's Shape or Strides
// arguments is never compiled against this file.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/limits>

typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
