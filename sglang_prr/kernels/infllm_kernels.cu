// InfLLM-v2 kernels for SM90 (H100/H200): the compressed-key update and the block scores.
// Semantics are those of sglang_prr/reference/infllm_v2.py (infllm_update, infllm_scores). Both
// ops are memory-bound (the scores read every complete compressed key of a request once, float32
// or bfloat16); the bf16 logits run on tensor cores (infllm_logits.cuh).
// Graph-safe: static launch shapes, device-side counts (seq_lens, positions), no host reads.
// Tuning switches (host-side; timing comparisons and tests): SGLANG_PRR_INFLLM_VARIANT=regs / bulk
// / mma (the logits variant, read at each launch), SGLANG_PRR_INFLLM_STAGE_KB (bulk ring size),
// SGLANG_PRR_INFLLM_STAGE=logits (skip the pool pass: the scores are then not computed);
// SGLANG_PRR_INFLLM_RING=ids-first (the bulk ring's page ids in one round trip) and
// SGLANG_PRR_INFLLM_POOL=loads-first (the pool's loads in one round trip), read at each launch.
// Measurements and versions: benchmarks/NOTES-kernels.md ("InfLLM-v2").
#include "infllm_kernels.h"
#include "common.cuh"
#include "infllm_logits.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace prr {
namespace {

// Raw8 / ld_raw8 (common.cuh): several rows in flight before any is converted.
__device__ __forceinline__ void add8(const Raw8<float>& x, float* f) {
  const float* p = reinterpret_cast<const float*>(x.r);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] += p[i];
}
__device__ __forceinline__ void add8(const Raw8<__half>& x, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(x.r);
#pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 v = __half22float2(h[i]); f[2 * i] += v.x; f[2 * i + 1] += v.y; }
}
__device__ __forceinline__ void add8(const Raw8<__nv_bfloat16>& x, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(x.r);
#pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 v = __bfloat1622float2(h[i]); f[2 * i] += v.x; f[2 * i + 1] += v.y; }
}

// 8 floats stored as CK (16-byte aligned for bf16, 32 for float).
__device__ __forceinline__ void st8_ck(float* p, const float* v) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void st8_ck(__nv_bfloat16* p, const float* v) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// ============================================================================ update
// One CTA per new token. A token at position pos completes compressed key i = (pos - 31) / 16
// when (pos + 1) % 16 == 0 and pos >= 31; the CTA then averages the 32 window keys (slots from
// req_to_token) in fp32, in window order as the reference does, and writes them to ck[page of
// pos, j] as CK. Other tokens exit at once (the reference sends their write to the padding page;
// nothing is written here).
constexpr int kUpdThreads = 128;

