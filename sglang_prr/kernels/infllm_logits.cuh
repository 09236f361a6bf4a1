// InfLLM-v2's logits pass (the scores' first pass) for SM90: its constants, the chunk statistics
// and the tail the variants share, and its three kernels: the register-load variant, the bulk
// ring (float32 keys, one CTA for every KV head) and the tensor-core variant (bf16 keys).
// Included by infllm_kernels.cu (the update, the pool and the launchers); one translation unit.
#pragma once
#include "infllm_kernels.h"
#include "common.cuh"

#include <cute/arch/mma_sm80.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cmath>

namespace prr {
namespace {

// Complete compressed keys of a request of `sl` tokens: ((sl - 32) // 16 + 1) clamped at 0.
__device__ __forceinline__ int64_t complete_keys(int64_t sl) {
  return sl >= kInfllmWindow ? (sl - kInfllmWindow) / kInfllmStride + 1 : 0;
}
// The request's last valid entry (entry e holds key e - 1) in a table of E entries.
__device__ __forceinline__ int64_t last_entry(int64_t sl, int64_t E) {
  const int64_t n = complete_keys(sl);
  return n < E - 1 ? n : E - 1;
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

// The G <= GMAX dots of one head row's 8 dims (lane lane_t of the row's L lanes) with the group's
// q, summed over the L lanes: a reduce-scatter (after the step at lane offset o a lane keeps half
// of its sums, the upper half when its o bit is set, plus its partner's matching half; G - 1 +
// log2(L / G) shuffles), then a tree over the L / GMAX lanes left a head. Lane lane_t ends
// with head lane_t / (L / GMAX)'s logit (on the first lane of its run).
template <int GMAX, int L>
__device__ __forceinline__ float group_dot(const float (*qf)[8], float4 k0, float4 k1, int lane_t) {
  constexpr int SPLIT = L / GMAX;
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
  return x[0];
}

// The end (exclusive) of chunk [e0, e0 + chunk) among the valid entries 1..last.
__device__ __forceinline__ int64_t chunk_end(int64_t last, int64_t e0, int chunk) {
  return e0 + chunk < last + 1 ? e0 + chunk : last + 1;
}
// Whether the chunk holds no valid entry; if so its `rows` query heads' statistics say so
// (-inf, 0), by every thread of the CTA, and the CTA returns.
__device__ __forceinline__ bool empty_chunk(const InfllmScoresArgs& a, int64_t e0, int64_t e_end,
                                            int64_t qrow0, int rows, int NC, int c) {
  if (e_end > (e0 > 1 ? e0 : 1)) return false;
  float2* stats = reinterpret_cast<float2*>(a.stats);
  for (int r = threadIdx.x; r < rows; r += kScoreThreads)
    stats[(qrow0 + r) * NC + c] = make_float2(-INFINITY, 0.f);
  return true;
}

// A logits pass's tail, by every thread of the CTA: the chunk's n logits of `rows` query heads
// (row r at s_x[((r / G) * GMAX + r % G) * stride]) to the workspace, and each row's chunk
// statistics.
template <int GMAX>
__device__ __forceinline__ void store_chunk(const InfllmScoresArgs& a, const float* s_x, int stride,
                                            int rows, int G, int64_t qrow0, int64_t E,
                                            int64_t e0, int n, int NC, int c) {
  const int tid = threadIdx.x;
  for (int t = tid; t < rows * n; t += kScoreThreads) {
    const int r = t / n, k = t % n;
    a.logits[(qrow0 + r) * E + e0 + k] = s_x[((r / G) * GMAX + r % G) * stride + k];
  }
  float2* stats = reinterpret_cast<float2*>(a.stats);
  const int warp = tid / 32, lane = tid % 32;
  for (int r = warp; r < rows; r += kScoreThreads / 32) {
    const float2 ml = chunk_stats(s_x + ((r / G) * GMAX + r % G) * stride, n, lane);
    if (lane == 0) stats[(qrow0 + r) * NC + c] = ml;
  }
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

  const int64_t e0 = (int64_t)c * chunk;
  const int64_t e_end = chunk_end(last_entry(ld_index(a.seq_lens, b, a.seq64), E), e0, chunk);
  if (empty_chunk(a, e0, e_end, qrow0, hc * G, NC, c)) return;
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
      const float x0 = group_dot<GMAX, L>(qf, k0, k1, lane_t);
      const int64_t e = base + (int64_t)u * epp + ent;
      const int g = lane_t / SPLIT;
      if (lane_t % SPLIT == 0 && g < G && e < e_end)
        s_x[(hh * GMAX + g) * kChunkMax + (e - e0)] = ok[u] ? x0 : -INFINITY;
    }
  }
  __syncthreads();

  store_chunk<GMAX>(a, s_x, kChunkMax, hc * G, G, qrow0, E, e0, (int)(e_end - e0), NC, c);
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

