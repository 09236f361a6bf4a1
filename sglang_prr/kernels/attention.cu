// Sparse attention over listed KV pages on SM90 (H100/H200), built on CuTe's SM80 MMA and copy
// atoms: per-block (o, lse) partials, and the merge of a (request, KV head) group by the last CTA
// of the group (serial DSA's attention over A; PRR's speculative pass over P and its repair over
// M merged into exactly A).
//
// Exactness by construction. Every block's partial is computed by the same code whichever pass
// reads it (serial, speculative or repair: the launch only changes where the partial is written),
// and the merge visits the kept partials in one fixed order, ascending block id. So PRR (exact)
// gives serial DSA's output bits, not only its value, for any prediction.
//
// Every kernel is graph-safe: static launch shapes, device-side counts, no host reads.
#include "prr_kernels.h"
#include "common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_scan.cuh>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/swizzle.hpp>
#include <algorithm>
#include <climits>
#include <cstring>
#include <cmath>

namespace prr {
namespace {

// ============================================================================ shape of the work
// One CTA per (listed block n, KV head hk, request b), 4 warps. A block (= one KV page) is read
// in chunks of 64 tokens; warp w owns tokens [16 w, 16 w + 16) of each chunk, which is the k of
// its P.V MMA. The G <= 8 query heads of the group are the n = 8 of the MMAs, so K and V are read
// once for the whole group:
//   S   = Q K^T : m16n8k16, A = Q (rows: heads, 8 of 16 used), B = K^T (ldmatrix of K rows)
//   O^T = V^T P^T: m16n8k16, A = V^T (ldmatrix.trans of V rows), B = P^T (S's C fragment as is)
// The operands are 16-bit. Where q is not in the KV dtype it is split into 2-3 16-bit parts
// (q = q0 + q1 + q2), and the probabilities P into two (p = p0 + p1), so the tensor cores keep
// float32 accuracy (|error| ~ 2^-17 relative) at a few extra MMAs, which cost nothing here: the
// kernel waits on memory.
constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kSlice = 16;                       // tokens per warp per chunk
constexpr int kChunk = kAttnWarps * kSlice;      // tokens per chunk
constexpr int kHeadsN = 8;                       // the MMA's n: query heads of a group
// Dynamic shared memory a fused-merge launch may take for the merge tail's row stage: 4 CTAs of
// 128 threads (the attention's register-bound occupancy) still fit an SM's 228 KiB.
constexpr size_t kMergeSmemBudget = 52 * 1024;

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> { using Op = cute::SM80_16x8x16_F32BF16BF16F32_TN; };
template <> struct Mma<__half> { using Op = cute::SM80_16x8x16_F32F16F16F32_TN; };

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }

// Two floats as one 32-bit register of two 16-bit values (x in the low half), and the residuals
// x - (float)hi for the second part.
template <typename T>
__device__ __forceinline__ uint32_t pack_split(float x, float y, float& rx, float& ry) {
  const T hx = from_f<T>(x), hy = from_f<T>(y);
  rx = x - to_f(hx);
  ry = y - to_f(hy);
  const uint32_t lo = *reinterpret_cast<const uint16_t*>(&hx);
  const uint32_t hi = *reinterpret_cast<const uint16_t*>(&hy);
  return lo | (hi << 16);
}

// Shared-memory rows of D 16-bit values (D * 2 bytes), XOR-swizzled in 16-byte pieces so that
// the 8 rows an ldmatrix phase reads, and the rows cp.async writes, fall in distinct banks.
template <int D>
struct RowSwizzle {
  static constexpr int kRowBytes = D * 2;
  static constexpr int kShift = kRowBytes == 128 ? 3 : (kRowBytes == 256 ? 4 : 5);
  __device__ __forceinline__ static uint32_t off(int row, int piece) {
    return cute::Swizzle<3, 4, kShift>{}(static_cast<uint32_t>(row * kRowBytes + piece * 16));
  }
};

template <typename T, int D>
struct AttnSmem {
  static constexpr int kStageBytes = 2 * kChunk * D * 2;  // K and V rows of one chunk
  static constexpr int kQRow = D + 8;                     // padded: conflict-free fragment loads
};

// ============================================================================ fixed-order merge
// The last CTA of a (b, hk) group merges, for the G query heads, the kept partials of this
// launch's list and of the optional first source (the speculative partials over P: exact keeps
// P n A, union all of P; a repeated id of a list counts once) in ascending block id, with the
// speculative entry before the repair entry of the same id. The order, the max and the sums are
// the same for any split of A between P and M, so the output bits are too. Natural-log lse, as
// every state of the ops. Called by every thread of the group's `group` CTAs.

// Bytes of the merge's arrays (its lists, keys, entries and weights: the bytes
// dispatch.attn_merge_smem checks) rounded up to 16, so that a row stage after them is aligned.
__host__ __device__ __forceinline__ size_t merge_arrays_bytes(int N, int N1, int Na, int G) {
  const size_t E = (size_t)N + N1;
  return (((size_t)N + N1 + Na + 3 * E) * sizeof(int) + (size_t)G * E * sizeof(float) + 15) &
         ~(size_t)15;
}

// The merge's inputs a CTA loads (a list entry per thread): counts, lists, the request's length.
struct MergeLoads {
  int64_t sl;
  int c2_raw, pc_raw, ca_raw, x_list, x_p, x_a;
};

// The shape of the merge's sources for this launch.
struct MergeShape {
  int G, N, N1, Na, E;
  bool filt;
  __device__ __forceinline__ explicit MergeShape(const AttnArgs& a)
      : G(a.Hq / a.Hk), N(a.N), N1(a.o1 ? a.N1 : 0),
        Na((a.o1 && a.N1 > 0 && a.p_idx != nullptr && a.p_exact) ? a.Na : 0),
        E(a.N + (a.o1 ? a.N1 : 0)), filt(a.o1 && a.N1 > 0 && a.p_idx != nullptr) {}
};

// The merge's arrays in shared memory (merge_arrays_bytes counts them): the three lists, the
// kept entries' keys, the entries, the entries sorted, then the weights.
struct MergeArrays {
  int* list;  // [N]   this launch's ids
  int* p;     // [N1]  P's ids
  int* a;     // [Na]  A's ids
  int* key;   // [E]   kept entries' sort keys
  int* ent;   // [E]   kept entries: position << 1 | source
  int* srt;   // [E]   the same, sorted by key
  float* w;   // [G, E] weights
  __device__ __forceinline__ MergeArrays(unsigned char* smem, const MergeShape& m)
      : list(reinterpret_cast<int*>(smem)), p(list + m.N), a(p + m.N1), key(a + m.Na),
        ent(key + m.E), srt(ent + m.E), w(reinterpret_cast<float*>(srt + m.E)) {}
};

// The counts and lists are the launch's inputs, not the group's results, so a CTA may load them
// before its ticket (or before its attention): their copies then arrive with the ticket instead
// of one round trip after it (a few hundred bytes of L2 hits per CTA).
__device__ __forceinline__ MergeLoads merge_loads(const AttnArgs& a, int b, int hk) {
  const MergeShape m(a);
  const int tid = threadIdx.x;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, b) * a.Hk + hk;
  const int64_t prow = slot_of(a.p_rows, a.p_rows64, b) * a.Hk + hk;
  MergeLoads l;
  l.sl = ld_index(a.seq_lens, b, a.seq64);
  l.c2_raw = a.cnt[lrow];
  l.pc_raw = m.filt ? a.p_cnt[prow] : m.N1;
  l.ca_raw = m.Na ? a.a_cnt[row] : 0;
  l.x_list = tid < m.N ? a.idx[lrow * m.N + tid] : 0;
  l.x_p = (m.filt && tid < m.N1) ? a.p_idx[prow * m.N1 + tid] : 0;
  l.x_a = tid < m.Na ? a.a_idx[row * m.Na + tid] : 0;
  return l;
}

