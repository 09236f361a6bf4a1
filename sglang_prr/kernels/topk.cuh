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
// (0 = not selectable) held in shared memory; a 4-pass radix select finds the k-th largest key T;
// blocks above T, then the lowest-id blocks equal to T, are chosen (the stable order of the
// reference). Kept sink/local blocks are added and the set is written as an ascending list.
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

// Top-K of one row, by the whole CTA. On entry s_key[0..NB) holds the order keys of the
// selectable (middle) blocks and 0 elsewhere; on exit s_key[i] is 1 for the chosen blocks (the k
// best keys, ties to the lower id) and the kept blocks (id < nb, id < keep_lo or id >= keep_hi),
// 0 otherwise. Contains __syncthreads: every thread of the CTA must call it.
template <int THREADS>
__device__ void topk_mask(uint32_t* s_key, int NB, int nb, int k, int keep_lo, int keep_hi) {
  __shared__ uint32_t s_hist[256];
  __shared__ int s_nmid, s_want;
  __shared__ uint32_t s_prefix;
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ typename Scan::TempStorage s_scan;
  const int tid = threadIdx.x;
  if (tid == 0) s_nmid = 0;
  __syncthreads();
  int my_mid = 0;
  for (int i = tid; i < NB; i += THREADS) my_mid += s_key[i] != 0;
  // One shared atomic per warp (THREADS is a multiple of 32): per-thread atomics on one address
  // serialise.
  my_mid = __reduce_add_sync(0xffffffffu, my_mid);
  if ((tid & 31) == 0 && my_mid) atomicAdd(&s_nmid, my_mid);
  __syncthreads();
  const int nmid = s_nmid;
  uint32_t T;
  int rem;
  if (k >= nmid) { T = 0; rem = 0; }            // every middle block (keys > 0)
  else if (k <= 0) { T = 0xffffffffu; rem = 0; }  // none
  else {
    uint32_t prefix = 0, mask = 0;
    int want = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += THREADS) s_hist[i] = 0;
      __syncthreads();
      for (int i = tid; i < NB; i += THREADS) {
        const uint32_t key = s_key[i];
        if (key != 0 && (key & mask) == prefix) {
          // Scores share their high bits: aggregate equal bins of a warp into one atomic.
          const uint32_t bin = (key >> shift) & 255u;
          const unsigned peers = __match_any_sync(__activemask(), bin);
          if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&s_hist[bin], (uint32_t)__popc(peers));
        }
      }
      __syncthreads();
      if (tid < 32) {
        uint32_t h[8];
        int lsum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) { h[j] = s_hist[tid * 8 + j]; lsum += h[j]; }
        int incl = lsum;  // sum over lanes >= tid
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const int t = __shfl_down_sync(0xffffffffu, incl, off);
          if (tid + off < 32) incl += t;
        }
        int cum = incl - lsum;  // keys in higher bins
#pragma unroll
        for (int j = 7; j >= 0; --j) {
          if (cum < want && cum + (int)h[j] >= want) {
            s_prefix = prefix | ((uint32_t)(tid * 8 + j) << shift);
            s_want = want - cum;
          }
          cum += h[j];
        }
      }
      __syncthreads();
      prefix = s_prefix;
      want = s_want;
      mask |= 255u << shift;
      __syncthreads();
    }
    T = prefix;
    rem = want;
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