  const int64_t e_end = chunk_end(last_entry(ld_index(a.seq_lens, b, a.seq64), E), e0, chunk);
  if (empty_chunk(a, e0, e_end, qrow0, a.Hq, NC, c)) return;
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
      const float x0 = group_dot<GMAX, L>(qf, k0, k1, lane_t);
      const int g = lane_t / SPLIT;
      if (lane_t % SPLIT == 0 && g < G && j < pp && e < e_end)
        s_x[(hh * GMAX + g) * chunk + (e - e0)] = ok ? x0 : -INFINITY;
    }
    __syncthreads();  // stage st consumed by every thread
    if (tid == 0 && i + S < npg) {
      const int64_t page = ids_first ? s_pid[i + S]
                                     : in_pool(ld_index(a.table, trow + i + S, a.table64),
                                               a.num_pages);
      bulk_load(stage + st * pf, ck + page * pf, page_bytes, &bars[st]);
    }
  }

  store_chunk<GMAX>(a, s_x, chunk, a.Hq, G, qrow0, E, e0, (int)(e_end - e0), NC, c);
}

// Eight fp16 values (a 16-byte piece) as two bf16 parts, hi = bf16(x) and lo = x - hi (exact:
// x has 11 significant bits, hi 8); lo is 0 where hi is not finite, so an inf q stays +-inf.
__device__ __forceinline__ void split_half_bf16(uint4& hi, uint4& lo) {
  uint32_t* h = &hi.x;
  uint32_t* l = &lo.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
    const __nv_bfloat162 b = __floats2bfloat162_rn(x.x, x.y);
    const float2 bx = __bfloat1622float2(b);
    const __nv_bfloat162 r = __floats2bfloat162_rn(isfinite(bx.x) ? x.x - bx.x : 0.f,
                                                   isfinite(bx.y) ? x.y - bx.y : 0.f);
    h[i] = *reinterpret_cast<const uint32_t*>(&b);
    l[i] = *reinterpret_cast<const uint32_t*>(&r);
  }
}

