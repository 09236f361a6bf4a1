// InfLLM-v2 kernels for SM90 (H100/H200): the compressed-key update and the block scores.
// Semantics are those of sglang_prr/reference.py (infllm_update, infllm_scores). Plain CUDA: both
// ops are memory-bound (the scores read every complete compressed key of a request once, float32
// or bfloat16).
// Graph-safe: static launch shapes, device-side counts (seq_lens, positions), no host reads.
// Tuning switches (host-side, read once; timing comparisons only): SGLANG_PRR_INFLLM_VARIANT=regs
// (register-load logits pass everywhere), SGLANG_PRR_INFLLM_STAGE_KB (bulk ring size),
// SGLANG_PRR_INFLLM_STAGE=logits (skip the pool pass: the scores are then not computed);
// SGLANG_PRR_INFLLM_RING=ids-first (the bulk ring's page ids in one round trip) and
// SGLANG_PRR_INFLLM_POOL=loads-first (the pool's loads in one round trip), read at each launch.
// Measurements and versions: benchmarks/NOTES-kernels.md ("InfLLM-v2").
#include "infllm_kernels.h"
#include "common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cmath>
#include <cstdlib>
#include <cstring>

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

// The compressed keys' element type CK: float32, or bfloat16 rounded to nearest from the float32
// mean (half the bytes for the scores to stream). A row's 8 elements load as Raw8<CK> (several
// rows in flight before any is converted), then widen to two float4.
__device__ __forceinline__ void raw8_get(const Raw8<float>& x, float4& a, float4& b) {
  a = reinterpret_cast<const float4*>(x.r)[0];
  b = reinterpret_cast<const float4*>(x.r)[1];
}
__device__ __forceinline__ void raw8_get(const Raw8<__nv_bfloat16>& x, float4& a, float4& b) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(x.r);
  const float2 p0 = __bfloat1622float2(h[0]), p1 = __bfloat1622float2(h[1]);
  const float2 p2 = __bfloat1622float2(h[2]), p3 = __bfloat1622float2(h[3]);
  a = make_float4(p0.x, p0.y, p1.x, p1.y);
  b = make_float4(p2.x, p2.y, p3.x, p3.y);
}
// q . k over 8 dims (q pre-scaled), the FMA chain in dim order of both logits kernels.
__device__ __forceinline__ float dot8(const float* q, float4 k0, float4 k1) {
  float s = q[0] * k0.x;
  s = fmaf(q[1], k0.y, s);
  s = fmaf(q[2], k0.z, s);
  s = fmaf(q[3], k0.w, s);
  s = fmaf(q[4], k1.x, s);
  s = fmaf(q[5], k1.y, s);
  s = fmaf(q[6], k1.z, s);
  s = fmaf(q[7], k1.w, s);
  return s;
}
// 4 elements of a compressed-key row in shared memory, as floats.
__device__ __forceinline__ float4 ld4_ck(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 ld4_ck(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  return make_float4(a.x, a.y, b.x, b.y);
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

// Complete compressed keys of a request of `sl` tokens: ((sl - 32) // 16 + 1) clamped at 0.
__device__ __forceinline__ int64_t complete_keys(int64_t sl) {
  return sl >= kInfllmWindow ? (sl - kInfllmWindow) / kInfllmStride + 1 : 0;
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

// ============================================================================ scores
// Pass 1 (logits): one CTA per (chunk of entries, group of hc KV heads, request). Entry e of a
// request is slot e % pp of its block e / pp and holds compressed key e - 1; entries 1..n_ck are
// valid. The hc heads of an entry are hc*D contiguous fp32 (all 8 heads of a Llama-3-8B layer:
// 4 KB), read by hc*L lanes, L = D/8 per head (two float4 each), so DRAM sees long contiguous
// runs. Each head row is dotted with its GQA group's q (registers, pre-scaled into the log2
// domain); the G partial sums are reduced across the L lanes by recursive halving (G - 1 +
// log2(L/G) shuffles instead of G log2 L). The chunk's logits go to shared memory, then to the
// workspace, with the chunk's (max, sum of exp2) per query head. The chunk length (32..128
// entries) is picked from the shapes so that the grid fills the GPU at batch 1.
// Pass 2 (pool): one CTA per (range of blocks, KV head, request) combines the row's chunk
// statistics, turns its entries' logits into softmax probabilities summed over the group and
// max-pools them to blocks (a block takes its own entries and the first entry of the next block,
// whose key starts in it).
constexpr int kScoreThreads = 256;
constexpr int kChunkMax = 128;
constexpr int kChunkMin = 32;
constexpr int kMaxQRows = 64;        // hc * GMAX rows of logits kept in shared memory
constexpr int kTargetCtas = 4 * 132; // grid size the chunk length aims for (H100/H200: 132 SMs)
constexpr int kPoolThreads = 256;

// A chunk's (max, sum of exp2(x - max)) over the logits xs[0..n) of one query head, by one warp.
// A NaN or +inf logit makes the head's softmax undefined: the chunk is then marked (+inf, NaN),
// which every later combination keeps, and the pool drops the head from its group's sum (the
// reference's nan_to_num of the head's NaN softmax row). fmaxf alone would skip a NaN, and a
// chunk of NaN only would read as one with no valid entry.
__device__ __forceinline__ float2 chunk_stats(const float* xs, int n, int lane) {
  float m = -INFINITY;
  bool bad = false;
  for (int k = lane; k < n; k += 32) {
    const float x = xs[k];
    bad |= x != x || x == INFINITY;
    m = fmaxf(m, x);
  }
  if (__any_sync(0xffffffffu, bad)) return make_float2(INFINITY, NAN);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float l = 0.f;
  if (m != -INFINITY)
    for (int k = lane; k < n; k += 32) l += exp2f(xs[k] - m);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  return make_float2(m, l);
}

template <typename CK, int D, int GMAX, int UNROLL>
__global__ void __launch_bounds__(kScoreThreads)
infllm_logits_kernel(InfllmScoresArgs a, int hc, int chunk) {
  pdl_begin();  // before any global-memory access (PDL)
  constexpr int L = D / 8;                 // lanes per head row
  constexpr int SPLIT = L / GMAX;          // lanes per query head after the reduce-scatter
  static_assert(L >= GMAX && L <= 32, "lanes per head row");
  extern __shared__ int64_t s_dyn[];
  int64_t* s_page = s_dyn;                                   // [kChunkMax + 1]
  float* s_x = reinterpret_cast<float*>(s_dyn + kChunkMax + 1);  // [hc * GMAX][kChunkMax]

  const int c = blockIdx.x, hk0 = blockIdx.y * hc, b = blockIdx.z;
  const int NC = gridDim.x;
  const int G = a.Hq / a.Hk;
  const int pp = a.page_size / kInfllmStride;
  const int64_t E = (int64_t)a.NB * pp;
  const int64_t qrow0 = (int64_t)b * a.Hq + (int64_t)hk0 * G;  // first query head of the CTA
  const int tid = threadIdx.x;
  float2* stats = reinterpret_cast<float2*>(a.stats);
  const int lanes = L * hc;                 // lanes per entry
  const int epp = kScoreThreads / lanes;    // entries per pass
  const int ent = tid / lanes, hh = (tid % lanes) / L, lane_t = tid % L, d0 = lane_t * 8;
  const int hk = hk0 + hh;
  // q and the request's length in one round trip (q's heads past G load head G - 1, unused).
  Raw8Any qr[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
    qr[g] = ld8_raw(a.q, ((int64_t)b * a.Hq + (int64_t)hk * G + (g < G ? g : G - 1)) * D + d0,
                    a.q_dtype);

  int64_t nvalid = complete_keys(ld_index(a.seq_lens, b, a.seq64));
  if (nvalid > E - 1) nvalid = E - 1;
  const int64_t e0 = (int64_t)c * chunk;
  const int64_t e_end = e0 + chunk < nvalid + 1 ? e0 + chunk : nvalid + 1;  // exclusive
  if (e_end <= (e0 > 1 ? e0 : 1)) {  // no valid entry in this chunk
    for (int t = tid; t < hc * G; t += kScoreThreads)
      stats[(qrow0 + t) * NC + c] = make_float2(-INFINITY, 0.f);
    return;
  }
  const int64_t pg0 = e0 / pp;
  const int npg = (int)((e_end - 1) / pp - pg0 + 1);
  for (int t = tid; t < npg; t += kScoreThreads)
    s_page[t] = in_pool(ld_index(a.table, (int64_t)b * a.table_stride + pg0 + t, a.table64),
                        a.num_pages);

  float qf[GMAX][8];
  const float qs = a.sm_scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    raw8_floats(qr[g], a.q_dtype, qf[g]);
#pragma unroll
    for (int t = 0; t < 8; ++t) qf[g][t] = g < G ? qf[g][t] * qs : 0.f;
  }
  __syncthreads();

  const int64_t entry_stride = (int64_t)a.Hk * D, page_stride = (int64_t)pp * entry_stride;
  const CK* ckb = static_cast<const CK*>(a.ck) + (int64_t)hk * D + d0;
  for (int64_t base = e0; base < e_end; base += (int64_t)epp * UNROLL) {
    Raw8<CK> kr[UNROLL];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t e = base + (int64_t)u * epp + ent;
      ok[u] = e >= 1 && e < e_end;
      if (ok[u]) {
        kr[u] = ld_raw8<CK>(ckb + s_page[e / pp - pg0] * page_stride + (e % pp) * entry_stride);
      } else {
        kr[u] = Raw8<CK>{};  // +0.0 in every element
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float4 k0, k1;
      raw8_get(kr[u], k0, k1);
      float x[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) x[g] = dot8(qf[g], k0, k1);
      // Reduce-scatter: after the step at lane offset o the lane keeps half of its sums (the
      // upper half when its o bit is set) plus its partner's matching half.
#pragma unroll
      for (int h = GMAX / 2, o = L / 2; h >= 1; h >>= 1, o >>= 1) {
        const bool hi = (lane_t & o) != 0;
#pragma unroll
        for (int t = 0; t < h; ++t) {
          const float send = hi ? x[t] : x[t + h];
          const float keep = hi ? x[t + h] : x[t];
          x[t] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
      }
#pragma unroll
      for (int o = SPLIT / 2; o > 0; o >>= 1) x[0] += __shfl_xor_sync(0xffffffffu, x[0], o);
      const int64_t e = base + (int64_t)u * epp + ent;
      const int g = lane_t / SPLIT;
      if (lane_t % SPLIT == 0 && g < G && e < e_end)
        s_x[(hh * GMAX + g) * kChunkMax + (e - e0)] = ok[u] ? x[0] : -INFINITY;
    }
  }
  __syncthreads();

  const int n = (int)(e_end - e0);
  const int rows = hc * G;
  for (int t = tid; t < rows * n; t += kScoreThreads) {
    const int r = t / n, k = t % n;
    a.logits[(qrow0 + r) * E + e0 + k] = s_x[((r / G) * GMAX + r % G) * kChunkMax + k];
  }
  const int warp = tid / 32, lane = tid % 32;
  for (int r = warp; r < rows; r += kScoreThreads / 32) {
    const float* xs = s_x + ((r / G) * GMAX + r % G) * kChunkMax;
    const float2 ml = chunk_stats(xs, n, lane);
    if (lane == 0) stats[(qrow0 + r) * NC + c] = ml;
  }
}

// Logits pass, "bulk" variant (used when one CTA covers every KV head and a chunk is whole
// pages): a page's compressed keys [pp, Hk, D] are one contiguous run (16 KB at block 64 for a
// Llama-3-8B layer), fetched by the bulk-copy engine (cp.async.bulk, completing on an mbarrier)
// into a ring of S shared-memory stages that one thread keeps full, so each CTA keeps up to
// S pages in flight with no registers tied up in loads. Lanes read their 2 x float4 from shared
// memory at d = 4*lane and D/2 + 4*lane (consecutive 16-byte words: no bank conflicts).
constexpr int kStageBytes = 64 * 1024;       // shared-memory ring per CTA (default)
constexpr int kStageBytesMax = 128 * 1024;   // SGLANG_PRR_INFLLM_STAGE_KB may raise it to this
constexpr int kMaxStages = 16;

template <typename CK, int D, int GMAX>
__global__ void __launch_bounds__(kScoreThreads)
infllm_logits_bulk_kernel(InfllmScoresArgs a, int chunk, int S, bool ids_first) {
  pdl_begin();  // before any global-memory access (PDL)
  constexpr int L = D / 8;
  constexpr int SPLIT = L / GMAX;
  static_assert(L >= GMAX && L <= 32, "lanes per head row");
  extern __shared__ __align__(128) unsigned char s_raw[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(s_raw);             // [kMaxStages]
  CK* stage = reinterpret_cast<CK*>(s_raw + kMaxStages * 8);        // [S][pp * Hk * D]
  const int pp = a.page_size / kInfllmStride;
  const int64_t pf = (int64_t)pp * a.Hk * D;                        // elements per page
  float* s_x = reinterpret_cast<float*>(stage + (int64_t)S * pf);   // [Hk * GMAX][chunk]
  int64_t* s_pid = reinterpret_cast<int64_t*>(s_x + (int64_t)a.Hk * GMAX * chunk);  // [chunk/pp]
  const CK* ck = static_cast<const CK*>(a.ck);

  const int c = blockIdx.x, b = blockIdx.z;
  const int NC = gridDim.x;
  const int G = a.Hq / a.Hk;
  const int64_t E = (int64_t)a.NB * pp;
  const int64_t qrow0 = (int64_t)b * a.Hq;
  const int tid = threadIdx.x;
  float2* stats = reinterpret_cast<float2*>(a.stats);
  const int64_t e0 = (int64_t)c * chunk;  // a page boundary (chunk % pp == 0)
  const int64_t pg0 = e0 / pp;
  const int64_t trow = (int64_t)b * a.table_stride + pg0;
  // ids_first: the chunk's page ids are loaded by one thread each beside the request's length
  // (one round trip, whatever the length), so that the ring's copies go out at once, each from
  // its own thread, and a refill needs no lookup. Else thread 0 looks each page up before its
  // copy: a copy's asm orders memory, so its next lookup waits for it, and the S lookups of the
  // fill are S round trips one after another (a measuring knob's old form).
  RawIndex pid_raw{};
  if (ids_first && tid < chunk / pp && pg0 + tid < a.NB)
    pid_raw = ld_index_raw(a.table, trow + tid, a.table64);
  // q in the same round trip (q's heads past G load head G - 1, unused).
  const int lanes = L * a.Hk;               // lanes per entry (all heads)
  const int epp = kScoreThreads / lanes;    // entries per pass
  const int ent = tid / lanes, hh = (tid % lanes) / L, lane_t = tid % L;
  const int da = lane_t * 4, db = D / 2 + lane_t * 4;
  uint4 qr[GMAX][2];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    const int64_t qo = ((int64_t)b * a.Hq + (int64_t)hh * G + (g < G ? g : G - 1)) * D;
    qr[g][0] = ld4_raw(a.q, qo + da, a.q_dtype);
    qr[g][1] = ld4_raw(a.q, qo + db, a.q_dtype);
  }

  int64_t nvalid = complete_keys(ld_index(a.seq_lens, b, a.seq64));
  if (nvalid > E - 1) nvalid = E - 1;
  const int64_t e_end = e0 + chunk < nvalid + 1 ? e0 + chunk : nvalid + 1;
  if (e_end <= (e0 > 1 ? e0 : 1)) {
    for (int t = tid; t < a.Hq; t += kScoreThreads)
      stats[(qrow0 + t) * NC + c] = make_float2(-INFINITY, 0.f);
    return;
  }
  const int npg = (int)((e_end - 1) / pp - pg0 + 1);
  const uint32_t page_bytes = (uint32_t)(pf * sizeof(CK));
  const int n0 = npg < S ? npg : S;  // the ring's first fill
  if (ids_first) {
    int64_t page = 0;
    if (tid < npg) {
      page = in_pool(index_of(pid_raw, a.table64), a.num_pages);
      s_pid[tid] = page;
    }
    if (tid < n0) {
      mbar_init(&bars[tid], 1);
      mbar_fence_init();
    }
    __syncthreads();  // the barriers initialised, before any thread waits on one
    if (tid < n0) bulk_load(stage + tid * pf, ck + page * pf, page_bytes, &bars[tid]);
  } else {
    if (tid == 0) {
      for (int i = 0; i < S; ++i) mbar_init(&bars[i], 1);
      mbar_fence_init();
    }
    __syncthreads();
    if (tid == 0) {
      for (int i = 0; i < n0; ++i) {
        const int64_t page = in_pool(ld_index(a.table, trow + i, a.table64), a.num_pages);
        bulk_load(stage + i * pf, ck + page * pf, page_bytes, &bars[i]);
      }
    }
  }

  float qf[GMAX][8];
  const float qs = a.sm_scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    raw4_floats(qr[g][0], a.q_dtype, qf[g]);
    raw4_floats(qr[g][1], a.q_dtype, qf[g] + 4);
#pragma unroll
    for (int t = 0; t < 8; ++t) qf[g][t] = g < G ? qf[g][t] * qs : 0.f;
  }

  for (int i = 0; i < npg; ++i) {
    const int st = i % S;
    mbar_wait(&bars[st], (uint32_t)((i / S) & 1));
    const CK* sp = stage + st * pf;
    for (int j0 = 0; j0 < pp; j0 += epp) {
      const int j = j0 + ent;
      const int64_t e = (pg0 + i) * pp + j;
      const bool ok = j < pp && e >= 1 && e < e_end;
      float4 k0 = make_float4(0.f, 0.f, 0.f, 0.f), k1 = k0;
      if (ok) {
        const CK* r = sp + ((int64_t)j * a.Hk + hh) * D;
        k0 = ld4_ck(r + da);
        k1 = ld4_ck(r + db);
      }
      float x[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) x[g] = dot8(qf[g], k0, k1);
#pragma unroll
      for (int h = GMAX / 2, o = L / 2; h >= 1; h >>= 1, o >>= 1) {
        const bool hi = (lane_t & o) != 0;
#pragma unroll
        for (int t = 0; t < h; ++t) {
          const float send = hi ? x[t] : x[t + h];
          const float keep = hi ? x[t + h] : x[t];
          x[t] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
      }
#pragma unroll
      for (int o = SPLIT / 2; o > 0; o >>= 1) x[0] += __shfl_xor_sync(0xffffffffu, x[0], o);
      const int g = lane_t / SPLIT;
      if (lane_t % SPLIT == 0 && g < G && j < pp && e < e_end)
        s_x[(hh * GMAX + g) * chunk + (e - e0)] = ok ? x[0] : -INFINITY;
    }
    __syncthreads();  // stage st consumed by every thread
    if (tid == 0 && i + S < npg) {
      const int64_t page = ids_first ? s_pid[i + S]
                                     : in_pool(ld_index(a.table, trow + i + S, a.table64),
                                               a.num_pages);
      bulk_load(stage + st * pf, ck + page * pf, page_bytes, &bars[st]);
    }
  }

  const int n = (int)(e_end - e0);
  for (int t = tid; t < a.Hq * n; t += kScoreThreads) {
    const int r = t / n, k = t % n;
    a.logits[(qrow0 + r) * E + e0 + k] = s_x[((r / G) * GMAX + r % G) * chunk + k];
  }
  const int warp = tid / 32, lane = tid % 32;
  for (int r = warp; r < a.Hq; r += kScoreThreads / 32) {
    const float* xs = s_x + ((r / G) * GMAX + r % G) * chunk;
    const float2 ml = chunk_stats(xs, n, lane);
    if (lane == 0) stats[(qrow0 + r) * NC + c] = ml;
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
  int64_t nvalid = complete_keys(index_of(sl_raw, a.seq64));
  if (nvalid > E - 1) nvalid = E - 1;
  const int64_t lo = n0 * pp > 1 ? n0 * pp : 1;
  const int64_t hi = n1 * pp < nvalid ? n1 * pp : nvalid;  // inclusive
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

// 0: pick; 1: always the register variant (timing comparisons only).
int variant_override() {
  static const int v = [] {
    const char* e = std::getenv("SGLANG_PRR_INFLLM_VARIANT");
    return (e != nullptr && std::strcmp(e, "regs") == 0) ? 1 : 0;
  }();
  return v;
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
  if (hc == a.Hk && chunk % pp == 0 && 2 * page_bytes <= ring && variant_override() == 0) {
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
