// Quest's block summaries on SM90: per-page per-KV-head key min/max, folded in as tokens are
// written (decode: one token per page; prefill: runs of tokens per page).
// Plain CUDA: these kernels are memory- and latency-bound, so they are written around wide loads
// and many independent requests in flight rather than tensor cores. Every kernel is graph-safe:
// static launch shapes, device-side counts, no host reads.
#include "prr_kernels.h"
#include "common.cuh"
#include "topk.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <cmath>

namespace prr {
namespace {

// ============================================================================ Quest update
__global__ void quest_reset_kernel(QuestUpdateArgs a) {
  const int n = blockIdx.x;
  const int64_t loc = ld_index(a.out_loc, n, a.loc64), pos = ld_index(a.positions, n, a.pos64);
  const int64_t page = (pos % a.page_size == 0) ? loc / a.page_size : 0;
  const int HD = a.Hk * a.D;
  for (int e = threadIdx.x; e < HD; e += blockDim.x) {
    a.kmin[page * HD + e] = INFINITY;
    a.kmax[page * HD + e] = -INFINITY;
  }
}
__device__ __forceinline__ void atomic_min_f(float* p, float v) {
  if (v >= 0.f) atomicMin(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMax(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
__device__ __forceinline__ void atomic_max_f(float* p, float v) {
  if (v >= 0.f) atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMin(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
// Decode (one token per page): the first token of a page writes the page's summary, any other
// token folds into it, so no reset pass is needed. Padding rows all write page 0, whose summary
// no request reads.
__global__ void quest_decode_update_kernel(QuestUpdateArgs a) {
  const int n = blockIdx.x;
  const int64_t loc = ld_index(a.out_loc, n, a.loc64), pos = ld_index(a.positions, n, a.pos64);
  const int64_t page = loc / a.page_size;
  const bool first = pos % a.page_size == 0;
  const int HD = a.Hk * a.D;
  for (int e = threadIdx.x * 8; e < HD; e += blockDim.x * 8) {
    float f[8];
    load8_any(a.k, (int64_t)n * HD + e, a.k_dtype, f);
    float* lo = a.kmin + page * HD + e;
    float* hi = a.kmax + page * HD + e;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo[i] = first ? f[i] : fminf(lo[i], f[i]);
      hi[i] = first ? f[i] : fmaxf(hi[i], f[i]);
    }
  }
}

// Prefill: each CTA folds kFoldTokens consecutive tokens of the batch. Consecutive tokens of a
// request mostly share a page, so every thread keeps the running min/max of its 8 elements over
// a run of tokens of one page and flushes it with one atomic per element when the page changes:
// kFoldTokens times fewer atomics than one per token and element (an 8K-token chunk hit each
// page's summary 64 times per element). Min and max do not depend on the order, so the result
// is the reference's bit for bit.
constexpr int kFoldTokens = 16;
__global__ void quest_fold_kernel(QuestUpdateArgs a) {
  const int n0 = blockIdx.x * kFoldTokens;
  const int n1 = min(a.N, n0 + kFoldTokens);
  const int HD = a.Hk * a.D;
  for (int e = threadIdx.x * 8; e < HD; e += blockDim.x * 8) {
    float lo[8], hi[8];
    int64_t cur = -1;
    for (int n = n0; n < n1; ++n) {
      const int64_t page = ld_index(a.out_loc, n, a.loc64) / a.page_size;
      float f[8];
      load8_any(a.k, (int64_t)n * HD + e, a.k_dtype, f);
      if (page != cur) {
        if (cur >= 0) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            atomic_min_f(a.kmin + cur * HD + e + i, lo[i]);
            atomic_max_f(a.kmax + cur * HD + e + i, hi[i]);
          }
        }
        cur = page;
#pragma unroll
        for (int i = 0; i < 8; ++i) { lo[i] = f[i]; hi[i] = f[i]; }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) { lo[i] = fminf(lo[i], f[i]); hi[i] = fmaxf(hi[i], f[i]); }
      }
    }
    if (cur >= 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        atomic_min_f(a.kmin + cur * HD + e + i, lo[i]);
        atomic_max_f(a.kmax + cur * HD + e + i, hi[i]);
      }
    }
  }
}

}  // namespace

cudaError_t launch_quest_update(const QuestUpdateArgs& a, cudaStream_t s) {
  if ((a.Hk * a.D) % 8 != 0) return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  if (a.one_per_page) {
    quest_decode_update_kernel<<<a.N, 128, 0, s>>>(a);
    return cudaGetLastError();
  }
  quest_reset_kernel<<<a.N, 256, 0, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  quest_fold_kernel<<<(a.N + kFoldTokens - 1) / kFoldTokens, 128, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace prr