// The kept entries of the merge in ascending block id (s_srt, returned: how many), from the
// loaded inputs, into the merge arrays at `smem`. Called by every thread of the CTA.
__device__ int merge_entries(const AttnArgs& a, int b, int hk, const MergeLoads& l,
                             unsigned char* smem) {
  const MergeShape m(a);
  const int N = m.N, N1 = m.N1, Na = m.Na, E = m.E;
  const bool filt = m.filt;
  const int tid = threadIdx.x;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, b) * a.Hk + hk;
  const int64_t prow = slot_of(a.p_rows, a.p_rows64, b) * a.Hk + hk;
  const int64_t sl = l.sl;
  const int c2_raw = l.c2_raw, pc_raw = l.pc_raw, ca_raw = l.ca_raw;
  const int x_list = l.x_list, x_p = l.x_p, x_a = l.x_a;
  using Scan = cub::BlockScan<int, kAttnThreads>;
  __shared__ typename Scan::TempStorage s_scan;
  const MergeArrays arr(smem, m);
  int* const s_list = arr.list;
  int* const s_p = arr.p;
  int* const s_a = arr.a;
  int* const s_key = arr.key;
  int* const s_ent = arr.ent;
  int* const s_srt = arr.srt;

  const int c2 = clamp_count(c2_raw, N);
  const int pc = filt ? clamp_count(pc_raw, N1) : N1;
  const int ca = Na ? clamp_count(ca_raw, Na) : 0;
  if (tid < N) s_list[tid] = x_list;
  if (filt && tid < N1) s_p[tid] = x_p;
  if (tid < Na) s_a[tid] = x_a;
  // Entries past the first kAttnThreads (rows that select every block of a long context): the
  // three lists' loads of a round go out together, then their stores.
