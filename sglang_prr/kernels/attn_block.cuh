// Sparse attention's block partial on SM90 (attention.cu's kernels): the shape of the work, the
// K/V chunk copy, q's 16-bit parts, one chunk's MMAs and online softmax, and the warps' combine.
// Every launch computes a block's partial with these functions, so a block's (o, lse) has the
// same bits whichever pass or launch computes it.
#pragma once
#include "prr_kernels.h"
#include "common.cuh"
#include "probe.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/swizzle.hpp>

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

// ============================================================================ timing probe
// The attention's links (probe.cuh's slots 0-2 and 9-11 are the entry, exit and id).
enum AttnLink {
  kTlLists = 3,  // the list's round trip and the repeat check's barrier
  kTlIssued,     // the page's round trip: the first chunk's K/V copies issued
  kTlKv,         // the first chunk's K/V in shared memory
  kTlPartial,    // the block's partial written
  kTlArrival,    // the merge's ticket taken (a CTA that merges or arrives at the spread barrier)
  kTlRows,       // the entries sorted and the barrier passed: the rows' merge starts
  kTlMma = 12    // the block's MMAs and online softmax done, every chunk (the partial's first part)
};
static_assert(kTlRows == 8 && kTlMma < kTimelineSlots, "the attention's links fit the record");
// (Slots 13-15 are the selection's: an attention record leaves them 0.)

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> { using Op = cute::SM80_16x8x16_F32BF16BF16F32_TN; };
template <> struct Mma<__half> { using Op = cute::SM80_16x8x16_F32F16F16F32_TN; };

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float x) {
  return __float2bfloat16_rn(x);
}
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

// ============================================================================ block attention
// K/V rows of chunk `ch` of a block (its ntok tokens at `page`, KV head hk) into the stage at
// `kst`: 64 token rows, K then V, cp.async with zero fill past the block's end (a masked row
// must hold finite values: 0 * NaN would poison the P.V sums). The caller fences.
template <typename T, int D>
__device__ __forceinline__ void issue_chunk(const AttnArgs& a, int hk, int64_t page, int ntok,
                                            int ch, unsigned char* kst) {
  using Sw = RowSwizzle<D>;
  constexpr int kPieces = D / 8;  // 16-byte pieces per row
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * a.k_stride_head;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * a.v_stride_head;
  const int64_t slot0 = page * a.page_size;
  unsigned char* vst = kst + kChunk * D * 2;
  // Rolled: cp.async does not wait, so a rolled loop keeps every copy of the chunk in flight
  // while the kernel's code (fetched cold in the server) holds one copy of the body, not 8.
#pragma unroll 1
  for (int p = threadIdx.x; p < kChunk * kPieces; p += kAttnThreads) {
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
}

// q of the group of KV head hk of request b in nq 16-bit parts (heads >= G are zero) into s_q
// ([nq][8][kQRow]): 8 values a thread, every load in flight at once.
template <typename T, int D>
__device__ __forceinline__ void stage_q(const AttnArgs& a, int b, int hk, int nq, T* s_q) {
  constexpr int kQRow = AttnSmem<T, D>::kQRow;
  const int G = a.Hq / a.Hk;
  for (int e = threadIdx.x * 8; e < kHeadsN * D; e += kAttnThreads * 8) {
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
}

// A warp's online-softmax state over its token slices: query head g = lane / 4 (m, l) and its
// O^T fragments (heads 2 (lane % 4) and 2 (lane % 4) + 1).
template <int D>
struct WarpState {
  float m_run = -INFINITY, l_run = 0.f;
  float o[D / 16][4] = {};
};

// Chunk `ch` of a block (ntok tokens), staged at `kst`, into the warp's state: S = Q K^T over the
// warp's 16 tokens, the online softmax, O^T += V^T P^T. Called by every thread; no barrier.
template <typename T, int D>
__device__ __forceinline__ void chunk_step(const AttnArgs& a, const unsigned char* kst, int ch,
                                           int ntok, const T* s_q, int nq, WarpState<D>& w) {
  using Sw = RowSwizzle<D>;
  using Op = typename Mma<T>::Op;
  constexpr int kQRow = AttnSmem<T, D>::kQRow;
  constexpr int kMT = D / 16;  // m-tiles of O^T
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int tb = warp * kSlice;  // the warp's first token in the chunk
  if (ch * kChunk + tb >= ntok) return;
  const float qs = a.sm_scale * kLog2e;
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
  const float m_new = fmaxf(w.m_run, mx);
  const float m_use = m_new == -INFINITY ? 0.f : m_new;
  const float alpha = exp2f(w.m_run - m_use);  // m_run = -inf -> 0
  float pr[2][2], ps = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) { pr[j][e] = exp2f(x[j][e] - m_use); ps += pr[j][e]; }
  }
  ps += __shfl_xor_sync(0xffffffffu, ps, 1);
  ps += __shfl_xor_sync(0xffffffffu, ps, 2);
  w.l_run = w.l_run * alpha + ps;
  w.m_run = m_new;
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
    float* o = w.o[mt];
    o[0] *= a0; o[1] *= a1; o[2] *= a0; o[3] *= a1;
    uint32_t v0, v1, v2, v3;
    const int vr = tb + (lane & 7) + ((lane >> 4) & 1) * 8;
    const unsigned char* src = vst + Sw::off(vr, mt * 2 + ((lane >> 3) & 1));
    cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(src), v0, v1, v2,
                                  v3);
    Op::fma(o[0], o[1], o[2], o[3], v0, v1, v2, v3, ph0, ph1, o[0], o[1], o[2], o[3]);
    Op::fma(o[0], o[1], o[2], o[3], v0, v1, v2, v3, pl0, pl1, o[0], o[1], o[2], o[3]);
  }
}