// Logits pass on tensor cores (bf16 compressed keys, 16-bit q; SGLANG_PRR_INFLLM_VARIANT=bulk or
// regs force a CUDA-core variant). One CTA per (chunk, group of hc KV heads, request), as the
// register variant. A warp takes (KV head, tile of 16 entries) pairs: the tile's 16 key rows are
// the A operand of m16n8k16 MMAs, loaded from global memory straight into registers (16 bytes a
// lane and row: two k steps), the group's G <= 8 query heads the B operand's 8 columns. Within
// each 32 dims the MMA's k order is permuted so that a lane's A values are 8 contiguous dims
// (lane t of a quad: dims 8t..8t+7, as k = 2t, 2t+1, 2t+8, 2t+9 of two k steps); q's B fragment
// takes the same permutation, so a lane loads it as one 16-byte piece too. A bf16 key times a
// bf16 q is exact in float32 and the MMA accumulates in float32; an fp16 q is split into two
// bf16 parts whose sum is q (split_half_bf16), two MMAs a step. The scale is applied after the
// sum, as the reference applies it. (One difference from the reference, for an inf compressed
// key only: a zero low part times inf is NaN, which drops the head where the reference has a
// +-inf logit.) About 10 instructions a KB of keys, where the CUDA-core loop spends ~200
// (NOTES-kernels, run 59: that loop is bound by its issue latency).
template <int D, int GMAX>
__global__ void __launch_bounds__(kScoreThreads, D <= 128 ? 2 : 1)  // D <= 128: 2 CTAs an SM
infllm_logits_mma_kernel(InfllmScoresArgs a, int hc, int chunk) {
  pdl_begin();  // before any global-memory access (PDL)
  using Op = cute::SM80_16x8x16_F32BF16BF16F32_TN;
  constexpr int LQ = D / 32;           // 16-byte loads a key row, two k steps each
  constexpr int TPI = D <= 128 ? 2 : 1;  // tiles a warp loads at once (registers: 8 * LQ * TPI)
  static_assert(GMAX <= 8, "a group's heads are the MMA's 8 columns");
  extern __shared__ __align__(128) unsigned char s_raw[];  // as the bulk variant declares it
  int64_t* s_page = reinterpret_cast<int64_t*>(s_raw);            // [kChunkMax + 1]
  float* s_x = reinterpret_cast<float*>(s_page + kChunkMax + 1);  // [hc * GMAX][chunk]

  const int c = blockIdx.x, hk0 = blockIdx.y * hc, b = blockIdx.z;
  const int NC = gridDim.x;
  const int G = a.Hq / a.Hk;
  const int pp = a.page_size / kInfllmStride;
  const int64_t E = (int64_t)a.NB * pp;
  const int64_t qrow0 = (int64_t)b * a.Hq + (int64_t)hk0 * G;  // first query head of the CTA
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t e0 = (int64_t)c * chunk;
  const int64_t pg0 = e0 / pp;
  const int npg = (int)((e0 + chunk - 1) / pp - pg0 + 1);  // pages the chunk touches (<= 129)
  // ---- one round trip: the chunk's page ids (a thread each) and the request's length
  RawIndex pid_raw{};
  if (tid < npg && pg0 + tid < a.NB)
    pid_raw = ld_index_raw(a.table, (int64_t)b * a.table_stride + pg0 + tid, a.table64);
  const int64_t e_end = chunk_end(last_entry(ld_index(a.seq_lens, b, a.seq64), E), e0, chunk);
  if (empty_chunk(a, e0, e_end, qrow0, hc * G, NC, c)) return;
  if (tid < npg && pg0 + tid < a.NB)
    s_page[tid] = in_pool(index_of(pid_raw, a.table64), a.num_pages);
  __syncthreads();

  const __nv_bfloat16* ck = static_cast<const __nv_bfloat16*>(a.ck);
  const uint16_t* q = static_cast<const uint16_t*>(a.q);  // bf16 or fp16
  const int nq = a.q_dtype == kInfBF16 ? 1 : 2;
  const int64_t entry_stride = (int64_t)a.Hk * D;
  const float qs = a.sm_scale * kLog2e;
  const int T = chunk / 16;                   // tiles of 16 entries (chunk: a power of two >= 32)
  const int off0 = (int)(e0 - pg0 * pp);      // the chunk's first entry in its first page
  const int wph = hc >= 8 ? 1 : 8 / hc;       // warps a head (hc: a power of two)
  for (int hh = warp / wph; hh < hc; hh += kScoreThreads / 32 / wph) {
    const int hk = hk0 + hh;
    // q head g of the group (column g), dims 32m + 8t..8t+7 (zero past G), as nq bf16 parts
    uint4 qb[2][LQ];
#pragma unroll
    for (int m = 0; m < LQ; ++m)
      qb[0][m] = g < G ? __ldg(reinterpret_cast<const uint4*>(q + (qrow0 + hh * G + g) * D +
                                                               32 * m + 8 * t))
                       : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int m = 0; m < LQ; ++m) {
      if (nq == 2) split_half_bf16(qb[0][m], qb[1][m]);
      else qb[1][m] = make_uint4(0u, 0u, 0u, 0u);
    }
    for (int tile0 = warp % wph; tile0 < T; tile0 += wph * TPI) {
      uint4 kr[TPI][2][LQ];  // rows g and g + 8 of each tile, dims 32m + 8t..8t+7
#pragma unroll
      for (int u = 0; u < TPI; ++u) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int64_t e = e0 + (tile0 + u * wph) * 16 + g + 8 * r;
          const bool ok = tile0 + u * wph < T && e >= 1 && e < e_end;
          const int el = off0 + (int)(e - e0);  // from the chunk's first page (32-bit)
          const int64_t at =
              ok ? (s_page[el / pp] * pp + el % pp) * entry_stride + (int64_t)hk * D : 0;
          const __nv_bfloat16* row = ck + at + 8 * t;
#pragma unroll
          for (int m = 0; m < LQ; ++m)
            kr[u][r][m] = ok ? __ldg(reinterpret_cast<const uint4*>(row + 32 * m))
                             : make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int u = 0; u < TPI; ++u) {
        if (tile0 + u * wph >= T) break;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int p = 1; p >= 0; --p) {  // the small part first
          if (p >= nq) continue;
#pragma unroll
          for (int m = 0; m < LQ; ++m) {  // k steps 2m (words x, y) and 2m + 1 (words z, w)
            const uint4 b = qb[p][m];
            Op::fma(acc[0], acc[1], acc[2], acc[3], kr[u][0][m].x, kr[u][1][m].x, kr[u][0][m].y,
                    kr[u][1][m].y, b.x, b.y, acc[0], acc[1], acc[2], acc[3]);
            Op::fma(acc[0], acc[1], acc[2], acc[3], kr[u][0][m].z, kr[u][1][m].z, kr[u][0][m].w,
                    kr[u][1][m].w, b.z, b.w, acc[0], acc[1], acc[2], acc[3]);
          }
        }
        // acc: (row g, heads 2t, 2t + 1), (row g + 8, heads 2t, 2t + 1)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int64_t e = e0 + (tile0 + u * wph) * 16 + g + 8 * r;  // recomputed: registers
          if (e >= e_end) continue;
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const int h = 2 * t + k;
            if (h < G)
              s_x[(hh * GMAX + h) * chunk + (e - e0)] = e >= 1 ? acc[2 * r + k] * qs : -INFINITY;
          }
        }
      }
    }
  }
  __syncthreads();
  store_chunk<GMAX>(a, s_x, chunk, hc * G, G, qrow0, E, e0, (int)(e_end - e0), NC, c);
}

}  // namespace
}  // namespace prr