#pragma unroll 1
  for (int i = tid + kAttnThreads; i < N || (filt && i < N1) || i < Na; i += kAttnThreads) {
    const int y0 = i < N ? a.idx[lrow * N + i] : 0;
    const int y1 = (filt && i < N1) ? a.p_idx[prow * N1 + i] : 0;
    const int y2 = i < Na ? a.a_idx[row * Na + i] : 0;
    if (i < N) s_list[i] = y0;
    if (filt && i < N1) s_p[i] = y1;
    if (i < Na) s_a[i] = y2;
  }
  __syncthreads();
  // A block is kept only if it holds tokens of the request; others have the state (0, -inf),
  // which would add exact zeros.
  auto has_tokens = [&](int id) {
    return id >= 0 && id < a.NB && (int64_t)id * a.page_size < sl;
  };
  // Keys: P's entry of block x sorts as 2x, this launch's as 2x + 1; without P's ids (union
  // with no list) the first source's entries come first, in their order.
  int pos_base = 0;
#pragma unroll 1
  for (int e0 = 0; e0 < E; e0 += kAttnThreads) {
    const int e = e0 + tid;
    int keep = 0, key = 0, ent = 0;
    if (e < N1) {
      if (!filt) {
        keep = 1; key = INT_MIN + e;
      } else {
        // Membership tests as independent compares (broadcast reads, many in flight), not
        // early-exit loops whose every step waits on the one before.
        const int x = s_p[e];
        keep = e < pc && has_tokens(x) && !occurs_in(s_p, e, x);  // a repeat counts once
        if (a.p_exact) keep = keep && occurs_in(s_a, ca, x);
        key = 2 * x;
      }
      ent = e << 1;
    } else if (e < E) {
      const int n = e - N1, x = s_list[n];
      keep = n < c2 && has_tokens(x) && !occurs_in(s_list, n, x);
      key = 2 * x + 1;
      ent = (n << 1) | 1;
    }
    int pos, total;
    Scan(s_scan).ExclusiveSum(keep, pos, total);
    if (keep) { s_key[pos_base + pos] = key; s_ent[pos_base + pos] = ent; }
    pos_base += total;
    __syncthreads();
  }
  const int nk = pos_base;
  // Rank sort (keys are distinct): a few hundred entries at most.
#pragma unroll 1
  for (int i = tid; i < nk; i += kAttnThreads) {
    const int k = s_key[i];
    int r = 0, j = 0;
#pragma unroll 1
    for (; j + 8 <= nk; j += 8) {
#pragma unroll
      for (int u = 0; u < 8; ++u) r += s_key[j + u] < k;
    }
#pragma unroll 1
    for (; j < nk; ++j) r += s_key[j] < k;
    s_srt[r] = s_ent[i];
  }
  __syncthreads();
  return nk;
}

