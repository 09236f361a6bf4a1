// CTA-wide top-K over one row of order keys in shared memory: the selection rule of
// reference.select_topk (ties to the lower block id, NaN/-inf ranked as the lowest float) shared by
// the selection, prediction and calibration kernels.
#pragma once
#include <cub/block/block_scan.cuh>
#include <cfloat>
#include <cstdint>

#include "kernel_limits.h"

namespace prr {
namespace {

// ============================================================================ top-K selection
// One CTA per (request, KV head) row. Middle-block scores become order-preserving 32-bit keys
// (0 = not selectable) held in shared memory; the k-th largest key T is found by histograms over
// the keys' range, then blocks above T, and the lowest-id blocks equal to T, are chosen (the
// stable order of the reference). Kept sink/local blocks are added and the set is written as an
// ascending list.
constexpr int kTopkThreads = 512;

__device__ __forceinline__ uint32_t order_key(float s) {
  // The reference ranks NaN and -inf as float32's lowest finite value, +inf as the largest, and
  // treats -0 == +0.
  if (s != s || s == -INFINITY) s = -FLT_MAX;
  if (s == INFINITY) s = FLT_MAX;
  if (s == 0.f) s = 0.f;
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // >= 0x00800000 for finite s
}

// The threshold search's histogram: kTopkBins bins over the candidate keys' range [lo, hi], a
// bin 2^shift keys wide (shift the smallest that fits the range), so a round narrows the range
// by 2^9 at least and a row's scores, whose keys share their sign and most exponent bits, are
// spread over hundreds of bins at once: the k-th key's bin usually holds a few keys, which one
// warp ranks. A radix select by the keys' bytes (four rounds, the first resolving only the
// sign and exponent) spent ~22 barriers a row; this search spends ~8.
constexpr int kTopkBins = 1024;
constexpr int kTopkCand = 32;  // a bin of at most this many keys is ranked by one warp

// Top-K of one row, by the whole CTA. On entry s_key[0..NB) holds the order keys of the
// selectable (middle) blocks and 0 elsewhere, key i written by thread i % THREADS (its first
// pass reads them before any barrier); on exit s_key[i] is 1 for the chosen blocks (the k best
// keys, ties to the lower id) and the kept blocks (id < nb, id < keep_lo or id >= keep_hi), 0
// otherwise. Contains __syncthreads: every thread of the CTA must call it.
template <int THREADS>
__device__ void topk_mask(uint32_t* s_key, int NB, int nb, int k, int keep_lo, int keep_hi) {
  static_assert(THREADS % 32 == 0 && kTopkBins % THREADS == 0, "bins a thread: a whole number");
  constexpr int kWarps = THREADS / 32, kPer = kTopkBins / THREADS;
  __shared__ uint32_t s_hist[kTopkBins];
  __shared__ uint32_t s_wmin[kWarps], s_wmax[kWarps];
  __shared__ int s_wcnt[kWarps];
  __shared__ uint32_t s_cand[kTopkCand];
  __shared__ int s_bin, s_want, s_bcnt, s_ncand, s_rem;
  __shared__ uint32_t s_T;
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ typename Scan::TempStorage s_scan;
  const int tid = threadIdx.x, lane = tid & 31;
  // ---- the selectable keys' count and range (one barrier), the histogram zeroed meanwhile
  int my_mid = 0;
  uint32_t mn = 0xffffffffu, mx = 0u;
  for (int i = tid; i < NB; i += THREADS) {
    const uint32_t key = s_key[i];
    if (key != 0) { ++my_mid; mn = min(mn, key); mx = max(mx, key); }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) s_hist[tid * kPer + j] = 0u;
  if (tid == 0) s_ncand = 0;
  my_mid = __reduce_add_sync(0xffffffffu, my_mid);
  mn = __reduce_min_sync(0xffffffffu, mn);
  mx = __reduce_max_sync(0xffffffffu, mx);
  if (lane == 0) { s_wcnt[tid / 32] = my_mid; s_wmin[tid / 32] = mn; s_wmax[tid / 32] = mx; }
  __syncthreads();
  int nmid = 0;
  uint32_t lo = 0xffffffffu, hi = 0u;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    nmid += s_wcnt[w];
    lo = min(lo, s_wmin[w]);
    hi = max(hi, s_wmax[w]);
  }
  uint32_t T;
  int rem;
  if (k >= nmid) { T = 0; rem = 0; }            // every middle block (keys > 0)
  else if (k <= 0) { T = 0xffffffffu; rem = 0; }  // none
  else {
    // Invariant: the k-th largest key lies in [lo, hi], and is the want-th largest of the keys
    // there (the values are uniform over the CTA: every thread takes the same branches).
    int want = k;
    for (;;) {
      if (lo == hi) { T = lo; rem = want; break; }
      const uint32_t span = hi - lo;
      const int shift = max(0, 32 - __clz(span) - 10);  // span >> shift < kTopkBins (2^10)
      static_assert(kTopkBins == 1024, "the shift above assumes 2^10 bins");
      for (int i = tid; i < NB; i += THREADS) {
        const uint32_t key = s_key[i];
        if (key >= lo && key <= hi && key != 0) {
          const uint32_t bin = (key - lo) >> shift;
          // Keys of one bin (ties, or a narrow range) aggregated into one atomic a warp.
          const unsigned peers = __match_any_sync(__activemask(), bin);
          if (lane == __ffs(peers) - 1) atomicAdd(&s_hist[bin], (uint32_t)__popc(peers));
        }
      }
      __syncthreads();
      // Thread t holds bins kTopkBins - 1 - (t kPer + j), j < kPer: descending, so the exclusive
      // scan of the threads' sums counts the keys in the bins above a thread's first.
      uint32_t h[kPer];
      int mine = 0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int bin = kTopkBins - 1 - (tid * kPer + j);
        h[j] = s_hist[bin];
        s_hist[bin] = 0u;  // ready for the next round (read only by its owner until then)
        mine += (int)h[j];
      }
      int above;
      Scan(s_scan).ExclusiveSum(mine, above);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (above < want && above + (int)h[j] >= want) {
          s_bin = kTopkBins - 1 - (tid * kPer + j);
          s_want = want - above;
          s_bcnt = (int)h[j];
        }
        above += (int)h[j];
      }
      __syncthreads();
      const int bin = s_bin, bcnt = s_bcnt;
      want = s_want;
      const uint32_t blo = lo + ((uint32_t)bin << shift);
      const uint32_t bhi =  // the bin's last key (shift <= 22)
          (uint32_t)min((unsigned long long)hi, (unsigned long long)blo + (1ull << shift) - 1ull);
      lo = blo;
      hi = bhi;
      if (bcnt > kTopkCand) continue;  // narrow again (the histogram is zero)
      // ---- the bin's keys (at most kTopkCand) gathered and ranked by one warp
      for (int i = tid; i < NB; i += THREADS) {
        const uint32_t key = s_key[i];
        if (key >= lo && key <= hi && key != 0) s_cand[atomicAdd(&s_ncand, 1)] = key;
      }
      __syncthreads();
      if (tid < 32) {
        const uint32_t c = lane < bcnt ? s_cand[lane] : 0u;
        int gt = 0, ge = 0;  // candidates above c, and at least c
#pragma unroll
        for (int j = 0; j < kTopkCand; ++j) {
          const uint32_t o = __shfl_sync(0xffffffffu, c, j);
          if (j < bcnt) { gt += o > c; ge += o >= c; }
        }
        if (lane < bcnt && gt < want && ge >= want) { s_T = c; s_rem = want - gt; }
      }
      __syncthreads();
      T = s_T;
      rem = s_rem;
      break;
    }
  }
  // Contiguous chunk per thread so that the scan follows block-id order (ties: lowest ids).
  const int C = (NB + THREADS - 1) / THREADS;
  const int i0 = tid * C, i1 = min(NB, i0 + C);
  int eq = 0;
  for (int i = i0; i < i1; ++i) eq += (s_key[i] == T && s_key[i] != 0);
  int eq_before;
  Scan(s_scan).ExclusiveSum(eq, eq_before);
  __syncthreads();
  for (int i = i0; i < i1; ++i) {
    const uint32_t key = s_key[i];
    bool chosen = key != 0 && key > T;
    if (key != 0 && key == T) { chosen = eq_before < rem; ++eq_before; }
    const bool keep = i < nb && (i < keep_lo || i >= keep_hi);
    s_key[i] = (chosen || keep) ? 1u : 0u;
  }
  __syncthreads();
}

