// The online-softmax merge of per-block partials on SM90 (exact: P n A plus the repair; union:
// everything), one CTA per output row.
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

// ============================================================================ merge
// One CTA per output row (request, query head): weights exp(lse - max) of the kept entries in
// shared memory, then float4 columns x entry slices accumulated and reduced across slices.
// Entries of weight 0 (dropped by the exact filter, padding) are never read.
constexpr int kMergeThreads = 128;

__global__ void __launch_bounds__(kMergeThreads)
merge_kernel(MergeArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ float s_dyn[];
  const int Nt = a.N1 + a.N2;
  const int nt4 = (Nt + 3) / 4 * 4;   // keeps s_part 16-byte aligned
  float* s_w = s_dyn;                  // [Nt]
  float* s_part = s_dyn + nt4;         // [kMergeThreads * 4]
  uint32_t* s_amask = reinterpret_cast<uint32_t*>(s_part + kMergeThreads * 4);  // [nb/32 + 1]
  __shared__ float s_red[32];
  const int r = blockIdx.x, tid = threadIdx.x;
  int pc = 0;
  const int32_t* prow = nullptr;
  if (a.p_idx) {
    const int b = r / a.Hq, hk = (r % a.Hq) / (a.Hq / a.Hk);
    if (a.exact) {
      const int W = a.nb / 32 + 1;
      for (int w = tid; w < W; w += kMergeThreads) s_amask[w] = 0;
      __syncthreads();
      const int ca = a.a_cnt[b * a.Hk + hk];
      const int32_t* arow = a.a_idx + ((int64_t)b * a.Hk + hk) * a.Na;
      for (int i = tid; i < a.Na && i < ca; i += kMergeThreads) {
        const int x = arow[i];
        if (x >= 0 && x <= a.nb) atomicOr(&s_amask[x >> 5], 1u << (x & 31));
      }
    }
    pc = a.p_cnt[b * a.Hk + hk];
    prow = a.p_idx + ((int64_t)b * a.Hk + hk) * a.N1;
    __syncthreads();
  }
  float mx = -INFINITY;
  for (int i = tid; i < Nt; i += kMergeThreads) {
    float v;
    if (i < a.N1) {
      v = a.lse1[(int64_t)r * a.N1 + i];
      if (prow) {
        // A repeated id of P counts once (lists are ascending: a repeat is the entry before);
        // exact also keeps only P n A.
        const int x = prow[i];
        const bool valid = i < pc && x >= 0;
        bool keep = !(valid && i > 0 && prow[i - 1] == x);
        if (a.exact) {
          const int xs = x > a.nb ? a.nb : x;
          keep = keep && valid && ((s_amask[xs >> 5] >> (xs & 31)) & 1u);
        }
        if (!keep) v = -INFINITY;
      }
    } else {
      v = a.lse2[(int64_t)r * a.N2 + (i - a.N1)];
    }
    s_w[i] = v;
    mx = fmaxf(mx, v);
  }
  // block max
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((tid & 31) == 0) s_red[tid >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int j = 0; j < kMergeThreads / 32; ++j) mx = fmaxf(mx, s_red[j]);
  const float m_safe = (mx == -INFINITY || mx == INFINITY || mx != mx) ? 0.f : mx;
  __syncthreads();
  float ls = 0.f;
  for (int i = tid; i < Nt; i += kMergeThreads) {
    const float w = expf(s_w[i] - m_safe);
    s_w[i] = w;
    ls += w;
  }
  for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
  if ((tid & 31) == 0) s_red[tid >> 5] = ls;
  __syncthreads();
  ls = 0.f;
  for (int j = 0; j < kMergeThreads / 32; ++j) ls += s_red[j];
  // Weighted sum: thread (float4 column c, entry slice p); slices reduced through shared memory.
  const int D4 = a.D / 4;
  const int P = kMergeThreads / D4;
  const int c = tid % D4, p = tid / D4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p < P) {
    for (int i = p; i < Nt; i += P) {
      const float w = s_w[i];
      if (w == 0.f) continue;
      const float4* src = i < a.N1
          ? reinterpret_cast<const float4*>(a.o1 + ((int64_t)r * a.N1 + i) * a.D)
          : reinterpret_cast<const float4*>(a.o2 + ((int64_t)r * a.N2 + (i - a.N1)) * a.D);
      float4 x = __ldg(src + c);
      x.x = x.x != x.x ? 0.f : x.x; x.y = x.y != x.y ? 0.f : x.y;
      x.z = x.z != x.z ? 0.f : x.z; x.w = x.w != x.w ? 0.f : x.w;
      acc.x = fmaf(w, x.x, acc.x); acc.y = fmaf(w, x.y, acc.y);
      acc.z = fmaf(w, x.z, acc.z); acc.w = fmaf(w, x.w, acc.w);
    }
    reinterpret_cast<float4*>(s_part)[tid] = acc;
  }
  __syncthreads();
  if (p == 0) {
    float4 t = acc;
    for (int j = 1; j < P; ++j) {
      const float4 y = reinterpret_cast<float4*>(s_part)[j * D4 + c];
      t.x += y.x; t.y += y.y; t.z += y.z; t.w += y.w;
    }
    const float inv = 1.f / fmaxf(ls, 1e-30f);
    t.x *= inv; t.y *= inv; t.z *= inv; t.w *= inv;
    reinterpret_cast<float4*>(a.o + (int64_t)r * a.D)[c] = t;
  }
  if (tid == 0) a.lse[r] = m_safe + logf(ls);
}

}  // namespace

cudaError_t launch_merge(const MergeArgs& a, cudaStream_t s) {
  if (a.D % 4 != 0 || a.D / 4 > kMergeThreads) return cudaErrorInvalidValue;
  if (a.R == 0) return cudaSuccess;
  const int Nt = a.N1 + a.N2;
  const size_t smem = ((size_t)(Nt + 3) / 4 * 4 + kMergeThreads * 4 + (a.p_idx ? a.nb / 32 + 1 : 0)) * 4;
  cudaError_t e = set_smem_limit(merge_kernel, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(merge_kernel, a.R, kMergeThreads, smem, s, a);
  return cudaGetLastError();
}

}  // namespace prr