// The merge of the sorted entries (nk of them, s_srt in the arrays at `smem`) into out_o /
// out_lse, the partial rows staged at `s_rows` (a.merge_rows entries a round). Called by every
// thread of the group's last CTA.
__device__ void merge_rows(const AttnArgs& a, int b, int hk, unsigned char* smem,
                           float4* s_rows, int nk, int D) {
  const MergeShape m(a);
  const int G = m.G, N = m.N, N1 = m.N1;
  const int tid = threadIdx.x;
  __shared__ float s_msafe[kHeadsN], s_lsum[kHeadsN];
  const MergeArrays arr(smem, m);
  const int* s_srt = arr.srt;
  // The merge in sorted order: lse of every (query head, entry) to shared memory, the max and
  // the weights per head (a warp per head; lane-strided sums, then a fixed xor tree), then a
  // thread per (query head, 4 dims) item sums its weighted rows.
  float* s_w = arr.w;  // [G, E]
  const int64_t r0 = (int64_t)b * a.Hq + (int64_t)hk * G;  // first query head of the group
  // Partial rows go to shared memory by cp.async, a.merge_rows entries of every item a round
  // (the launch sizes them to its shared memory: ~24 rows of 16 bytes in flight a thread, no
  // registers held), and each thread reads back only its own item's rows, so a round needs no
  // barrier. They depend on the sorted entries only: the first round goes out here, beside the
  // lse loads, and the two round trips overlap.
  const int D4 = D / 4, items = G * D4, cap = a.merge_rows;
  auto issue_rows = [&](int e, int i0) {  // rows [i0, i0 + cap) of item e -> s_rows[u][e]
    const int64_t r = r0 + e / D4;
    const float4* src2 = reinterpret_cast<const float4*>(a.o + r * N * D) + e % D4;
    const float4* src1 = reinterpret_cast<const float4*>(a.o1 + r * N1 * D) + e % D4;
#pragma unroll 1
    for (int u = 0; u < cap && i0 + u < nk; ++u) {
      const int ent = s_srt[i0 + u];
      cute::SM80_CP_ASYNC_CACHEGLOBAL<uint4>::copy(
          *reinterpret_cast<const uint4*>(((ent & 1) ? src2 : src1) + (ent >> 1) * D4),
          *reinterpret_cast<uint4*>(s_rows + (size_t)u * items + e));
    }
    cute::cp_async_fence();
  };
  // lse of (query head g, sorted entry i) -> s_w[g * nk + i], kLse loads in flight a thread. The
  // first round goes out before the first round of rows: the weights wait on the lse values,
  // the rows' sums on the weights, so the lse loads must not queue behind the rows.
  // Entry e = g * nk + i; the thread's (g, i) advance by kAttnThreads entries a step (one
  // division per thread, not one per load: the tail runs once per group, its code cold).
  constexpr int kLse = 4;
  float v[kLse];
  const int nk1 = nk > 0 ? nk : 1;
  const int dq = kAttnThreads / nk1, dr = kAttnThreads % nk1;
  int lg = tid / nk1, li = tid % nk1;  // (g, i) of the next entry load_lse reads
  auto load_lse = [&](int e0) {
#pragma unroll
    for (int u = 0; u < kLse; ++u) {
      const int e = e0 + u * kAttnThreads;
      if (e < G * nk) {
        const int ent = s_srt[li], pos = ent >> 1;
        v[u] = (ent & 1) ? __ldcg(a.lse + (r0 + lg) * N + pos)
                         : __ldcg(a.lse1 + (r0 + lg) * N1 + pos);
      }
      li += dr;
      lg += dq;
      if (li >= nk1) { li -= nk1; ++lg; }
    }
  };
  auto store_lse = [&](int e0) {
#pragma unroll
    for (int u = 0; u < kLse; ++u) {
      const int e = e0 + u * kAttnThreads;
      if (e < G * nk) s_w[e] = v[u];
    }
  };
  load_lse(tid);
  if (tid < items) issue_rows(tid, 0);
  store_lse(tid);
#pragma unroll 1
  for (int e0 = tid + kLse * kAttnThreads; e0 < G * nk; e0 += kLse * kAttnThreads) {
    load_lse(e0);
    store_lse(e0);
  }
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  for (int g = warp; g < G; g += kAttnWarps) {
    float* w = s_w + g * nk;
    float mx = -INFINITY;
#pragma unroll 1
    for (int i = lane; i < nk; i += 32) mx = fmaxf(mx, w[i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_safe = (mx == -INFINITY || mx == INFINITY || mx != mx) ? 0.f : mx;
    float ls = 0.f;
#pragma unroll 1
    for (int i = lane; i < nk; i += 32) {
      const float ex = expf(w[i] - m_safe);  // an empty state: exp(-inf) = 0
      w[i] = ex;
      ls += ex;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
    if (lane == 0) { s_msafe[g] = m_safe; s_lsum[g] = ls; }
  }
  __syncthreads();
  if (a.debug_stop == 3) return;  // timing probe: + the lse loads and the weights
  for (int e = tid; e < items; e += kAttnThreads) {
    const int g = e / D4, c = e % D4;
    const int64_t r = r0 + g;
    const float* w = s_w + g * nk;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
    for (int i0 = 0; i0 < nk; i0 += cap) {
      if (e != tid || i0 != 0) issue_rows(e, i0);  // (the first round went out above)
      cute::cp_async_wait<0>();
#pragma unroll 4
      for (int u = 0; u < cap && i0 + u < nk; ++u) {
        const float wt = w[i0 + u];
        float4 y = s_rows[(size_t)u * items + e];
        y.x = y.x != y.x ? 0.f : y.x; y.y = y.y != y.y ? 0.f : y.y;
        y.z = y.z != y.z ? 0.f : y.z; y.w = y.w != y.w ? 0.f : y.w;
        acc.x = fmaf(wt, y.x, acc.x); acc.y = fmaf(wt, y.y, acc.y);
        acc.z = fmaf(wt, y.z, acc.z); acc.w = fmaf(wt, y.w, acc.w);
      }
    }
    const float inv = 1.f / fmaxf(s_lsum[g], 1e-30f);
    acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
    store4_any(a.out_o, r * D + 4 * c, a.out_dtype, acc);
    if (c == 0 && a.out_lse) a.out_lse[r] = s_msafe[g] + logf(s_lsum[g]);
  }
}


// The merge: every CTA loads the inputs and takes its ticket; the group's last CTA sorts the
// entries and merges (arrays at 0, the row stage after them).
__device__ void merge_tail(const AttnArgs& a, int b, int hk, unsigned char* smem, int group,
                           int D) {
  const MergeLoads l = merge_loads(a, b, hk);
  if (!last_of_group(a.sem + (int64_t)b * a.Hk + hk, group)) return;
  if (a.debug_stop == 1) return;  // timing probe: the chain up to the ticket
  const int nk = merge_entries(a, b, hk, l, smem);
  if (a.debug_stop == 2) return;  // timing probe: + the lists and their sort
  const MergeShape m(a);
  merge_rows(a, b, hk, smem,
             reinterpret_cast<float4*>(smem + merge_arrays_bytes(m.N, m.N1, m.Na, m.G)), nk, D);
}

// Whether entry n of `list` repeats an earlier one (counted once). `first` is list[threadIdx.x],
// loaded by the caller beside the count (entries before a listed one are listed too).
__device__ __forceinline__ bool repeats_earlier(const int32_t* list, int n, int blk, int first) {
  int dup = (int)threadIdx.x < n && first == blk;
  for (int j = threadIdx.x + blockDim.x; j < n; j += blockDim.x) dup |= list[j] == blk;
  return __syncthreads_or(dup) != 0;
}

// ============================================================================ block attention
// The partial (o, lse) of listed entry n (its ntok tokens at `page`) for the G query heads of KV
// head hk of request b, into a.o / a.lse. Called by every thread of the CTA.
template <typename T, int D>
__device__ __forceinline__ void block_partial(const AttnArgs& a, int b, int hk, int n,
                                              int64_t row0, int64_t page, int ntok, int nq,
                                              unsigned char* s_dyn) {
  using Sw = RowSwizzle<D>;
  using Op = typename Mma<T>::Op;
  constexpr int kQRow = AttnSmem<T, D>::kQRow;
  constexpr int kPieces = D / 8;  // 16-byte pieces per row
  constexpr int kMT = D / 16;     // m-tiles of O^T
  __shared__ float s_m[kAttnWarps][kHeadsN], s_l[kAttnWarps][kHeadsN];
  const int G = a.Hq / a.Hk;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // K/V of a chunk: rows of 64 tokens, K then V, cp.async with zero fill past the block's end
  // (a masked row must hold finite values: 0 * NaN would poison the P.V sums).
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * a.k_stride_head;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * a.v_stride_head;
  const int64_t slot0 = page * a.page_size;
  const int nch = (ntok + kChunk - 1) / kChunk;
  const int stages = a.page_size > kChunk ? 2 : 1;
  auto issue = [&](int ch, int st) {
    unsigned char* kst = s_dyn + st * AttnSmem<T, D>::kStageBytes;
    unsigned char* vst = kst + kChunk * D * 2;
    // Rolled: cp.async does not wait, so a rolled loop keeps every copy of the chunk in flight
    // while the kernel's code (fetched cold in the server) holds one copy of the body, not 8.
#pragma unroll 1
    for (int p = tid; p < kChunk * kPieces; p += kAttnThreads) {
      const int r = p / kPieces, pc = p % kPieces;
      const int t = ch * kChunk + r;
      const bool ok = t < ntok;
      const int64_t slot = slot0 + (ok ? t : 0);
      const uint32_t so = Sw::off(r, pc);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
          *reinterpret_cast<const uint4*>(kg + slot * a.k_stride_slot + pc * 8),
          *reinterpret_cast<uint4*>(kst + so), ok);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
          *reinterpret_cast<const uint4*>(vg + slot * a.v_stride_slot + pc * 8),
          *reinterpret_cast<uint4*>(vst + so), ok);
    }
    cute::cp_async_fence();
  };
  issue(0, 0);

  // q of the group in nq 16-bit parts (heads >= G are zero) while the first chunk loads: 8
  // values a thread, every load in flight at once.
  T* s_q = reinterpret_cast<T*>(s_dyn + stages * AttnSmem<T, D>::kStageBytes);  // [nq][8][kQRow]
  for (int e = tid * 8; e < kHeadsN * D; e += kAttnThreads * 8) {
    const int h = e / D, d = e % D;
    float x[8];
    if (h < G) {
      load8_any(a.q, b * a.q_stride + ((int64_t)hk * G + h) * D + d, a.q_dtype, x);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.f;
    }
#pragma unroll 1  // nq is 1 but for float32 q: one copy of the body
    for (int p = 0; p < nq; ++p) {
      __align__(16) T part[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        part[i] = from_f<T>(x[i]);
        x[i] -= to_f(part[i]);
      }
      *reinterpret_cast<uint4*>(s_q + (p * kHeadsN + h) * kQRow + d) =
          *reinterpret_cast<const uint4*>(part);
    }
  }

  const int g = lane / 4, t4 = lane % 4;
  const float qs = a.sm_scale * kLog2e;
  float m_run = -INFINITY, l_run = 0.f;  // this warp's softmax state of head g
  float o[kMT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  for (int ch = 0; ch < nch; ++ch) {
    const int st = stages == 2 ? (ch & 1) : 0;
    if (ch + 1 < nch) {
      issue(ch + 1, st ^ 1);
      cute::cp_async_wait<1>();
    } else {
      cute::cp_async_wait<0>();
    }
    __syncthreads();
    const int tb = warp * kSlice;  // the warp's first token in the chunk
    if (ch * kChunk + tb < ntok) {
      const unsigned char* kst = s_dyn + st * AttnSmem<T, D>::kStageBytes;
      const unsigned char* vst = kst + kChunk * D * 2;
      // S = Q K^T over the warp's 16 tokens: two n-tiles of 8 tokens.
      float s[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk) {  // two k-steps of 16 dims per ldmatrix.x4
        uint32_t kb[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const unsigned char* src = kst + Sw::off(tb + 8 * j + (lane & 7), kk * 4 + (lane >> 3));
          cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                                        kb[j][0], kb[j][1], kb[j][2], kb[j][3]);
        }
#pragma unroll 1
        for (int p = 0; p < nq; ++p) {
          const T* qr = s_q + (p * kHeadsN + g) * kQRow + kk * 32 + 2 * t4;
          const uint32_t qa0 = *reinterpret_cast<const uint32_t*>(qr);
          const uint32_t qa2 = *reinterpret_cast<const uint32_t*>(qr + 8);
          const uint32_t qb0 = *reinterpret_cast<const uint32_t*>(qr + 16);
          const uint32_t qb2 = *reinterpret_cast<const uint32_t*>(qr + 24);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            Op::fma(s[j][0], s[j][1], s[j][2], s[j][3], qa0, 0u, qa2, 0u, kb[j][0], kb[j][1],
                    s[j][0], s[j][1], s[j][2], s[j][3]);
            Op::fma(s[j][0], s[j][1], s[j][2], s[j][3], qb0, 0u, qb2, 0u, kb[j][2], kb[j][3],
                    s[j][0], s[j][1], s[j][2], s[j][3]);
          }
        }
      }
      // Online softmax of head g over the slice (the 4 lanes of a quad hold its 16 tokens).
      float x[2][2];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = ch * kChunk + tb + 8 * j + 2 * t4 + e;
          x[j][e] = tok < ntok ? s[j][e] * qs : -INFINITY;
          mx = fmaxf(mx, x[j][e]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run - m_use);  // m_run = -inf -> 0
      float pr[2][2], ps = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) { pr[j][e] = exp2f(x[j][e] - m_use); ps += pr[j][e]; }
      }
      ps += __shfl_xor_sync(0xffffffffu, ps, 1);
      ps += __shfl_xor_sync(0xffffffffu, ps, 2);
      l_run = l_run * alpha + ps;
      m_run = m_new;
      // O^T holds heads 2 t4 and 2 t4 + 1: their rescale factors live in quads 2 t4, 2 t4 + 1.
      const float a0 = __shfl_sync(0xffffffffu, alpha, (2 * t4) * 4);
      const float a1 = __shfl_sync(0xffffffffu, alpha, (2 * t4 + 1) * 4);
      // P^T as the B operand, in two 16-bit parts.
      float r00, r01, r10, r11, u0, u1;
      const uint32_t ph0 = pack_split<T>(pr[0][0], pr[0][1], r00, r01);
      const uint32_t ph1 = pack_split<T>(pr[1][0], pr[1][1], r10, r11);
      const uint32_t pl0 = pack_split<T>(r00, r01, u0, u1);
      const uint32_t pl1 = pack_split<T>(r10, r11, u0, u1);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        o[mt][0] *= a0; o[mt][1] *= a1; o[mt][2] *= a0; o[mt][3] *= a1;
        uint32_t v0, v1, v2, v3;
        const int vr = tb + (lane & 7) + ((lane >> 4) & 1) * 8;
        const unsigned char* src = vst + Sw::off(vr, mt * 2 + ((lane >> 3) & 1));
        cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                                      v0, v1, v2, v3);
        Op::fma(o[mt][0], o[mt][1], o[mt][2], o[mt][3], v0, v1, v2, v3, ph0, ph1,
                o[mt][0], o[mt][1], o[mt][2], o[mt][3]);
        Op::fma(o[mt][0], o[mt][1], o[mt][2], o[mt][3], v0, v1, v2, v3, pl0, pl1,
                o[mt][0], o[mt][1], o[mt][2], o[mt][3]);
      }
    }
    __syncthreads();  // this stage is refilled two chunks later
  }

  // Combine the warps' states (warp order: a fixed order) into the block's partial.
  float* s_o = reinterpret_cast<float*>(s_dyn);  // [warps][8 heads][D], aliases the K/V stages
  if (t4 == 0) { s_m[warp][g] = m_run; s_l[warp][g] = l_run; }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int d = mt * 16 + g;
    s_o[(warp * kHeadsN + 2 * t4) * D + d] = o[mt][0];
    s_o[(warp * kHeadsN + 2 * t4 + 1) * D + d] = o[mt][1];
    s_o[(warp * kHeadsN + 2 * t4) * D + d + 8] = o[mt][2];
    s_o[(warp * kHeadsN + 2 * t4 + 1) * D + d + 8] = o[mt][3];
  }
  __syncthreads();
  for (int e = tid; e < G * D; e += kAttnThreads) {
    const int h = e / D, d = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, s_m[w][h]);
    float lsum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float sc = exp2f(s_m[w][h] - M);  // a warp without tokens: -inf -> 0
      lsum = fmaf(s_l[w][h], sc, lsum);
      acc = fmaf(s_o[(w * kHeadsN + h) * D + d], sc, acc);
    }
    const bool any = lsum > 0.f;
    a.o[((row0 + h) * a.N + n) * D + d] = any ? acc / lsum : 0.f;
    if (d == 0) a.lse[(row0 + h) * a.N + n] = any ? (M + log2f(lsum)) * kLn2 : -INFINITY;
  }
}