// Writes the ids i with (s_key[i] & bits) != 0 as an ascending list, -1 padded to n_out, and its
// count (clamped to n_out). Contains __syncthreads.
template <int THREADS>
__device__ void write_list(const uint32_t* s_key, int NB, uint32_t bits, int32_t* out, int n_out,
                           int32_t* cnt) {
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ typename Scan::TempStorage s_scan;
  __shared__ int s_total;
  const int tid = threadIdx.x;
  const int C = (NB + THREADS - 1) / THREADS;
  const int i0 = tid * C, i1 = min(NB, i0 + C);
  int sel = 0;
  for (int i = i0; i < i1; ++i) sel += (s_key[i] & bits) != 0;
  int pos;
  Scan(s_scan).ExclusiveSum(sel, pos);
  if (tid == THREADS - 1) s_total = pos + sel;
  __syncthreads();
  for (int i = i0; i < i1 && pos < n_out; ++i) {
    if (s_key[i] & bits) out[pos++] = i;
  }
  const int total = s_total;
  for (int j = total + tid; j < n_out; j += THREADS) out[j] = -1;
  if (tid == 0) *cnt = total < n_out ? total : n_out;
  __syncthreads();
}

// Order key of a middle block of a row (0 for blocks that are not selectable).
__device__ __forceinline__ bool is_middle(int i, int nb, int keep_lo, int keep_hi) {
  return i < nb && i >= keep_lo && i < keep_hi;
}

}  // namespace
}  // namespace prr
