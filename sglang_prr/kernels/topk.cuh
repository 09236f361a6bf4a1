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

// The k-th largest key of a row: chosen are the keys above T and, in block order, the first rem
// keys equal to T (T = 0, rem = 0: every nonzero key; T = ~0u: none).
struct TopkCut {
  uint32_t T;
  int rem;
};

// The cut of the k best nonzero keys of s_key[0, NB), by the whole CTA (contains __syncthreads:
// every thread must call it; the result is the same in every thread). Its first pass reads key i
// in thread i % THREADS before any barrier: the callers write them in that thread (or sync).
template <int THREADS>
__device__ TopkCut topk_threshold(const uint32_t* s_key, int NB, int k) {
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
  if (k >= nmid) return {0u, 0};            // every middle block (keys > 0)
  if (k <= 0) return {0xffffffffu, 0};      // none
  // Invariant: the k-th largest key lies in [lo, hi], and is the want-th largest of the keys
  // there (the values are uniform over the CTA: every thread takes the same branches).
  int want = k;
  for (;;) {
    if (lo == hi) return {lo, want};
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
    lo = lo + ((uint32_t)bin << shift);
    hi = (uint32_t)min((unsigned long long)hi,  // the bin's last key (shift <= 22)
                       (unsigned long long)lo + (1ull << shift) - 1ull);
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
    return {s_T, s_rem};
  }
}

// ---- warp-ordered passes over a row: warp w owns the blocks [w seg, (w + 1) seg), seg a multiple
// of 32, read 32 at a time (lane = block: conflict-free, ordered by ballots), so that a pass
// in block order costs a barrier and a warp scan of the warps' counts, not a CTA scan.
template <int THREADS>
__device__ __forceinline__ int warp_seg(int NB) {
  constexpr int kWarps = THREADS / 32;
  return (NB + 32 * kWarps - 1) / (32 * kWarps) * 32;
}

// The exclusive prefix over the warps (lane v holds warp v's count x) at warp w, and the total
// (when asked): every lane of every warp calls it with the same per-warp counts.
template <int THREADS>
__device__ __forceinline__ int warps_prefix(int x, int w, int* total = nullptr) {
  const int lane = threadIdx.x & 31;
  int incl = x;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += t;
  }
  const int all = __shfl_sync(0xffffffffu, incl, 31);
  if (total) *total = all;
  return __shfl_sync(0xffffffffu, incl - x, w);
}

// Block i of a warp-ordered window ending at i1: its key (0 past the segment), and in `keep`
// whether it is kept (id < nb outside [keep_lo, keep_hi)).
__device__ __forceinline__ uint32_t walk_key(const uint32_t* s_key, int i, int i1, int nb,
                                             int keep_lo, int keep_hi, bool& keep) {
  keep = i < i1 && i < nb && (i < keep_lo || i >= keep_hi);
  return i < i1 ? s_key[i] : 0u;
}