// HeadsX: the grid's x runs over KV heads and its y over list entries (launch_partials), else the
// other way round; a template argument, not a branch, so that D = 256 keeps its registers.
template <typename T, int D, bool HeadsX>
__global__ void __launch_bounds__(kAttnThreads)
block_attn_kernel(AttnArgs a, int nq) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(128) unsigned char s_dyn[];  // K/V stages; combine; merge tail

  const int n = HeadsX ? blockIdx.y : blockIdx.x, hk = HeadsX ? blockIdx.x : blockIdx.y;
  const int b = blockIdx.z;
  const int G = a.Hq / a.Hk;
  const int tid = threadIdx.x;
  const int64_t row0 = (int64_t)b * a.Hq + (int64_t)hk * G;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, b) * a.Hk + hk;
  // Every load that needs only the list's row goes out at once (one round trip, not three): the
  // count, this CTA's entry, the request's length and the first earlier entries (the repeat
  // check). The list is as wide as the grid, so entry n exists whatever the count.
  const int32_t* list = a.idx + lrow * a.N;
  const int c = a.cnt[lrow];
  const int blk = list[n];
  const int64_t sl = ld_index(a.seq_lens, b, a.seq64);
  const int earlier = tid < n ? list[tid] : 0;
  // Fused merge: only the listed entries take part (entry 0 alone for an empty list, so the
  // first source is still merged); the CTAs of padding entries exit at once.
  const int parts = max(min(c, a.N), 1);
  if (a.sem && n >= parts) return;
  const bool repeat = repeats_earlier(list, n, blk, earlier);
  int ntok = 0;
  int64_t page = 0;
  if (n < c && !repeat && blk >= 0 && blk < a.NB) {  // ids outside the table are padding
    page = ld_index(a.table, (int64_t)b * a.table_stride + blk, a.table64);
    const int64_t rem = sl - (int64_t)blk * a.page_size;
    ntok = clamp_count(rem, a.page_size);
  }
  if (ntok == 0) {  // padding entry or block past the request: the empty state (0, -inf)
    for (int e = tid; e < G * D; e += kAttnThreads)
      a.o[((row0 + e / D) * a.N + n) * D + e % D] = 0.f;
    if (tid < G) a.lse[(row0 + tid) * a.N + n] = -INFINITY;
  } else {
    block_partial<T, D>(a, b, hk, n, row0, page, ntok, nq, s_dyn);
  }
  // One call site: the merge tail's code is in the kernel once (one CTA of a group runs it,
  // after the others, its instructions cold).
  if (a.sem) merge_tail(a, b, hk, s_dyn, parts, D);  // its first barrier orders the s_o reads
}