// Every warp's state to shared memory for a combine: (m, l) of query head g at m[warp][g] /
// l[warp][g] (the returned arrays) and its O^T fragments at s_o ([warps][8][D] floats). Ends with
// a barrier. Called by every thread of the CTA.
struct WarpSums { float (*m)[kHeadsN]; float (*l)[kHeadsN]; };
template <int D>
__device__ __forceinline__ WarpSums stage_warp_states(const WarpState<D>& w, float* s_o) {
  constexpr int kMT = D / 16;
  __shared__ float s_m[kAttnWarps][kHeadsN], s_l[kAttnWarps][kHeadsN];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  if (t4 == 0) { s_m[warp][g] = w.m_run; s_l[warp][g] = w.l_run; }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int d = mt * 16 + g;
    s_o[(warp * kHeadsN + 2 * t4) * D + d] = w.o[mt][0];
    s_o[(warp * kHeadsN + 2 * t4 + 1) * D + d] = w.o[mt][1];
    s_o[(warp * kHeadsN + 2 * t4) * D + d + 8] = w.o[mt][2];
    s_o[(warp * kHeadsN + 2 * t4 + 1) * D + d + 8] = w.o[mt][3];
  }
  __syncthreads();
  return {s_m, s_l};
}

// The warps' states combined (warp order: a fixed order) into the block's partial of the G query
// heads: head h's D values at dst_o + h * o_head, its natural-log lse at dst_lse[h * lse_head]
// (global memory or shared). `s_o` ([warps][8][D] floats) is scratch; the caller's barrier
// orders its last reads of what s_o aliases before this. Called by every thread of the CTA.
template <int D>
__device__ __forceinline__ void block_combine(const WarpState<D>& w, int G, float* s_o,
                                              float* dst_o, int64_t o_head, float* dst_lse,
                                              int64_t lse_head) {
  const WarpSums ws = stage_warp_states<D>(w, s_o);
  const auto s_m = ws.m;
  const auto s_l = ws.l;
  const int tid = threadIdx.x;
  for (int e = tid; e < G * D; e += kAttnThreads) {
    const int h = e / D, d = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int v = 0; v < kAttnWarps; ++v) M = fmaxf(M, s_m[v][h]);
    float lsum = 0.f, acc = 0.f;
#pragma unroll
    for (int v = 0; v < kAttnWarps; ++v) {
      const float sc = exp2f(s_m[v][h] - M);  // a warp without tokens: -inf -> 0
      lsum = fmaf(s_l[v][h], sc, lsum);
      acc = fmaf(s_o[(v * kHeadsN + h) * D + d], sc, acc);
    }
    const bool any = lsum > 0.f;
    dst_o[h * o_head + d] = any ? acc / lsum : 0.f;
    if (d == 0) dst_lse[h * lse_head] = any ? (M + log2f(lsum)) * kLn2 : -INFINITY;
  }
}