// The chosen blocks of a row given its cut, counted in block order: each warp counts its ties
// (keys == T) and sure blocks (keys above T, or kept: id < nb outside [keep_lo, keep_hi)), and
// after one barrier every warp knows how many ties and chosen blocks come before its segment, so
// that its next walk (topk_chosen) writes its chosen blocks at their places. Contains
// __syncthreads.
struct TopkWalk {
  int eq_before;      // ties before this warp's segment
  int chosen_before;  // chosen blocks (sure and taken ties) before this warp's segment
  int total;          // chosen blocks in the row
};
template <int THREADS>
__device__ TopkWalk topk_walk_counts(const uint32_t* s_key, int NB, int nb, TopkCut cut,
                                     int keep_lo, int keep_hi) {
  constexpr int kWarps = THREADS / 32;
  __shared__ int s_eq[kWarps], s_sure[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int seg = warp_seg<THREADS>(NB), i0 = warp * seg, i1 = min(NB, i0 + seg);
  int eq = 0, sure = 0;
  for (int b0 = i0; b0 < i1; b0 += 32) {
    bool keep;
    const uint32_t key = walk_key(s_key, b0 + lane, i1, nb, keep_lo, keep_hi, keep);
    eq += __popc(__ballot_sync(0xffffffffu, key != 0 && key == cut.T));
    sure += __popc(__ballot_sync(0xffffffffu, (key != 0 && key > cut.T) || keep));
  }
  if (lane == 0) { s_eq[warp] = eq; s_sure[warp] = sure; }
  __syncthreads();
  const int ev = lane < kWarps ? s_eq[lane] : 0, sv = lane < kWarps ? s_sure[lane] : 0;
  const int ebefore_lane = warps_prefix<THREADS>(ev, lane);  // lane v: warp v's
  // warp v takes min(max(rem - ties before it, 0), its ties) of its ties
  const int taken = min(max(cut.rem - ebefore_lane, 0), ev);
  int total;
  const int cbefore = warps_prefix<THREADS>(sv + taken, warp, &total);
  return {__shfl_sync(0xffffffffu, ebefore_lane, warp), cbefore, total};
}

// Block i's flags in a warp-ordered walk (every lane of the warp calls it for its block of the
// window b0 + lane, i < i1 or not): chosen (above the cut, a taken tie, or kept). `eq_seen`
// counts the warp's ties so far (updated).
__device__ __forceinline__ bool topk_chosen(uint32_t key, bool keep, TopkCut cut,
                                            int eq_before, int& eq_seen) {
  const int lane = threadIdx.x & 31;
  const bool tie = key != 0 && key == cut.T;
  const unsigned tm = __ballot_sync(0xffffffffu, tie);
  const int rank = eq_before + eq_seen + __popc(tm & ((1u << lane) - 1u));
  eq_seen += __popc(tm);
  return (key != 0 && key > cut.T) || keep || (tie && rank < cut.rem);
}

// One warp-ordered walk over this warp's segment of the row: writes the chosen blocks i with
// sel(i) at out[pos, ...) (ascending, up to n_out), and returns how many chosen blocks have cnt(i)
// (sel, cnt: called for blocks of the segment only).
template <int THREADS, typename Sel, typename Cnt>
__device__ int topk_walk(const uint32_t* s_key, int NB, int nb, TopkCut cut, int keep_lo,
                         int keep_hi, int eq_before, int pos, int32_t* out, int n_out, Sel sel,
                         Cnt cnt) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int seg = warp_seg<THREADS>(NB), i0 = warp * seg, i1 = min(NB, i0 + seg);
  int eq_seen = 0, n = 0;
  for (int b0 = i0; b0 < i1; b0 += 32) {
    const int i = b0 + lane;
    bool keep;
    const uint32_t key = walk_key(s_key, i, i1, nb, keep_lo, keep_hi, keep);
    const bool chosen = topk_chosen(key, keep, cut, eq_before, eq_seen);
    const bool w = chosen && sel(i);
    const unsigned wm = __ballot_sync(0xffffffffu, w);
    const int p = pos + __popc(wm & ((1u << lane) - 1u));
    if (w && p < n_out) out[p] = i;
    pos += __popc(wm);
    n += __popc(__ballot_sync(0xffffffffu, chosen && cnt(i)));
  }
  return n;
}

// Top-K of one row, by the whole CTA. On entry s_key[0..NB) holds the order keys of the
// selectable (middle) blocks and 0 elsewhere, key i written by thread i % THREADS (its first
// pass reads them before any barrier); on exit s_key[i] is 1 for the chosen blocks (the k best
// keys, ties to the lower id) and the kept blocks (id < nb, id < keep_lo or id >= keep_hi), 0
// otherwise. Contains __syncthreads: every thread of the CTA must call it.
template <int THREADS>
__device__ void topk_mask(uint32_t* s_key, int NB, int nb, int k, int keep_lo, int keep_hi) {
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ typename Scan::TempStorage s_scan;
  const TopkCut cut = topk_threshold<THREADS>(s_key, NB, k);
  const uint32_t T = cut.T;
  const int rem = cut.rem;
  // Contiguous chunk per thread so that the scan follows block-id order (ties: lowest ids).
  const int C = (NB + THREADS - 1) / THREADS;
  const int i0 = threadIdx.x * C, i1 = min(NB, i0 + C);
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