// The merge alone, a CTA per (request, KV head) group: the fused tail's code (merge_loads,
// merge_entries, merge_rows) on the partials a block_attn_kernel launch without counters wrote,
// so its output bits are the fused launch's. Launched after that kernel where the merge is split
// off (attn_launch).
__global__ void __launch_bounds__(kAttnThreads)
attn_merge_kernel(AttnArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(128) unsigned char s_dyn[];  // merge arrays, then the row stage
  const int hk = blockIdx.x, b = blockIdx.y;
  const MergeLoads l = merge_loads(a, b, hk);
  const int nk = merge_entries(a, b, hk, l, s_dyn);
  const MergeShape m(a);
  merge_rows(a, b, hk, s_dyn,
             reinterpret_cast<float4*>(s_dyn + merge_arrays_bytes(m.N, m.N1, m.Na, m.G)), nk,
             a.D);
}

// Shared memory a fused-merge CTA may take for the merge tail: kMergeSmemBudget, or, when the
// grid is one wave of at most 3 CTAs an SM (batch 1), a third of an SM's shared memory, so that
// the row stage holds every entry of a K = 32-block merge in one round trip instead of two.
size_t merge_smem_budget(int64_t ctas) {
  const DeviceShape sm = device_shape();
  constexpr int kPerSm = 3;
  constexpr size_t kReserve = 2 * 1024;  // the runtime's CTA reserve and the static arrays
  if (sm.sms <= 0 || ctas > (int64_t)kPerSm * sm.sms) return kMergeSmemBudget;
  return std::max(kMergeSmemBudget, (size_t)sm.smem_per_sm / kPerSm - kReserve);
}

