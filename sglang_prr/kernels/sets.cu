// Set operations on block lists and the step's counters on SM90: M = A \ P as a bitmask per row
// (any list order, repeats and ids outside the row's blocks ignored), and the four sums of
// reference.accumulate_stats. Plain CUDA, graph-safe: static launch shapes, device-side counts.
#include "prr_kernels.h"
#include "common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace prr {
namespace {

// ============================================================================ set difference
// One CTA per row: bitmask A \ P in shared memory (robust to any list order), then an ascending
// compaction by a block scan over the mask words.
constexpr int kSetThreads = 256;

__global__ void __launch_bounds__(kSetThreads)
set_difference_kernel(SetDiffArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ uint32_t s_bits[];
  using Scan = cub::BlockScan<int, kSetThreads>;
  __shared__ typename Scan::TempStorage s_scan;
  __shared__ int s_total;
  const int row = blockIdx.x, tid = threadIdx.x;
  const int W = (a.nb + 31) / 32;
  for (int w = tid; w < W; w += kSetThreads) s_bits[w] = 0;
  __syncthreads();
  const int b = row / a.Hk;
  const int64_t prow =
      a.p_rows ? slot_of(a.p_rows, a.p_rows64, a.p_rows_n, b) * a.Hk + row % a.Hk : row;
  const int ca = a.a_cnt[row], cp = a.p_cnt[prow];
  for (int i = tid; i < a.Na && i < ca; i += kSetThreads) {
    const int x = a.a_idx[(int64_t)row * a.Na + i];
    if (x >= 0 && x < a.nb) atomicOr(&s_bits[x >> 5], 1u << (x & 31));
  }
  __syncthreads();
  for (int i = tid; i < a.Np && i < cp; i += kSetThreads) {
    const int x = a.p_idx[prow * a.Np + i];
    if (x >= 0 && x < a.nb) atomicAnd(&s_bits[x >> 5], ~(1u << (x & 31)));
  }
  __syncthreads();
  const int C = (W + kSetThreads - 1) / kSetThreads;
  const int w0 = tid * C, w1 = min(W, w0 + C);
  int c = 0;
  for (int w = w0; w < w1; ++w) c += __popc(s_bits[w]);
  int pos;
  Scan(s_scan).ExclusiveSum(c, pos);
  if (tid == kSetThreads - 1) s_total = pos + c;
  __syncthreads();
  int32_t* out = a.m_idx + (int64_t)row * a.n_out;
  for (int w = w0; w < w1 && pos < a.n_out; ++w) {
    uint32_t bits = s_bits[w];
    while (bits && pos < a.n_out) {
      const int j = __ffs(bits) - 1;
      bits &= bits - 1;
      out[pos++] = w * 32 + j;
    }
  }
  const int total = s_total;
  for (int j = total + tid; j < a.n_out; j += kSetThreads) out[j] = -1;
  if (tid == 0) {
    const int mc = total < a.n_out ? total : a.n_out;
    a.m_cnt[row] = mc;
    if (a.stats && !(a.dense_row && a.dense_row[b])) {  // accumulate_stats' sums, this row's part
      atomicAdd(a.stats + kStatSelected, (unsigned long long)(long long)ca);
      atomicAdd(a.stats + kStatRepair, (unsigned long long)mc);
      atomicAdd(a.stats + kStatPredicted, (unsigned long long)(cp > 0 ? cp : 0));
      atomicAdd(a.stats + kStatRows, 1ull);
    }
  }
}

// ============================================================================ counters
// One CTA over every (request, KV head) row: the four sums of reference.accumulate_stats (|A|,
// |M|, |P| clamped at 0, rows; dense rows left out) reduced in the CTA, then one atomic per slot.
constexpr int kStatsThreads = 256;

__global__ void __launch_bounds__(kStatsThreads)
accumulate_stats_kernel(StatsArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  using Reduce = cub::BlockReduce<long long, kStatsThreads>;
  __shared__ typename Reduce::TempStorage s_red;
  long long sum[kNumStatSlots] = {0, 0, 0, 0};
  const int rows = a.B * a.Hk;
  for (int r = threadIdx.x; r < rows; r += kStatsThreads) {
    if (a.dense_row && a.dense_row[r / a.Hk]) continue;
    sum[kStatSelected] += a.a_cnt[r];
    sum[kStatRepair] += a.m_cnt[r];
    if (a.p_cnt) sum[kStatPredicted] += max(a.p_cnt[r], 0);
    sum[kStatRows] += 1;
  }
  for (int slot = 0; slot < kNumStatSlots; ++slot) {
    const long long total = Reduce(s_red).Sum(sum[slot]);
    if (threadIdx.x == 0) atomicAdd(a.stats + slot, (unsigned long long)total);
    __syncthreads();  // s_red is reused by the next slot's reduction
  }
}

}  // namespace

cudaError_t launch_accumulate_stats(const StatsArgs& a, cudaStream_t s) {
  if (a.B == 0 || a.Hk == 0) return cudaSuccess;
  launch_kernel(accumulate_stats_kernel, 1, kStatsThreads, 0, s, a);
  return cudaGetLastError();
}

cudaError_t launch_set_difference(const SetDiffArgs& a, cudaStream_t s) {
  if (a.rows == 0) return cudaSuccess;
  const size_t smem = (size_t)((a.nb + 31) / 32 + 1) * sizeof(uint32_t);
  cudaError_t e = set_smem_limit(set_difference_kernel, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(set_difference_kernel, a.rows, kSetThreads, smem, s, a);
  return cudaGetLastError();
}

}  // namespace prr