template <typename T, typename CK>
__global__ void __launch_bounds__(kUpdThreads) infllm_update_kernel(InfllmUpdateArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  __shared__ int64_t s_slot[kInfllmWindow];
  const int n = blockIdx.x;
  const int64_t pos = ld_index(a.positions, n, a.pos64);
  if (pos < kInfllmWindow - 1 || (pos + 1) % kInfllmStride != 0) return;
  if (threadIdx.x < kInfllmWindow) {
    const int64_t r = in_pool(ld_index(a.req_idx, n, a.req64), a.rtt_rows);
    const int64_t col = in_pool(pos - (kInfllmWindow - 1) + threadIdx.x, a.rtt_cols);
    s_slot[threadIdx.x] =
        in_pool(ld_index(a.req_to_token, r * a.rtt_stride + col, a.rtt64), a.num_slots);
  }
  __syncthreads();
  const int pp = a.page_size / kInfllmStride;
  const int64_t i = (pos - (kInfllmWindow - 1)) / kInfllmStride;
  const int64_t j = i + 1 - (pos / a.page_size) * pp;
  const int64_t page = slot_page(ld_index(a.out_loc, n, a.loc64), a.page_size, a.num_pages);
  CK* dst = static_cast<CK*>(a.ck) + (page * pp + j) * a.Hk * a.D;
  const T* kb = reinterpret_cast<const T*>(a.k);
  const int hd8 = a.Hk * a.D / 8;
  constexpr int U = 8;  // window rows loaded before use
  for (int c = threadIdx.x; c < hd8; c += kUpdThreads) {
    const int h = (c * 8) / a.D, d0 = (c * 8) % a.D;
    const T* src = kb + h * a.k_stride_head + d0;
    float acc[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[t] = 0.f;
#pragma unroll
    for (int w0 = 0; w0 < kInfllmWindow; w0 += U) {
      Raw8<T> v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = ld_raw8<T>(src + s_slot[w0 + u] * a.k_stride_slot);
#pragma unroll
      for (int u = 0; u < U; ++u) add8(v[u], acc);
    }
    constexpr float inv = 1.f / kInfllmWindow;  // a power of two: the mean is exact
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[t] *= inv;
    st8_ck(dst + h * a.D + d0, acc);
  }
}

// The pool's loads issued first (SGLANG_PRR_INFLLM_POOL=loads-first): kPoolEnt entries a
// thread (every head of the group) and kPoolStat chunk statistics a lane in registers.
constexpr int kPoolEnt = 2;
constexpr int kPoolStat = 8;
static_assert(kInfllmMaxGroup <= kPoolThreads / 32, "a warp a head of the group");

// A head's (max, sum of exp2(x - max)) over its NC chunk statistics `st`, by one warp: lane-strided
// in ascending chunk order (the first kPoolStat of a lane from `pre` where has_pre: loaded
// already), then a fixed xor tree; the same order either way, so the same bits.
__device__ __forceinline__ float2 head_stats(const float2* st, int NC, int lane,
                                             const float2* pre, bool has_pre) {
  const int k0 = has_pre ? lane + 32 * kPoolStat : lane;
  // f(v) for the lane's statistics in ascending chunk order
  const auto each = [&](auto f) {
    if (has_pre) {
#pragma unroll
      for (int j = 0; j < kPoolStat; ++j)
        if (lane + 32 * j < NC) f(pre[j]);
    }
    for (int k = k0; k < NC; k += 32) f(st[k]);
  };
  float m = -INFINITY;
  each([&](float2 v) { m = fmaxf(m, v.x); });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float l = 0.f;
  each([&](float2 v) { if (v.x != -INFINITY) l += v.y * exp2f(v.x - m); });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  return make_float2(m, l);
}

// Entry e's softmax probability summed over the group's G heads in head order (logit(g): head
// g's logit), -inf outside [lo, hi]; kRegs: the loop unrolled (logit reads registers).
template <bool kRegs, typename F>
__device__ __forceinline__ float pooled_prob(int64_t e, int64_t lo, int64_t hi, int G,
                                             const float* s_M, const float* s_iL, F logit) {
  if (e < lo || e > hi) return -INFINITY;
  float p = 0.f;
  const auto add = [&](int g) {
    if (s_iL[g] != 0.f) p += exp2f(logit(g) - s_M[g]) * s_iL[g];
  };
  if constexpr (kRegs) {
#pragma unroll
    for (int g = 0; g < kInfllmMaxGroup; ++g)
      if (g < G) add(g);
  } else {
    for (int g = 0; g < G; ++g) add(g);
  }
  return p;
}

// kLoadsFirst: the request's length, the group's chunk statistics and the CTA's logits are
// loaded together (one round trip) where they fit the registers (kPoolEnt, kPoolStat), instead of
// the length, then the statistics, then the logits after the barrier (three round trips). A
// template argument, so that the default form keeps its registers.
template <bool kLoadsFirst>
__global__ void __launch_bounds__(kPoolThreads)
infllm_pool_kernel(InfllmScoresArgs a, int bpc, int NC) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ float s_p[];  // bpc * pp + 1 entries
  __shared__ float s_M[kInfllmMaxGroup], s_iL[kInfllmMaxGroup];
  const int cb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int G = a.Hq / a.Hk;
  const int pp = a.page_size / kInfllmStride;
  const int64_t E = (int64_t)a.NB * pp;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int tid = threadIdx.x;
  const int64_t n0 = (int64_t)cb * bpc;
  const int64_t n1 = n0 + bpc < a.NB ? n0 + bpc : a.NB;
  float* out = a.out + row * a.NB;
  const float2* stats = reinterpret_cast<const float2*>(a.stats);
  const int warp = tid / 32, lane = tid % 32;
  const int ne = (int)((n1 - n0) * pp + 1);
  const bool early = kLoadsFirst && ne <= kPoolEnt * kPoolThreads;  // uniform over the CTA
  const RawIndex sl_raw = ld_index_raw(a.seq_lens, b, a.seq64);
  float xv[kPoolEnt][kInfllmMaxGroup];  // early: head g's logit of entry tid + u kPoolThreads
  float2 sv[kPoolStat];                 // early: this lane's first statistics of head `warp`
  if (early) {
#pragma unroll
    for (int u = 0; u < kPoolEnt; ++u) {
      const int t = tid + u * kPoolThreads;
      const int64_t e = n0 * pp + t;
#pragma unroll
      for (int g = 0; g < kInfllmMaxGroup; ++g)
        xv[u][g] = (t < ne && e < E && g < G) ? a.logits[(row * G + g) * E + e] : 0.f;
    }
    const float2* st = stats + (row * G + warp) * NC;
#pragma unroll
    for (int j = 0; j < kPoolStat; ++j)
      sv[j] = (warp < G && lane + 32 * j < NC) ? st[lane + 32 * j] : make_float2(-INFINITY, 0.f);
  }
  const int64_t last = last_entry(index_of(sl_raw, a.seq64), E);
  const int64_t lo = n0 * pp > 1 ? n0 * pp : 1;
  const int64_t hi = n1 * pp < last ? n1 * pp : last;  // inclusive
  if (lo > hi) {
    for (int64_t n = n0 + tid; n < n1; n += kPoolThreads) out[n] = -INFINITY;
    return;
  }
  for (int g = warp; g < G; g += kPoolThreads / 32) {  // (G <= the warps: one head a warp)
    const float2 ml = head_stats(stats + (row * G + g) * NC, NC, lane, sv, early);
    const float l = ml.y;
    // 1/l, or 0 for a head dropped from the group: a non-finite logit (l NaN) or no finite one
    // (l 0: every valid logit -inf), whose softmax row the reference turns into zeros.
    if (lane == 0) { s_M[g] = ml.x; s_iL[g] = l > 0.f && l < INFINITY ? 1.f / l : 0.f; }
  }
  __syncthreads();
  if (early) {
#pragma unroll
    for (int u = 0; u < kPoolEnt; ++u) {
      const int t = tid + u * kPoolThreads;
      if (t < ne)
        s_p[t] = pooled_prob<true>(n0 * pp + t, lo, hi, G, s_M, s_iL,
                                   [&](int g) { return xv[u][g]; });
    }
  } else {
    for (int t = tid; t < ne; t += kPoolThreads) {
      const int64_t e = n0 * pp + t;
      s_p[t] = pooled_prob<false>(e, lo, hi, G, s_M, s_iL,
                                  [&](int g) { return a.logits[(row * G + g) * E + e]; });
    }
  }
  __syncthreads();
  for (int64_t n = n0 + tid; n < n1; n += kPoolThreads) {
    const int base = (int)((n - n0) * pp);
    float v = -INFINITY;
    for (int j = 0; j < pp; ++j) v = fmaxf(v, s_p[base + j]);
    if (n + 1 < a.NB) v = fmaxf(v, s_p[base + pp]);
    out[n] = v;
  }
}