// block_attn_kernel's launch, the KV heads of one list entry in consecutive CTAs: they run
// together and read a page's slots, whose K (V) rows of all heads are adjacent, together (cold
// L2 at 2048 tokens, run 16: 15.7 -> 14.9 us at batch 1, level at batch 8 / 32). The entries of
// one head in consecutive CTAs (each CTA reads a 256-byte row of every 2 KB slot) where
// SGLANG_PRR_ATTN_GRID=entries asks (a measuring knob, read at each launch; a captured graph
// keeps its order) or the list is wider than a grid's y (65535).
template <typename T, int D>
cudaError_t launch_partials(AttnArgs c, int nq, size_t smem, cudaStream_t s) {
  const char* order = getenv("SGLANG_PRR_ATTN_GRID");
  if (c.N <= 65535 && !(order && !strcmp(order, "entries"))) {
    cudaError_t e = set_smem_limit(block_attn_kernel<T, D, true>, smem);
    if (e != cudaSuccess) return e;
    launch_kernel(block_attn_kernel<T, D, true>, dim3(c.Hk, c.N, c.B), kAttnThreads, smem, s, c,
                  nq);
    return cudaGetLastError();
  }
  cudaError_t e = set_smem_limit(block_attn_kernel<T, D, false>, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(block_attn_kernel<T, D, false>, dim3(c.N, c.Hk, c.B), kAttnThreads, smem, s, c,
                nq);
  return cudaGetLastError();
}

// The split merge's shape rule: a partials grid of at least kSplitMergeMinCtas CTAs (about two
// waves of 4 CTAs an SM on 132 SMs; batch 1 at 2048 tokens is 272).
constexpr int64_t kSplitMergeMinCtas = 1024;
bool attn_takes_split_merge(int64_t B, int64_t Hk, int64_t N) {
  return B * Hk * N >= kSplitMergeMinCtas;
}

// The merge kernel's shared memory for its row stage (one CTA per group and few groups, so it
// may take most of an SM: every entry of a K = 2048-token list in one round trip).
constexpr size_t kMergeKernelSmem = 160 * 1024;

template <typename T, int D>
cudaError_t attn_launch(const AttnArgs& a, int nq, cudaStream_t s) {
  const int stages = a.page_size > kChunk ? 2 : 1;
  size_t smem = (size_t)stages * AttnSmem<T, D>::kStageBytes +
                (size_t)nq * kHeadsN * AttnSmem<T, D>::kQRow * sizeof(T);
  AttnArgs c = a;
  // Where the grid is several waves, the partials in one launch without counters, tickets or
  // merge tail (the attention's own shared memory, so 5 CTAs an SM instead of 4), then
  // attn_merge_kernel; else the group's last CTA merges (the fused tail, a launch fewer). Cold L2
  // at 2048 tokens (run 16): 45.6 -> 38.0 us at batch 8 and 138.8 -> 110.9 at batch 32, while a
  // repair over |M| = 1 at batch 1 costs 11.9 fused against 13.1 split.
  // SGLANG_PRR_ATTN_MERGE=split|fused forces one (a measuring knob, read at each launch).
  const char* mk = getenv("SGLANG_PRR_ATTN_MERGE");
  const bool force_split = mk && !strcmp(mk, "split"), force_fused = mk && !strcmp(mk, "fused");
  const bool split_merge =
      a.sem && (force_split || (!force_fused && attn_takes_split_merge(a.B, a.Hk, a.N)));
  if (split_merge) c.sem = nullptr;
  if (a.sem) {
    // The merge tail's row stage: as many entries a round as fit beside its arrays in the larger
    // of the attention's shared memory and merge_smem_budget, at least one, at most every entry
    // (split off: as many as the merge kernel's shared memory takes, at most every entry).
    const int N1 = a.o1 ? a.N1 : 0, G = a.Hq / a.Hk, E = a.N + N1;
    const size_t arrays = merge_arrays_bytes(a.N, N1, a.Na, G);
    const size_t per = (size_t)G * D * sizeof(float);  // one entry's rows of the group
    const size_t budget =
        split_merge ? kMergeKernelSmem
                    : std::max(smem, merge_smem_budget((int64_t)a.B * a.Hk * a.N));
    const size_t fit = budget > arrays ? (budget - arrays) / per : 0;
    c.merge_rows = (int)std::min<size_t>(std::max<size_t>(fit, 1), (size_t)std::max(E, 1));
    const size_t merge_bytes = arrays + (size_t)c.merge_rows * per;
    if (split_merge) {
      cudaError_t e = set_smem_limit(attn_merge_kernel, merge_bytes);
      if (e != cudaSuccess) return e;
      e = launch_partials<T, D>(c, nq, smem, s);
      if (e != cudaSuccess) return e;
      launch_kernel(attn_merge_kernel, dim3(a.Hk, a.B), kAttnThreads, merge_bytes, s, c);
      return cudaGetLastError();
    }
    smem = std::max(smem, merge_bytes);
  }
  return launch_partials<T, D>(c, nq, smem, s);
}

template <typename T>
cudaError_t attn_dispatch_d(const AttnArgs& args, cudaStream_t s) {
  // q in the KV dtype is exact in one part; another 16-bit dtype needs two, float32 three.
  const int nq = args.q_dtype == args.kv_dtype ? 1 : (args.q_dtype == kF32 ? 3 : 2);
  // Timing probes of the merge tail's stages (development only).
  static const int stop = debug_stop_env("SGLANG_PRR_ATTN_DEBUG_STOP");
  AttnArgs a = args;
  a.debug_stop = stop;
  switch (a.D) {
    case 64: return attn_launch<T, 64>(a, nq, s);
    case 128: return attn_launch<T, 128>(a, nq, s);
    case 256: return attn_launch<T, 256>(a, nq, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool launches_with_pdl() { return pdl_enabled(); }

cudaError_t launch_sparse_attn_partials(const AttnArgs& a, cudaStream_t s) {
  if (a.Hq % a.Hk != 0 || a.Hq / a.Hk > kMaxGroup) return cudaErrorInvalidValue;
  if (a.B == 0 || a.N == 0 || a.Hk == 0) return cudaSuccess;
  switch (a.kv_dtype) {
    case kF16: return attn_dispatch_d<__half>(a, s);
    case kBF16: return attn_dispatch_d<__nv_bfloat16>(a, s);
    default: return cudaErrorInvalidValue;  // float32 KV: the reference (see kernels/dispatch.py)
  }
}

}  // namespace prr