// The partial (o, lse) of listed entry n (its ntok tokens at `page`) for the G query heads of KV
// head hk of request b, into a.o / a.lse: the block's chunks through a two-stage cp.async ring.
// Called by every thread of the CTA.
template <typename T, int D>
__device__ __forceinline__ void block_partial(const AttnArgs& a, int b, int hk, int n,
                                              int64_t row0, int64_t page, int ntok, int nq,
                                              unsigned char* s_dyn) {
  const int nch = (ntok + kChunk - 1) / kChunk;
  const int stages = a.page_size > kChunk ? 2 : 1;
  auto stage = [&](int st) { return s_dyn + st * AttnSmem<T, D>::kStageBytes; };
  issue_chunk<T, D>(a, hk, page, ntok, 0, stage(0));
  cute::cp_async_fence();
  stamp(a, kTlIssued);
  T* s_q = reinterpret_cast<T*>(stage(stages));  // [nq][8][kQRow], after the stages
  stage_q<T, D>(a, b, hk, nq, s_q);
  WarpState<D> w;
  for (int ch = 0; ch < nch; ++ch) {
    const int st = stages == 2 ? (ch & 1) : 0;
    if (ch + 1 < nch) {
      issue_chunk<T, D>(a, hk, page, ntok, ch + 1, stage(st ^ 1));
      cute::cp_async_fence();
      cute::cp_async_wait<1>();
    } else {
      cute::cp_async_wait<0>();
    }
    __syncthreads();
    if (ch == 0) stamp(a, kTlKv);
    chunk_step<T, D>(a, stage(st), ch, ntok, s_q, nq, w);
    __syncthreads();  // this stage is refilled two chunks later
  }
  stamp(a, kTlMma);
  // The combine's scratch aliases the K/V stages (read up to the barrier above).
  block_combine<D>(w, a.Hq / a.Hk, reinterpret_cast<float*>(s_dyn),
                   a.o + (row0 * a.N + n) * D, (int64_t)a.N * D, a.lse + row0 * a.N + n, a.N);
  stamp(a, kTlPartial);
}

// ============================================================================ packed small pages
// Pages of 16 or 32 tokens (SGLANG_PRR_ATTN_PACK=1): a CTA computes P = 64 / page list entries,
// entry j taking rows [j * page, (j + 1) * page) of the one chunk, so the warps whose 16-token
// slices fall there compute its partial and block_combine_packed combines those warps alone.
// The bits are the one-entry CTA's: there the other warps hold no tokens (m = -inf, l = 0, o = 0),
// whose terms in block_combine's fixed-order sums add exact zeros (the sums start at +0 and never
// become -0; a max of -inf changes nothing; a NaN or -inf max leaves no positive sum either way,
// so both write the empty state), and a warp's own state sees the same values in the same order.
constexpr int kMaxPack = kChunk / kSlice;  // entries a CTA at most: one a warp

// Entry j's value of a register array indexed by a runtime j, by compares (no local memory).
template <typename V>
__device__ __forceinline__ V pick(const V (&x)[kMaxPack], int j) {
  V r = x[0];
#pragma unroll
  for (int i = 1; i < kMaxPack; ++i) r = i == j ? x[i] : r;
  return r;
}