// Heads per CTA of the logits pass: the largest power of two dividing Hk with hc*L <= threads
// and hc*GMAX <= kMaxQRows.
int heads_per_cta(int Hk, int D, int gmax) {
  int hc = 1;
  while (Hk % (2 * hc) == 0 && 2 * hc * (D / 8) <= kScoreThreads && 2 * hc * gmax <= kMaxQRows)
    hc *= 2;
  return hc;
}
int group_max(int G) { return G == 1 ? 1 : G == 2 ? 2 : G <= 4 ? 4 : 8; }
int chunk_len(int B, int Hk, int64_t E, int hc) {
  int chunk = kChunkMax;
  while (chunk > kChunkMin && (E + chunk - 1) / chunk * (Hk / hc) * (int64_t)B < kTargetCtas)
    chunk /= 2;
  return chunk;
}

// The logits variant: 0 picks by shape and dtype; SGLANG_PRR_INFLLM_VARIANT=regs (1), bulk (2)
// or mma (3) forces one where it applies (timing comparisons and tests; read at each launch, a
// captured graph keeps the kernel it was captured with).
int variant_override() {
  const char* e = std::getenv("SGLANG_PRR_INFLLM_VARIANT");
  if (e == nullptr) return 0;
  if (std::strcmp(e, "regs") == 0) return 1;
  if (std::strcmp(e, "bulk") == 0) return 2;
  if (std::strcmp(e, "mma") == 0) return 3;
  return 0;
}

// The bulk variant's page ids first (SGLANG_PRR_INFLLM_RING=ids-first), else thread 0's lookups
// (the default until measured). A measuring knob read at each launch (a captured graph keeps it).
bool ring_ids_first() {
  const char* e = std::getenv("SGLANG_PRR_INFLLM_RING");
  return e != nullptr && std::strcmp(e, "ids-first") == 0;
}

