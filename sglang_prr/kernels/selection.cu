// Block selection on SM90: Quest scores, top-K (A), the row-tail Quest selection (scores, A,
// M = A \ P and the statistics in one launch, the top-K by the last CTA of a row) and the
// two-launch one (the scores, then a CTA a row). The one-pass selection with the predictor is in
// select_predict.cu.
// Plain CUDA: these kernels are memory- and latency-bound, so they are written around wide loads
// and many independent requests in flight rather than tensor cores. Every kernel is graph-safe:
// static launch shapes, device-side counts, no host reads.
#include "prr_kernels.h"
#include "common.cuh"
#include "topk.cuh"
#include "predict_row.cuh"

#include <cute/arch/copy_sm80.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <atomic>
#include <climits>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <cmath>

namespace prr {
namespace {

// ============================================================================ Quest scores
// One warp per (request, block): it reads the block's min/max rows of every KV head (float4 per
// lane) and sums max(q*kmax, q*kmin) over dims and the GQA group. q of the request is staged in
// shared memory once per CTA. With the step's new keys given, the newest block's bounds take its
// key first, in registers (fold_key, as the decode update folds it into the summary), and with
// their slots (QuestArgs::new_loc) the folded bounds are stored: the decode update itself.
constexpr int kQuestWarps = 8;

template <typename S>
__device__ __forceinline__ float4 ld_sum4(const S* p, int64_t i4);  // 4 summary values as floats
template <>
__device__ __forceinline__ float4 ld_sum4<float>(const float* p, int64_t i4) {
  return __ldg(reinterpret_cast<const float4*>(p) + i4);
}
template <>
__device__ __forceinline__ float4 ld_sum4<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i4) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p) + i4);
  const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(x.x, x.y, y.x, y.y);
}