// The one chunk of P packed entries (entry j: ntok[j] tokens from slot slot0[j]; 0 tokens: zero
// rows) into the stage at `kst`, as issue_chunk does for one entry. The caller fences.
template <typename T, int D>
__device__ __forceinline__ void issue_packed_chunk(const AttnArgs& a, int hk,
                                                   const int64_t (&slot0)[kMaxPack],
                                                   const int (&ntok)[kMaxPack],
                                                   unsigned char* kst) {
  using Sw = RowSwizzle<D>;
  constexpr int kPieces = D / 8;
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * a.k_stride_head;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * a.v_stride_head;
  unsigned char* vst = kst + kChunk * D * 2;
  const int sh = __ffs(a.page_size) - 1;  // pages of 16 or 32 tokens: a power of two
#pragma unroll 1
  for (int p = threadIdx.x; p < kChunk * kPieces; p += kAttnThreads) {
    const int r = p / kPieces, pc = p % kPieces;
    const int j = r >> sh, t = r & (a.page_size - 1);
    const bool ok = t < pick(ntok, j);
    const int64_t slot = pick(slot0, j) + (ok ? t : 0);
    const uint32_t so = Sw::off(r, pc);
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
        *reinterpret_cast<const uint4*>(kg + slot * a.k_stride_slot + pc * 8),
        *reinterpret_cast<uint4*>(kst + so), ok);
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
        *reinterpret_cast<const uint4*>(vg + slot * a.v_stride_slot + pc * 8),
        *reinterpret_cast<uint4*>(vst + so), ok);
  }
}

// The warps' states combined per packed entry (entry j: warps [j W, j W + W), W = 4 / P, in
// warp order) into the partials of entries n0 + j that hold tokens (ntok[j] > 0), as
// block_combine writes one entry's. Called by every thread of the CTA.
template <int D>
__device__ __forceinline__ void block_combine_packed(const AttnArgs& a, const WarpState<D>& w,
                                                     int P, int64_t row0, int n0,
                                                     const int (&ntok)[kMaxPack], float* s_o) {
  const WarpSums ws = stage_warp_states<D>(w, s_o);
  const auto s_m = ws.m;
  const auto s_l = ws.l;
  const int tid = threadIdx.x, G = a.Hq / a.Hk, W = kAttnWarps / P;
  for (int e = tid; e < P * G * D; e += kAttnThreads) {
    const int j = e / (G * D), h = (e / D) % G, d = e % D;
    if (pick(ntok, j) == 0) continue;
    float M = -INFINITY;
    for (int v = j * W; v < j * W + W; ++v) M = fmaxf(M, s_m[v][h]);
    float lsum = 0.f, acc = 0.f;
    for (int v = j * W; v < j * W + W; ++v) {
      const float sc = exp2f(s_m[v][h] - M);
      lsum = fmaf(s_l[v][h], sc, lsum);
      acc = fmaf(s_o[(v * kHeadsN + h) * D + d], sc, acc);
    }
    const bool any = lsum > 0.f;
    const int64_t r = (row0 + h) * a.N + n0 + j;
    a.o[r * D + d] = any ? acc / lsum : 0.f;
    if (d == 0) a.lse[r] = any ? (M + log2f(lsum)) * kLn2 : -INFINITY;
  }
}

// The partials of a CTA's packed entries (entry j: ntok[j] tokens from slot slot0[j]; none where
// 0) into a.o / a.lse at entries n0 + j. Called by every thread of the CTA.
template <typename T, int D>
__device__ __forceinline__ void packed_partials(const AttnArgs& a, int b, int hk, int n0, int P,
                                                int64_t row0, const int64_t (&slot0)[kMaxPack],
                                                const int (&ntok)[kMaxPack], int nq,
                                                unsigned char* s_dyn) {
  issue_packed_chunk<T, D>(a, hk, slot0, ntok, s_dyn);
  cute::cp_async_fence();
  stamp(a, kTlIssued);
  T* s_q = reinterpret_cast<T*>(s_dyn + AttnSmem<T, D>::kStageBytes);  // after the one stage
  stage_q<T, D>(a, b, hk, nq, s_q);
  cute::cp_async_wait<0>();
  __syncthreads();
  stamp(a, kTlKv);
  // The warp's entry and its count as chunk_step reads them (tokens counted from the chunk's
  // start: entry j's rows begin at j * page).
  const int jw = (threadIdx.x / 32) * kSlice / a.page_size;
  WarpState<D> w;
  chunk_step<T, D>(a, s_dyn, 0, pick(ntok, jw) + jw * a.page_size, s_q, nq, w);
  __syncthreads();  // the combine's scratch aliases the stage
  stamp(a, kTlMma);
  block_combine_packed<D>(a, w, P, row0, n0, ntok, reinterpret_cast<float*>(s_dyn));
  stamp(a, kTlPartial);
}

}  // namespace
}  // namespace prr