// The pool's loads in one round trip (SGLANG_PRR_INFLLM_POOL=loads-first), else three (the
// default until measured). A measuring knob read at each launch (a captured graph keeps it).
bool pool_loads_first() {
  const char* e = std::getenv("SGLANG_PRR_INFLLM_POOL");
  return e != nullptr && std::strcmp(e, "loads-first") == 0;
}

// Bytes of the bulk variant's stage ring (SGLANG_PRR_INFLLM_STAGE_KB, for tuning).
size_t stage_bytes() {
  static const size_t v = [] {
    const char* e = std::getenv("SGLANG_PRR_INFLLM_STAGE_KB");
    const long kb = e != nullptr ? std::strtol(e, nullptr, 10) : 0;
    return (kb > 0 && kb * 1024 <= kStageBytesMax) ? (size_t)kb * 1024 : (size_t)kStageBytes;
  }();
  return v;
}

template <typename CK, int D, int GMAX>
cudaError_t launch_logits(const InfllmScoresArgs& a, int NC, int hc, int chunk, cudaStream_t s) {
  const int pp = a.page_size / kInfllmStride;
  const size_t page_bytes = (size_t)pp * a.Hk * D * sizeof(CK);
  const size_t ring = stage_bytes();
  const int variant = variant_override();
  if constexpr (std::is_same_v<CK, __nv_bfloat16>) {
    // bf16 keys and 16-bit q: the tensor-core variant, unless a CUDA-core one is forced.
    if (a.q_dtype != kInfF32 && (variant == 0 || variant == 3)) {
      const size_t smem = (kChunkMax + 1) * sizeof(int64_t) + (size_t)hc * GMAX * chunk * sizeof(float);
      launch_kernel(infllm_logits_mma_kernel<D, GMAX>, dim3(NC, a.Hk / hc, a.B), kScoreThreads, smem,
                    s, a, hc, chunk);
      return cudaGetLastError();
    }
  }
  if (hc == a.Hk && chunk % pp == 0 && 2 * page_bytes <= ring && variant != 1) {
    int S = (int)(ring / page_bytes);
    if (S > kMaxStages) S = kMaxStages;
    if (S > chunk / pp) S = chunk / pp;
    if (S < 2) S = 2;
    const size_t smem = kMaxStages * 8 + (size_t)S * page_bytes +
                        (size_t)a.Hk * GMAX * chunk * sizeof(float) +
                        (size_t)(chunk / pp) * sizeof(int64_t);  // the page ids (ids-first)
    auto kern = infllm_logits_bulk_kernel<CK, D, GMAX>;
    static bool attr_set = false;  // host-side, once per instantiation
    if (!attr_set) {
      cudaError_t e = cudaFuncSetAttribute(
          kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
          kMaxStages * 8 + kStageBytesMax + kMaxQRows * kChunkMax * 4 + kChunkMax * 8);
      if (e != cudaSuccess) return e;
      attr_set = true;
    }
    launch_kernel(kern, dim3(NC, 1, a.B), kScoreThreads, smem, s, a, chunk, S, ring_ids_first());
    return cudaGetLastError();
  }
  const size_t smem = (kChunkMax + 1) * sizeof(int64_t) + (size_t)hc * GMAX * kChunkMax * sizeof(float);
  auto kern = infllm_logits_kernel<CK, D, GMAX, 4>;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  launch_kernel(kern, dim3(NC, a.Hk / hc, a.B), kScoreThreads, smem, s, a, hc, chunk);
  return cudaGetLastError();
}
template <typename CK, int D>
cudaError_t launch_logits_g(const InfllmScoresArgs& a, int NC, int hc, int chunk, cudaStream_t s) {
  switch (group_max(a.Hq / a.Hk)) {
    case 1: return launch_logits<CK, D, 1>(a, NC, hc, chunk, s);
    case 2: return launch_logits<CK, D, 2>(a, NC, hc, chunk, s);
    case 4: return launch_logits<CK, D, 4>(a, NC, hc, chunk, s);
    default: return launch_logits<CK, D, 8>(a, NC, hc, chunk, s);
  }
}
template <typename CK>
cudaError_t launch_logits_d(const InfllmScoresArgs& a, int NC, int hc, int chunk, cudaStream_t s) {
  switch (a.D) {
    case 64: return launch_logits_g<CK, 64>(a, NC, hc, chunk, s);
    case 128: return launch_logits_g<CK, 128>(a, NC, hc, chunk, s);
    default: return launch_logits_g<CK, 256>(a, NC, hc, chunk, s);
  }
}