// One warp's block n of request b: its Quest bound for every KV head (the heads' summaries loaded
// HU at a time, all in flight before the FMAs), or -inf past the request's blocks.
template <typename S>
__device__ __forceinline__ void quest_score_block(const QuestArgs& a, const float* s_q, int b,
                                                  int n, int lane) {
  bool first_tok;
  const bool newest =
      n == new_key_block(a.new_k, a.new_pos, a.new_pos64, a.page_size, b, first_tok);
  const int64_t wpage =
      newest ? new_key_page(a.new_loc, a.new_loc64, a.page_size, a.num_pages, b) : -1;
  const int64_t nb_b = ld_index(a.nblk, b, a.nblk64);
  float* out = a.out + (int64_t)b * a.Hk * a.NB + n;
  if (n >= nb_b) {
    for (int h = lane; h < a.Hk; h += 32) out[(int64_t)h * a.NB] = -INFINITY;
    return;
  }
  const int64_t page =
      in_pool(ld_index(a.table, (int64_t)b * a.table_stride + n, a.table64), a.num_pages);
  const int G = a.Hq / a.Hk, D4 = a.D / 4;
  const S* lo = reinterpret_cast<const S*>(a.kmin) + page * a.Hk * a.D;
  const S* hi = reinterpret_cast<const S*>(a.kmax) + page * a.Hk * a.D;
  constexpr int HU = 4;  // KV heads loaded together
  for (int h0 = 0; h0 < a.Hk; h0 += HU) {
    float part[HU];
#pragma unroll
    for (int j = 0; j < HU; ++j) part[j] = 0.f;
    for (int c = lane; c < D4; c += 32) {
      float4 vl[HU], vh[HU];
#pragma unroll
      for (int j = 0; j < HU; ++j) {
        if (h0 + j < a.Hk) {
          vl[j] = ld_sum4(lo, (h0 + j) * D4 + c);
          vh[j] = ld_sum4(hi, (h0 + j) * D4 + c);
        }
      }
      if (newest) {
#pragma unroll
        for (int j = 0; j < HU; ++j) {
          if (h0 + j >= a.Hk) continue;
          const float4 x = load4_any(a.new_k, b * a.new_k_stride + (int64_t)(h0 + j) * a.D + 4 * c,
                                     a.new_k_dtype);
          fold_key4<S>(x, first_tok, vl[j], vh[j]);
          if (wpage >= 0)
            store_bounds4<S>(a.w_kmin, a.w_kmax, (wpage * a.Hk + h0 + j) * a.D + 4 * c, vl[j], vh[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < HU; ++j) {
        if (h0 + j >= a.Hk) continue;
        for (int g = 0; g < G; ++g) {
          const float4 q = reinterpret_cast<const float4*>(s_q + ((h0 + j) * G + g) * a.D)[c];
          part[j] += fmaxf(q.x * vh[j].x, q.x * vl[j].x) + fmaxf(q.y * vh[j].y, q.y * vl[j].y) +
                     fmaxf(q.z * vh[j].z, q.z * vl[j].z) + fmaxf(q.w * vh[j].w, q.w * vl[j].w);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < HU; ++j) {
      float x = part[j];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
      if (lane == 0 && h0 + j < a.Hk) out[(int64_t)(h0 + j) * a.NB] = x;
    }
  }
}

// A warp per (request, block). Loop: the grid's x is narrower than the table (select_grid_x) and
// a warp takes blocks n, + gridDim.x * kQuestWarps, ...; without it a warp takes one block and
// the kernel keeps the straight-line code (with the loop around it, the table-wide grid took
// 64.5 against 52.5 us at 8 x 128K: branches between the heads' summary loads).
template <typename S, bool Loop>
__global__ void __launch_bounds__(kQuestWarps * 32)
quest_scores_kernel(QuestArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ float s_q[];  // [Hq, D]
  const int b = blockIdx.y;
  const int HqD = a.Hq * a.D;
  for (int e = threadIdx.x * 8; e < HqD; e += blockDim.x * 8) {
    float f[8];
    load8_any(a.q, (int64_t)b * a.q_stride + e, a.q_dtype, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) s_q[e + i] = f[i];
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * kQuestWarps + warp;
  if (!Loop) {
    if (n0 < a.NB) quest_score_block<S>(a, s_q, b, n0, lane);
    return;
  }
  for (int n = n0; n < a.NB; n += gridDim.x * kQuestWarps) quest_score_block<S>(a, s_q, b, n, lane);
}

// ============================================================================ streamed scores
// The scores of many requests (the split selection's first launch, batch x blocks >= 4096): a
// warp streams a run of consecutive blocks of one request through its own ring of kStreamStages
// shared-memory stages (cp.async), kStreamStages - 1 blocks' summaries in flight while it scores
// one, so that an SM keeps ~170 KB of reads in flight; quest_scores_kernel's warps each wait on
// one block's loads, a round trip at a time (35% of DRAM at 8 x 128K, run 19).
// A block's bound row (Hk * D values, kmin's and kmax's) is cut into 16-byte pieces of V values;
// a warp takes 32 consecutive pieces (its piece group), a lane one piece of each bound. A lane
// copies and reads only its own bytes (no barrier, nothing shared). The CTA's warps are the
// row's piece groups for several runs: the groups of one run read each page's row together.
// The group's q is folded into two sums a dim (quest_fold_q, quest_piece_sum in common.cuh; with
// the per-head form the warps issued in 72% of the cycles at 8 x 128K on an H100, DRAM at 47%),
// and a piece whose sum is not finite is summed again per head (exact_piece_score).
constexpr int kStreamStages = 8;
constexpr int kStreamThreads = 256;
constexpr int kStreamPieceBytes = 16;

// A 16-byte summary piece as floats: 8 bfloat16 values or 4 float32 ones.
template <typename S> __device__ __forceinline__ void piece_floats(uint4 u, float* f);
template <> __device__ __forceinline__ void piece_floats<__nv_bfloat16>(uint4 u, float* f) {
  raw8_floats(Raw8Any{u, make_uint4(0u, 0u, 0u, 0u)}, kBF16, f);
}
template <> __device__ __forceinline__ void piece_floats<float>(uint4 u, float* f) {
  f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
  f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}

// V values of q (any dtype) at element offset `off` as floats.
template <int V>
__device__ __forceinline__ void load_q_piece(const void* q, int64_t off, int dt, float* f) {
  if constexpr (V == 8) {
    load8_any(q, off, dt, f);
  } else {
    const float4 x = load4_any(q, off, dt);
    f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w;
  }
}

// The reference's sum over a piece (its head's G query heads, V dims) of fmax(q hi, q lo): the
// rare piece whose fast sum is not finite. q is read again from global memory.
template <int V>
__device__ __forceinline__ float exact_piece_score(const void* q, int64_t q0, int dt, int G, int D,
                                                const float* lo, const float* hi) {
  float part = 0.f;
#pragma unroll 1
  for (int g = 0; g < G; ++g) {
    float qv[V];
    load_q_piece<V>(q, q0 + (int64_t)g * D, dt, qv);
#pragma unroll
    for (int v = 0; v < V; ++v) part += fmaxf(qv[v] * hi[v], qv[v] * lo[v]);
  }
  return part;
}

// PH: a head's pieces (D / V: 8, 16 or 32), a compile-time power of two (its lanes' sums).
template <typename S, int PH>
__global__ void __launch_bounds__(kStreamThreads, 3)
quest_scores_stream_kernel(QuestArgs a, int groups) {
  pdl_begin();  // before any global-memory access (PDL)
  constexpr int V = kStreamPieceBytes / sizeof(S);
  constexpr int R = kStreamStages;
  extern __shared__ __align__(16) unsigned char s_ring[];  // [warp][stage][bound][lane] pieces
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int runs = blockDim.x / 32 / groups;
  const int pg = warp % groups, b = blockIdx.y;
  const int run = blockIdx.x * runs + warp / groups, nruns = gridDim.x * runs;
  const int G = a.Hq / a.Hk, NB = a.NB;
  const int pc = pg * 32 + lane;  // this lane's piece of a bound row
  const bool mine = pc < a.Hk * PH;
  const int h = (mine ? pc : 0) / PH, d0 = ((mine ? pc : 0) % PH) * V;
  const int64_t q0 = b * a.q_stride + (int64_t)h * G * a.D + d0;  // q of (b, head h * G, d0)
  // ---- one round trip: the row's block count, the new key's position and slot, q
  const RawIndex nb_raw = ld_index_raw(a.nblk, b, a.nblk64);
  const void* pos_p = a.new_k ? a.new_pos : a.nblk;
  const RawIndex pos_raw = ld_index_raw(pos_p, b, a.new_k ? a.new_pos64 : a.nblk64);
  const RawIndex loc_raw =
      ld_index_raw(a.new_loc ? a.new_loc : a.nblk, b, a.new_loc ? a.new_loc64 : a.nblk64);
  float qp[V], qn[V];  // per dim: the sums of the group's q >= 0 (and NaN), and of its q < 0
#pragma unroll
  for (int v = 0; v < V; ++v) qp[v] = qn[v] = 0.f;
  // q's pieces raw, kQBatch heads at a time (a load converted at once in a dtype branch would
  // be one round trip per head): one round trip for groups of up to kQBatch heads.
  constexpr int kQBatch = 4;
#pragma unroll
  for (int g0 = 0; g0 < kMaxGroup; g0 += kQBatch) {
    if (g0 < G) {
      uint4 raw[kQBatch][V / 4];  // V elements: V / 4 words of 16 bytes for float32 q
#pragma unroll
      for (int j = 0; j < kQBatch; ++j)
#pragma unroll
        for (int w = 0; w < V / 4; ++w)
          if (g0 + j < G) raw[j][w] = ld4_raw(a.q, q0 + (int64_t)(g0 + j) * a.D + 4 * w, a.q_dtype);
#pragma unroll
      for (int j = 0; j < kQBatch; ++j) {
        if (g0 + j < G) {
          float qv[V];
#pragma unroll
          for (int w = 0; w < V / 4; ++w) raw4_floats(raw[j][w], a.q_dtype, qv + 4 * w);
          quest_fold_q<V>(qv, qp, qn);
        }
      }
    }
  }
  const int nb = clamp_count(index_of(nb_raw, a.nblk64), NB);
  bool first_tok = false;
  const int newest =
      a.new_k ? new_key_block_at(index_of(pos_raw, a.new_pos64), a.page_size, first_tok) : -1;
  const int64_t wpage =
      a.new_loc ? slot_page(index_of(loc_raw, a.new_loc64), a.page_size, a.num_pages) : -1;
  // ---- the run: blocks [n0, n0 + cnt) of the row, and the first 64 of their pages
  const int len = (nb + nruns - 1) / nruns;
  const int n0 = min(run * len, nb), cnt = min(len, nb - n0);
  const int64_t trow = (int64_t)b * a.table_stride;
  const auto page_raw = [&](int i) {  // the page of the run's block i (a lane's load)
    return ld_index_raw(a.table, trow + (i < cnt ? n0 + i : 0), a.table64);
  };
  RawIndex cur_raw = page_raw(lane), next_raw = page_raw(32 + lane);
  const bool run_has_new = newest >= n0 && newest < n0 + cnt;
  // Page ids fit 32 bits (the launcher takes pools of fewer than 2^31 pages): one shuffle each.
  int page_cur = (int)in_pool(index_of(cur_raw, a.table64), a.num_pages);
  int batch = 0;
  unsigned char* ring = s_ring + (size_t)warp * R * 2 * 32 * kStreamPieceBytes;
  const int64_t row_elems = (int64_t)a.Hk * a.D;  // a page's bound row
  // This lane's piece of page 0's bound rows (a page's are row_elems * sizeof(S) bytes further).
  const char* lo_src = reinterpret_cast<const char*>(a.kmin) + (int64_t)pc * kStreamPieceBytes;
  const char* hi_src = reinterpret_cast<const char*>(a.kmax) + (int64_t)pc * kStreamPieceBytes;
  // Issues block i's copies into stage i % R (every lane commits a group, empty past the run, so
  // that the group count stays the iteration's).
  const auto issue = [&](int i) {
    if (i < cnt) {
      if ((i >> 5) != batch) {  // the next 32 pages: loaded 32 blocks ago
        batch = i >> 5;
        page_cur = (int)in_pool(index_of(next_raw, a.table64), a.num_pages);
        next_raw = page_raw(32 * (batch + 1) + lane);
      }
      const int page = __shfl_sync(0xffffffffu, page_cur, i & 31);
      if (mine) {
        const int64_t off = (int64_t)page * row_elems * (int64_t)sizeof(S);
        unsigned char* st = ring + (i % R) * 2 * 32 * kStreamPieceBytes;
        cute::SM80_CP_ASYNC_CACHEGLOBAL<uint4>::copy(
            *reinterpret_cast<const uint4*>(lo_src + off),
            *reinterpret_cast<uint4*>(st + lane * kStreamPieceBytes));
        cute::SM80_CP_ASYNC_CACHEGLOBAL<uint4>::copy(
            *reinterpret_cast<const uint4*>(hi_src + off),
            *reinterpret_cast<uint4*>(st + (32 + lane) * kStreamPieceBytes));
      }
    }
    cute::cp_async_fence();
  };
#pragma unroll 1
  for (int i = 0; i < R - 1; ++i) issue(i);
  // This lane's share of a block's score (the sum above), or the reference's where not finite.
  const auto score = [&](const float* lo, const float* hi) {
    float part = quest_piece_sum<V>(lo, hi, qp, qn, 0.f);
    if (!isfinite(part)) part = exact_piece_score<V>(a.q, q0, a.q_dtype, G, a.D, lo, hi);
    return part;
  };
  // The run that holds the step's new key scores its block here, before the stream: the block's
  // pieces and the key loaded directly, the key folded in (fold_key, as the decode update) and,
  // with its slot given, the folded bounds stored (the decode update itself). The stream's copy
  // of that block is not read.
  float part_new = 0.f;
  if (run_has_new && mine) {
    const int64_t page = in_pool(ld_index(a.table, trow + newest, a.table64), a.num_pages);
    const int64_t off = page * row_elems * (int64_t)sizeof(S);
    float lo[V], hi[V];
    piece_floats<S>(__ldcg(reinterpret_cast<const uint4*>(lo_src + off)), lo);
    piece_floats<S>(__ldcg(reinterpret_cast<const uint4*>(hi_src + off)), hi);
    const int64_t koff = b * a.new_k_stride + (int64_t)h * a.D + d0;
#pragma unroll
    for (int v = 0; v < V; v += 4) {
      const float4 x = load4_any(a.new_k, koff + v, a.new_k_dtype);
      fold_key<S>(x.x, first_tok, lo[v], hi[v]);
      fold_key<S>(x.y, first_tok, lo[v + 1], hi[v + 1]);
      fold_key<S>(x.z, first_tok, lo[v + 2], hi[v + 2]);
      fold_key<S>(x.w, first_tok, lo[v + 3], hi[v + 3]);
      if (wpage >= 0)
        store_bounds4<S>(a.w_kmin, a.w_kmax, (wpage * a.Hk + h) * a.D + d0 + v,
                         make_float4(lo[v], lo[v + 1], lo[v + 2], lo[v + 3]),
                         make_float4(hi[v], hi[v + 1], hi[v + 2], hi[v + 3]));
    }
    part_new = score(lo, hi);
  }
  float* out = a.out + ((int64_t)b * a.Hk + h) * NB;
#pragma unroll 1
  for (int i = 0; i < cnt; ++i) {
    issue(i + R - 1);
    cute::cp_async_wait<R - 1>();  // block i's group (this lane's own copies)
    float part = 0.f;
    if (mine) {
      const unsigned char* st = ring + (i % R) * 2 * 32 * kStreamPieceBytes;
      float lo[V], hi[V];
      piece_floats<S>(*reinterpret_cast<const uint4*>(st + lane * kStreamPieceBytes), lo);
      piece_floats<S>(*reinterpret_cast<const uint4*>(st + (32 + lane) * kStreamPieceBytes), hi);
      part = run_has_new && n0 + i == newest ? part_new : score(lo, hi);
    }
    // The head's pieces are PH consecutive lanes (PH divides 32).
#pragma unroll
    for (int off = PH / 2; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (mine && pc % PH == 0) out[n0 + i] = part;
  }
  cute::cp_async_wait<0>();  // no copy outlives the CTA's shared memory
  // Blocks past the request's: -inf, spread over the runs (the first piece group's lanes).
  if (pg == 0)
    for (int n = nb + run; n < NB; n += nruns)
      for (int hh = lane; hh < a.Hk; hh += 32) a.out[((int64_t)b * a.Hk + hh) * NB + n] = -INFINITY;
}

// ============================================================================ top-K selection
// The top-K helpers (order keys, topk_mask, write_list) are in topk.cuh.

__global__ void __launch_bounds__(kTopkThreads)
select_topk_kernel(TopkArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ uint32_t s_key[];  // [NB]
  const int hk = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x;
  const int NB = a.NB;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int nb = clamp_count(ld_index(a.nblk, b, a.nblk64), NB);
  const int keep_lo = a.sink, keep_hi = nb - a.local;  // kept: id < keep_lo or id >= keep_hi
  int ninit = 0;
  float gam = 0.f;
  if (a.trend) {
    const int64_t x = ld_index(a.n_init, b, a.ninit64);
    ninit = (int)(x < NB ? x : NB);
    gam = a.gamma[b * a.gamma_stride];
  }
  const float* src = a.scores + row * NB;
  const float* trd = a.trend ? a.trend + row * NB : nullptr;
  for (int i = tid; i < NB; i += kTopkThreads) {
    uint32_t key = 0;
    if (is_middle(i, nb, keep_lo, keep_hi)) {
      float sc;
      // Unfused multiply-add, as the reference rounds it (ties decide the selection).
      if (trd) sc = i < ninit ? __fadd_rn(src[i], __fmul_rn(gam, trd[i])) : -INFINITY;
      else sc = src[i];
      key = order_key(sc);
    }
    s_key[i] = key;
  }
  const int kk = (a.dense_row && a.dense_row[b]) ? NB : a.k;
  topk_mask<kTopkThreads>(s_key, NB, nb, kk, keep_lo, keep_hi);
  write_list<kTopkThreads>(s_key, NB, 1u, a.idx + row * a.n_out, a.n_out, a.cnt + row);
}

// ============================================================================ fused selection
// Quest scores + top-K (A) + M = A \ P in one launch. Grid (Hk, chunks of kSelChunk blocks, B):
// every CTA scores its chunk of blocks for one KV head, a warp per block and kSelPerWarp blocks
// per warp loaded together (the heads of a chunk are neighbours in launch order, so the pieces of
// each page's [Hk, D] summary rows are read close in time). The last CTA of the row (b, hk) then
// reads the row's scores back from L2 and runs the top-K and both list writes, so selection costs
// one launch and one pass over the summaries.
constexpr int kSelThreads = 512;
constexpr int kSelWarps = kSelThreads / 32;
constexpr int kSelPerWarp = 4;
constexpr int kSelChunk = kSelWarps * kSelPerWarp;

// The row's top-K (A), M = A \ P and the counters from its scores (a.scores, complete for every
// block < nb; written by other CTAs, so read through L2). s_key: shared memory of
// row_tail_words(nb) words (the keys [nb], then P(t)'s bits for kWalks). Called by every thread
// of one CTA per (request, KV head) row. kWalks: the lists in warp-ordered walks (topk_walk: the
// row-tail and rows kernels), else by CTA scans (the rows kernel where SGLANG_PRR_TOPK=scan asks, a
// measuring knob: the walks took 0.1-0.5 us off the rows' launch, level at 32 x 128K, run 46).
__host__ __device__ constexpr int row_tail_words(int nb) { return nb + (nb + 31) / 32; }

template <bool kWalks>
__device__ void select_row_tail(const SelectArgs& a, int b, int hk, int nb, uint32_t* s_key) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int NB = a.NB;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const float* srow = a.scores + row * NB;
  const int keep_lo = a.sink, keep_hi = nb - a.local;
  uint32_t* s_pbits = s_key + nb;
  // Every load before any is used: the dense flag, P(t)'s count and first entries (after its
  // slot's round trip) and the row's scores, kRowLoads a thread in flight (a loop of
  // load-convert-store waits for each: four L2 round trips a thread at 2048 blocks).
  const bool dense = a.dense_row ? a.dense_row[b] : false;
  int64_t prow = 0;
  int pc_raw = 0, p_first = -1;
  if (a.p_idx) {
    prow = slot_of(a.p_rows, a.p_rows64, a.p_rows_n, b) * a.Hk + hk;
    pc_raw = a.p_cnt[prow];
    if (tid < a.Np) p_first = a.p_idx[prow * a.Np + tid];
  }
  if (kWalks)
    for (int w = tid; w < (nb + 31) / 32; w += kSelThreads) s_pbits[w] = 0u;
  constexpr int kRowLoads = 8;
#pragma unroll 1
  for (int i0 = tid; i0 < nb; i0 += kRowLoads * kSelThreads) {
    float x[kRowLoads];
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int i = i0 + u * kSelThreads;
      x[u] = i < nb ? __ldcg(srow + i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int i = i0 + u * kSelThreads;  // key i in thread i % kSelThreads (topk_threshold)
      if (i < nb) s_key[i] = is_middle(i, nb, keep_lo, keep_hi) ? order_key(x[u]) : 0u;
    }
  }
  const int pc = a.p_idx ? min(max(pc_raw, 0), a.Np) : 0;
  // f(x) for each of P(t)'s ids x in [0, nb) (the first entries loaded above, the rest here).
  const auto each_p = [&](auto f) {
    if (!a.p_idx) return;
    if (tid < pc && p_first >= 0 && p_first < nb) f(p_first);
    for (int i = tid + kSelThreads; i < pc; i += kSelThreads) {
      const int x = a.p_idx[prow * a.Np + i];
      if (x >= 0 && x < nb) f(x);
    }
  };
  int na, nm;
  int32_t* a_out = a.a_idx + row * a.n_out;
  int32_t* m_out = a.m_idx + row * a.n_out;
  if constexpr (!kWalks) {
    topk_mask<kSelThreads>(s_key, nb, nb, dense ? NB : a.k, keep_lo, keep_hi);
    // Mark the selected blocks that P holds (bit 1): M = selected without that bit.
    each_p([&](int x) { if (s_key[x]) s_key[x] = 3u; });
    if (a.p_idx) __syncthreads();
    write_list<kSelThreads>(s_key, nb, 1u, a_out, a.n_out, a.a_cnt + row);
    // M: selected (bit 0) and not in P (bit 1 clear).
    for (int i = tid; i < nb; i += kSelThreads) s_key[i] = s_key[i] == 1u ? 1u : 0u;
    __syncthreads();
    write_list<kSelThreads>(s_key, nb, 1u, m_out, a.n_out, a.m_cnt + row);
    // write_list's last barrier makes both counts visible to thread 0, which wrote them.
    na = a.a_cnt[row];
    nm = a.m_cnt[row];
  } else {
    const TopkCut cut = topk_threshold<kSelThreads>(s_key, nb, dense ? NB : a.k);
    // P(t)'s blocks as bits (zeroed before the threshold's barriers; read after the next one)
    each_p([&](int x) { atomicOr(&s_pbits[x >> 5], 1u << (x & 31)); });
    const TopkWalk wk = topk_walk_counts<kSelThreads>(s_key, nb, nb, cut, keep_lo, keep_hi);
    // A written at its places with each warp's count of M (chosen, not in P), then M.
    __shared__ int s_m[kSelWarps];
    const auto not_p = [&](int i) { return ((s_pbits[i >> 5] >> (i & 31)) & 1u) == 0u; };
    int mc = topk_walk<kSelThreads>(s_key, nb, nb, cut, keep_lo, keep_hi, wk.eq_before,
                                    wk.chosen_before, a_out, a.n_out,
                                    [](int) { return true; }, not_p);
    // M is taken from A as written: where A was cut at the list's width (a dense row with more
    // blocks than n_out), only ids up to A's last entry (a uniform branch, rare: a second count).
    int a_last = INT_MAX;
    const auto in_m = [&](int i) { return i <= a_last && not_p(i); };
    if (wk.total > a.n_out) {
      __syncthreads();  // A's entries are written
      a_last = a.n_out > 0 ? a_out[a.n_out - 1] : -1;
      mc = topk_walk<kSelThreads>(s_key, nb, nb, cut, keep_lo, keep_hi, wk.eq_before, 0, a_out,
                                  0, [](int) { return false; }, in_m);
    }
    if (lane == 0) s_m[warp] = mc;
    __syncthreads();
    int m_total;
    const int mpos = warps_prefix<kSelThreads>(lane < kSelWarps ? s_m[lane] : 0, warp, &m_total);
    topk_walk<kSelThreads>(s_key, nb, nb, cut, keep_lo, keep_hi, wk.eq_before, mpos, m_out,
                           a.n_out, in_m, [](int) { return false; });
    for (int j = wk.total + tid; j < a.n_out; j += kSelThreads) a_out[j] = -1;
    for (int j = m_total + tid; j < a.n_out; j += kSelThreads) m_out[j] = -1;
    na = min(wk.total, a.n_out);
    nm = min(m_total, a.n_out);
    if (tid == 0) { a.a_cnt[row] = na; a.m_cnt[row] = nm; }
  }
  if (a.stats && !dense && tid == 0) {
    atomicAdd(a.stats + kStatSelected, (unsigned long long)na);
    atomicAdd(a.stats + kStatRepair, (unsigned long long)nm);
    // |P| as the reference counts it (clamped at 0, not at the list's width)
    atomicAdd(a.stats + kStatPredicted, (unsigned long long)(pc_raw > 0 ? pc_raw : 0));
    atomicAdd(a.stats + kStatRows, 1ull);
  }
}

template <typename S>
__global__ void __launch_bounds__(kSelThreads)
quest_select_kernel(SelectArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  // q group [G, D] floats, then the row tail's keys and P(t)'s bits [row_tail_words(NB)]
  extern __shared__ __align__(16) uint32_t s_sel[];
  const int hk = blockIdx.x, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int G = a.Hq / a.Hk, D4 = a.D / 4;
  const int NB = a.NB;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int nb = clamp_count(ld_index(a.nblk, b, a.nblk64), NB);
  // Only the chunks holding the row's blocks take part (the table is as wide as the longest
  // context the server accepts, most rows are shorter); the others exit at once, with no fence.
  const int nch = max((nb + kSelChunk - 1) / kSelChunk, 1);
  if ((int)blockIdx.y >= nch) return;
  float* s_q = reinterpret_cast<float*>(s_sel);
  for (int e = tid * 8; e < G * a.D; e += kSelThreads * 8) {
    float f[8];
    load8_any(a.q, b * a.q_stride + (int64_t)hk * G * a.D + e, a.q_dtype, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) s_q[e + i] = f[i];
  }
  __syncthreads();
  const int base = blockIdx.y * kSelChunk + warp;
  bool first_tok;
  const int newest = new_key_block(a.new_k, a.new_pos, a.new_pos64, a.page_size, b, first_tok);
  const int64_t wpage =
      newest >= 0 ? new_key_page(a.new_loc, a.new_loc64, a.page_size, a.num_pages, b) : -1;
  int64_t page[kSelPerWarp];
  bool valid[kSelPerWarp];
#pragma unroll
  for (int j = 0; j < kSelPerWarp; ++j) {
    const int n = base + j * kSelWarps;
    valid[j] = n < nb;
    page[j] = valid[j] ? in_pool(ld_index(a.table, (int64_t)b * a.table_stride + n, a.table64),
                                 a.num_pages)
                       : 0;
  }
  float acc[kSelPerWarp];
#pragma unroll
  for (int j = 0; j < kSelPerWarp; ++j) acc[j] = 0.f;
  for (int c = lane; c < D4; c += 32) {
    float4 lo[kSelPerWarp], hi[kSelPerWarp];
#pragma unroll
    for (int j = 0; j < kSelPerWarp; ++j) {
      if (valid[j]) {
        const int64_t off = (page[j] * a.Hk + hk) * D4 + c;
        lo[j] = ld_sum4(reinterpret_cast<const S*>(a.kmin), off);
        hi[j] = ld_sum4(reinterpret_cast<const S*>(a.kmax), off);
        if (base + j * kSelWarps == newest) {  // the step's new key (SelectArgs::new_k)
          const float4 x = load4_any(a.new_k, b * a.new_k_stride + (int64_t)hk * a.D + 4 * c,
                                     a.new_k_dtype);
          fold_key4<S>(x, first_tok, lo[j], hi[j]);
          if (wpage >= 0)  // the decode update (SelectArgs::new_loc)
            store_bounds4<S>(a.w_kmin, a.w_kmax, (wpage * a.Hk + hk) * a.D + 4 * c, lo[j], hi[j]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const float4 q = reinterpret_cast<const float4*>(s_q + g * a.D)[c];
#pragma unroll
      for (int j = 0; j < kSelPerWarp; ++j) {
        if (!valid[j]) continue;
        acc[j] += fmaxf(q.x * hi[j].x, q.x * lo[j].x) + fmaxf(q.y * hi[j].y, q.y * lo[j].y) +
                  fmaxf(q.z * hi[j].z, q.z * lo[j].z) + fmaxf(q.w * hi[j].w, q.w * lo[j].w);
      }
    }
  }
  float* srow = a.scores + row * NB;
#pragma unroll
  for (int j = 0; j < kSelPerWarp; ++j) {
    float x = acc[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    const int n = base + j * kSelWarps;
    if (lane == 0 && n < NB) srow[n] = valid[j] ? x : -INFINITY;
  }
  if (!last_of_group(a.sem + row, nch)) return;
  for (int i = nch * kSelChunk + tid; i < NB; i += kSelThreads) srow[i] = -INFINITY;
  // The q group is no longer needed: its shared memory holds the keys and P(t)'s bits.
  select_row_tail<true>(a, b, hk, nb, s_sel);
}

// The rows' tails in a launch of their own, a CTA per (request, KV head) row, from scores that
// an earlier launch wrote: Quest's two-launch selection (quest_scores_kernel, a warp per
// (request, block), then this; no fence, ticket or candidate workspace, which the one-pass kernel
// pays per CTA) and select_lists, the top-K, M and counters of any method's scores (InfLLM-v2's)
// in one launch. Reads only the scores, counts, P and the flags of SelectArgs.
template <bool kWalks>
__global__ void __launch_bounds__(kSelThreads)
select_rows_kernel(SelectArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(16) uint32_t s_key[];  // [row_tail_words(NB)]
  const int hk = blockIdx.x, b = blockIdx.y;
  const int nb = clamp_count(ld_index(a.nblk, b, a.nblk64), a.NB);
  select_row_tail<kWalks>(a, b, hk, nb, s_key);
}

// select_rows_kernel's rows (blockIdx.z == 0) and the predictor's step of the same rows
// (blockIdx.z == 1, predict_row over p: the Holt update with this step's scores, P(t+1) into
// rows of P that the rows' P(t) is not) in one launch: a composed selection's predictor is then
// no launch of its own. The rows' CTAs come first in the grid's order; the two halves share no
// data (the top-K reads the scores and P(t), the predictor the scores and writes its state and
// P(t+1)), so they run side by side, each on its own SM when the GPU has SMs free: beside a
// separate predictor launch the rows took 11.3 us instead of 6.4 (run 66).
static_assert(kSelThreads == kTopkThreads, "the rows and the predictor share the CTA shape");
template <bool kWalks>
__global__ void __launch_bounds__(kSelThreads)
select_predict_rows_kernel(SelectArgs a, PredictArgs p) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(16) uint32_t s_key[];  // [row_tail_words(NB)]
  const int hk = blockIdx.x, b = blockIdx.y;
  if (blockIdx.z == 0) {
    const int nb = clamp_count(ld_index(a.nblk, b, a.nblk64), a.NB);
    select_row_tail<kWalks>(a, b, hk, nb, s_key);
  } else {
    predict_row(p, hk, b, s_key);
  }
}

}  // namespace

template <typename S, bool Loop>
cudaError_t scores_launch(const QuestArgs& a, dim3 grid, size_t smem, cudaStream_t s) {
  cudaError_t e = set_smem_limit(quest_scores_kernel<S, Loop>, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(quest_scores_kernel<S, Loop>, grid, kQuestWarps * 32, smem, s, a);
  return cudaGetLastError();
}

// The streamed scores kernel's launch where it takes the shape (else false: the caller launches
// quest_scores_kernel): 16-byte pieces with a head's pieces a power of two dividing 32, a bound
// row of at most 8 piece groups, G <= 8, 16-byte aligned summaries; not where
// SGLANG_PRR_SCORES_KERNEL=warp asks for the warp-per-block kernel (a measuring knob, read at
// each launch; a captured graph keeps its kernel). One wave: as many CTAs as fit the SMs, shared
// by the requests; SGLANG_PRR_SELECT_GRID=N (a test knob) caps a request's CTAs at N.
std::atomic<int64_t> g_stream_scores_launches{0};

template <typename S, int PH>
cudaError_t stream_scores_launch(const QuestArgs& a, int groups, cudaStream_t s) {
  auto* kernel = quest_scores_stream_kernel<S, PH>;
  const int runs = kStreamThreads / 32 / groups, threads = runs * groups * 32;
  const size_t smem = (size_t)threads / 32 * kStreamStages * 2 * 32 * kStreamPieceBytes;
  cudaError_t e = set_smem_limit(kernel, smem);
  int per_sm = 0;
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  const int sms = device_shape().sms;
  if (e != cudaSuccess || per_sm <= 0 || sms <= 0)
    return e != cudaSuccess ? e : cudaErrorInvalidConfiguration;
  int64_t gx = (int64_t)sms * per_sm / a.B;  // rounded down: a CTA past the wave would run alone
  gx = std::min<int64_t>(gx, (a.NB + runs - 1) / runs);
  const char* cap = getenv("SGLANG_PRR_SELECT_GRID");
  if (cap && atoi(cap) > 0) gx = std::min<int64_t>(gx, atoi(cap));
  launch_kernel(kernel, dim3((unsigned)std::max<int64_t>(gx, 1), a.B), threads, smem, s, a,
                groups);
  e = cudaGetLastError();
  g_stream_scores_launches += e == cudaSuccess;
  return e;
}

template <typename S>
bool try_stream_scores(const QuestArgs& a, cudaStream_t s, cudaError_t* err) {
  const char* k = getenv("SGLANG_PRR_SCORES_KERNEL");
  if (k && !strcmp(k, "warp")) return false;
  constexpr int V = kStreamPieceBytes / sizeof(S);
  if (a.D % V != 0) return false;
  const int PH = a.D / V, G = a.Hq / a.Hk;
  if (PH > 32 || 32 % PH != 0 || G > kMaxGroup) return false;
  const int groups = (a.Hk * PH + 31) / 32;
  if (groups > kStreamThreads / 32) return false;
  if (reinterpret_cast<uintptr_t>(a.kmin) % 16 || reinterpret_cast<uintptr_t>(a.kmax) % 16)
    return false;
  if (a.num_pages >= INT_MAX) return false;
  *err = PH == 8    ? stream_scores_launch<S, 8>(a, groups, s)
         : PH == 16 ? stream_scores_launch<S, 16>(a, groups, s)
                    : stream_scores_launch<S, 32>(a, groups, s);  // PH is 8, 16 or 32 here
  return true;
}

int64_t scores_stream_launches() { return g_stream_scores_launches.load(); }

cudaError_t launch_quest_scores(const QuestArgs& a, cudaStream_t s) {
  if (a.D % 8 != 0 || a.Hq % a.Hk != 0) return cudaErrorInvalidValue;
  if (a.B == 0 || a.NB == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  if (a.s_dtype == kBF16 ? try_stream_scores<__nv_bfloat16>(a, s, &err)
                         : try_stream_scores<float>(a, s, &err))
    return err;
  const size_t smem = (size_t)a.Hq * a.D * sizeof(float);
  // 256-thread CTAs: 8 an SM by threads.
  const int units = (a.NB + kQuestWarps - 1) / kQuestWarps;
  const dim3 grid(select_grid_x(a.B, units, 8, true), a.B);
  const bool loop = (int)grid.x < units;
  if (a.s_dtype == kBF16)
    return loop ? scores_launch<__nv_bfloat16, true>(a, grid, smem, s)
                : scores_launch<__nv_bfloat16, false>(a, grid, smem, s);
  return loop ? scores_launch<float, true>(a, grid, smem, s)
              : scores_launch<float, false>(a, grid, smem, s);
}

int max_topk_blocks() { return kTopkMaxBlocks; }

cudaError_t launch_select_topk(const TopkArgs& a, cudaStream_t s) {
  if (a.NB > kTopkMaxBlocks) return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0) return cudaSuccess;
  const size_t smem = (size_t)(a.NB > 0 ? a.NB : 1) * sizeof(uint32_t);
  cudaError_t e = set_smem_limit(select_topk_kernel, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(select_topk_kernel, dim3(a.Hk, a.B), kTopkThreads, smem, s, a);
  return cudaGetLastError();
}

int max_select_group_dim() { return 48 * 1024 / 4; }

cudaError_t launch_quest_select_rowtail(const SelectArgs& a, cudaStream_t s) {
  if ((a.Hq / a.Hk) * a.D > max_select_group_dim()) return cudaErrorInvalidValue;
  const size_t smem = std::max((size_t)row_tail_words(a.NB), (size_t)(a.Hq / a.Hk) * a.D) * 4;
  dim3 grid(a.Hk, (a.NB + kSelChunk - 1) / kSelChunk, a.B);
  cudaError_t e;
  if (a.s_dtype == kBF16) {
    e = set_smem_limit(quest_select_kernel<__nv_bfloat16>, smem);
    if (e != cudaSuccess) return e;
    launch_kernel(quest_select_kernel<__nv_bfloat16>, grid, kSelThreads, smem, s, a);
  } else {
    e = set_smem_limit(quest_select_kernel<float>, smem);
    if (e != cudaSuccess) return e;
    launch_kernel(quest_select_kernel<float>, grid, kSelThreads, smem, s, a);
  }
  return cudaGetLastError();
}

cudaError_t launch_quest_select_split(const SelectArgs& a, cudaStream_t s) {
  QuestArgs q{};
  q.q = a.q; q.q_dtype = a.q_dtype; q.q_stride = a.q_stride;
  q.kmin = a.kmin; q.kmax = a.kmax; q.s_dtype = a.s_dtype;
  q.table = a.table; q.table64 = a.table64; q.table_stride = a.table_stride;
  q.num_pages = a.num_pages;
  q.nblk = a.nblk; q.nblk64 = a.nblk64;
  q.out = a.scores;
  q.B = a.B; q.Hq = a.Hq; q.Hk = a.Hk; q.NB = a.NB; q.D = a.D;
  q.new_k = a.new_k; q.new_k_dtype = a.new_k_dtype; q.new_k_stride = a.new_k_stride;
  q.new_pos = a.new_pos; q.new_pos64 = a.new_pos64; q.page_size = a.page_size;
  q.new_loc = a.new_loc; q.new_loc64 = a.new_loc64; q.w_kmin = a.w_kmin; q.w_kmax = a.w_kmax;
  cudaError_t e = launch_quest_scores(q, s);
  if (e != cudaSuccess) return e;
  return launch_select_lists(a, s);
}

namespace {
// One launch of a rows kernel (a CTA a row: its top-K by warp walks, or by CTA scans where
// SGLANG_PRR_TOPK=scan asks, a measuring knob read at each launch) over `grid`.
template <typename... A>
cudaError_t launch_rows(void (*walks)(A...), void (*scan)(A...), int NB, dim3 grid,
                        cudaStream_t s, const A&... args) {
  const size_t smem = (size_t)std::max(row_tail_words(NB), 1) * sizeof(uint32_t);
  const char* topk = getenv("SGLANG_PRR_TOPK");
  auto* kernel = topk && !strcmp(topk, "scan") ? scan : walks;
  cudaError_t e = set_smem_limit(kernel, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(kernel, grid, kSelThreads, smem, s, args...);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_select_lists(const SelectArgs& a, cudaStream_t s) {
  if (a.NB > kTopkMaxBlocks) return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0) return cudaSuccess;
  return launch_rows(select_rows_kernel<true>, select_rows_kernel<false>, a.NB,
                     dim3(a.Hk, a.B), s, a);
}

cudaError_t launch_select_lists_predict(const SelectArgs& a, const PredictArgs& p,
                                        cudaStream_t s) {
  if (a.NB > kTopkMaxBlocks || p.NB != a.NB || p.B != a.B || p.Hk != a.Hk)
    return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0) return cudaSuccess;
  return launch_rows(select_predict_rows_kernel<true>, select_predict_rows_kernel<false>, a.NB,
                     dim3(a.Hk, a.B, 2), s, a, p);
}

}  // namespace prr
