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
// Summaries are float32, or bfloat16 rounded outward (kmin down, kmax up) so that the Quest
// score stays an upper bound of the logits. Rounding down commutes with the minimum
// (rd(min(a, b)) = min(rd(a), rd(b))), so folding tokens in any order and in any grouping gives
// the reference's bits.
template <typename S> struct Bound;
template <> struct Bound<float> {
  __device__ static float lo(float x) { return x; }
  __device__ static float hi(float x) { return x; }
  __device__ static float get(const float* p) { return *p; }
  __device__ static void put(float* p, float x) { *p = x; }
};
template <> struct Bound<__nv_bfloat16> {
  __device__ static __nv_bfloat16 lo(float x) { return __float2bfloat16_rd(x); }
  __device__ static __nv_bfloat16 hi(float x) { return __float2bfloat16_ru(x); }
  __device__ static float get(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static void put(__nv_bfloat16* p, __nv_bfloat16 x) { *p = x; }
};

template <typename S>
__global__ void quest_reset_kernel(QuestUpdateArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  const int n = blockIdx.x;
  const int64_t loc = ld_index(a.out_loc, n, a.loc64), pos = ld_index(a.positions, n, a.pos64);
  const int64_t page = (pos % a.page_size == 0) ? slot_page(loc, a.page_size, a.num_pages) : 0;
  const int HD = a.Hk * a.D;
  S* kmin = reinterpret_cast<S*>(a.kmin);
  S* kmax = reinterpret_cast<S*>(a.kmax);
  for (int e = threadIdx.x; e < HD; e += blockDim.x) {
    kmin[page * HD + e] = S(INFINITY);
    kmax[page * HD + e] = S(-INFINITY);
  }
}
__device__ __forceinline__ void atomic_min_b(float* p, float v) {
  if (v >= 0.f) atomicMin(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMax(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
__device__ __forceinline__ void atomic_max_b(float* p, float v) {
  if (v >= 0.f) atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMin(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
// bfloat16: a 16-bit compare-and-swap loop (few contenders: one flush per run of tokens).
template <bool kMin>
__device__ __forceinline__ void atomic_bound_b16(__nv_bfloat16* p, __nv_bfloat16 v) {
  unsigned short* u = reinterpret_cast<unsigned short*>(p);
  const float vf = __bfloat162float(v);
  unsigned short old = *u, assumed;
  do {
    assumed = old;
    const float cur = __bfloat162float(__ushort_as_bfloat16(assumed));
    if (kMin ? !(vf < cur) : !(vf > cur)) return;
    old = atomicCAS(u, assumed, __bfloat16_as_ushort(v));
  } while (old != assumed);
}
__device__ __forceinline__ void atomic_min_b(__nv_bfloat16* p, __nv_bfloat16 v) { atomic_bound_b16<true>(p, v); }
__device__ __forceinline__ void atomic_max_b(__nv_bfloat16* p, __nv_bfloat16 v) { atomic_bound_b16<false>(p, v); }

// Decode (one token per page): the first token of a page writes the page's summary, any other
// token folds into it, so no reset pass is needed. Padding rows all write page 0, whose summary
// no request reads.
template <typename S>
__global__ void quest_decode_update_kernel(QuestUpdateArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  const int n = blockIdx.x;
  const int64_t loc = ld_index(a.out_loc, n, a.loc64), pos = ld_index(a.positions, n, a.pos64);
  const int64_t page = slot_page(loc, a.page_size, a.num_pages);
  const bool first = pos % a.page_size == 0;
  const int HD = a.Hk * a.D;
  for (int e = threadIdx.x * 8; e < HD; e += blockDim.x * 8) {
    float f[8];
    load8_any(a.k, (int64_t)n * HD + e, a.k_dtype, f);
    S* lo = reinterpret_cast<S*>(a.kmin) + page * HD + e;
    S* hi = reinterpret_cast<S*>(a.kmax) + page * HD + e;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const auto l = Bound<S>::lo(f[i]);
      const auto h = Bound<S>::hi(f[i]);
      if (first || float(l) < Bound<S>::get(lo + i)) Bound<S>::put(lo + i, l);
      if (first || float(h) > Bound<S>::get(hi + i)) Bound<S>::put(hi + i, h);
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
template <typename S>
__global__ void quest_fold_kernel(QuestUpdateArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  const int n0 = blockIdx.x * kFoldTokens;
  const int n1 = min(a.N, n0 + kFoldTokens);
  const int HD = a.Hk * a.D;
  S* kmin = reinterpret_cast<S*>(a.kmin);
  S* kmax = reinterpret_cast<S*>(a.kmax);
  auto flush = [&](int64_t pg, int e, const float* lo, const float* hi) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      atomic_min_b(kmin + pg * HD + e + i, Bound<S>::lo(lo[i]));
      atomic_max_b(kmax + pg * HD + e + i, Bound<S>::hi(hi[i]));
    }
  };
  for (int e = threadIdx.x * 8; e < HD; e += blockDim.x * 8) {
    float lo[8], hi[8];
    int64_t cur = -1;
    for (int n = n0; n < n1; ++n) {
      const int64_t page = slot_page(ld_index(a.out_loc, n, a.loc64), a.page_size, a.num_pages);
      float f[8];
      load8_any(a.k, (int64_t)n * HD + e, a.k_dtype, f);
      if (page != cur) {
        if (cur >= 0) flush(cur, e, lo, hi);
        cur = page;
#pragma unroll
        for (int i = 0; i < 8; ++i) { lo[i] = f[i]; hi[i] = f[i]; }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) { lo[i] = fminf(lo[i], f[i]); hi[i] = fmaxf(hi[i], f[i]); }
      }
    }
    if (cur >= 0) flush(cur, e, lo, hi);
  }
}

template <typename S>
cudaError_t quest_update_launch(const QuestUpdateArgs& a, cudaStream_t s) {
  if (a.one_per_page) {
    launch_kernel(quest_decode_update_kernel<S>, a.N, 128, 0, s, a);
    return cudaGetLastError();
  }
  launch_kernel(quest_reset_kernel<S>, a.N, 256, 0, s, a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  launch_kernel(quest_fold_kernel<S>, (a.N + kFoldTokens - 1) / kFoldTokens, 128, 0, s, a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quest_update(const QuestUpdateArgs& a, cudaStream_t s) {
  if ((a.Hk * a.D) % 8 != 0) return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  switch (a.s_dtype) {
    case kF32: return quest_update_launch<float>(a, s);
    case kBF16: return quest_update_launch<__nv_bfloat16>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace prr