template <typename CK>
cudaError_t launch_update(const InfllmUpdateArgs& a, cudaStream_t s) {
  switch (a.k_dtype) {
    case kInfF32: launch_kernel(infllm_update_kernel<float, CK>, a.N, kUpdThreads, 0, s, a); break;
    case kInfF16: launch_kernel(infllm_update_kernel<__half, CK>, a.N, kUpdThreads, 0, s, a); break;
    case kInfBF16:
      launch_kernel(infllm_update_kernel<__nv_bfloat16, CK>, a.N, kUpdThreads, 0, s, a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int pool_blocks_per_cta(int pp) { return pp >= kPoolThreads ? 1 : kPoolThreads / pp; }

}  // namespace

// ============================================================================ launchers
cudaError_t launch_infllm_update(const InfllmUpdateArgs& a, cudaStream_t s) {
  if (a.page_size < kInfllmStride || a.page_size % kInfllmStride != 0 || a.D % 8 != 0)
    return cudaErrorInvalidValue;
  if (a.ck_dtype != kInfF32 && a.ck_dtype != kInfBF16) return cudaErrorInvalidValue;
  if (a.N == 0 || a.Hk == 0) return cudaSuccess;
  return a.ck_dtype == kInfBF16 ? launch_update<__nv_bfloat16>(a, s) : launch_update<float>(a, s);
}

int infllm_num_chunks(int B, int Hq, int Hk, int NB, int D, int page_size) {
  if (Hk <= 0 || page_size < kInfllmStride || D < 8) return 1;
  const int64_t E = (int64_t)NB * (page_size / kInfllmStride);
  const int chunk = chunk_len(B, Hk, E, heads_per_cta(Hk, D, group_max(Hq / Hk)));
  const int64_t nc = (E + chunk - 1) / chunk;
  return nc > 0 ? (int)nc : 1;
}

cudaError_t launch_infllm_scores(const InfllmScoresArgs& a, cudaStream_t s) {
  if (a.Hk <= 0 || a.Hq % a.Hk != 0 || a.Hq / a.Hk > kInfllmMaxGroup) return cudaErrorInvalidValue;
  if (a.page_size < kInfllmStride || a.page_size % kInfllmStride != 0) return cudaErrorInvalidValue;
  if (a.D != 64 && a.D != 128 && a.D != 256) return cudaErrorInvalidValue;
  if (a.ck_dtype != kInfF32 && a.ck_dtype != kInfBF16) return cudaErrorInvalidValue;
  if (a.B == 0 || a.NB == 0) return cudaSuccess;
  const int pp = a.page_size / kInfllmStride;
  const int64_t E = (int64_t)a.NB * pp;
  const int hc = heads_per_cta(a.Hk, a.D, group_max(a.Hq / a.Hk));
  const int chunk = chunk_len(a.B, a.Hk, E, hc);
  const int NC = (int)((E + chunk - 1) / chunk);
  if (NC != a.num_chunks) return cudaErrorInvalidValue;  // workspace sized by infllm_num_chunks
  cudaError_t e = a.ck_dtype == kInfBF16
                      ? launch_logits_d<__nv_bfloat16>(a, NC, hc, chunk, s)
                      : launch_logits_d<float>(a, NC, hc, chunk, s);
  if (e != cudaSuccess) return e;
  static const bool logits_only = [] {  // timing breakdown only (host-side, read once)
    const char* v = std::getenv("SGLANG_PRR_INFLLM_STAGE");
    return v != nullptr && std::strcmp(v, "logits") == 0;
  }();
  if (logits_only) return cudaSuccess;
  const int bpc = pool_blocks_per_cta(pp);
  const size_t smem = ((size_t)bpc * pp + 1) * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;  // pages of more than 196K tokens
  const dim3 grid2((a.NB + bpc - 1) / bpc, a.Hk, a.B);
  if (pool_loads_first())
    launch_kernel(infllm_pool_kernel<true>, grid2, kPoolThreads, smem, s, a, bpc, NC);
  else
    launch_kernel(infllm_pool_kernel<false>, grid2, kPoolThreads, smem, s, a, bpc, NC);
  return cudaGetLastError();
}

}  // namespace prr
