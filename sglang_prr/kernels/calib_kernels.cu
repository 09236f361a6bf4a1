// Prefill calibration on SM90: eq 4's row term for every candidate theta of the grid, the
// predictor of each candidate replayed over a request's sampled prefill queries in one launch.
//
// One CTA per (candidate c, KV head h, row r): the candidate's Holt level and trend for every
// block of the row, and the order keys of its prediction, live in shared memory (12 bytes per
// block). For each sampled query after the first, the CTA forms IS_hat = l + gamma v, takes the
// top-n_pred middle blocks with the selection rule of the decode kernels (topk.cuh), scores them
// against A (num, den, hits, |A| in one block reduction) and writes the term; then it applies
// eq 3 with that query's scores. The arithmetic of eq 3 and eq 2 is rounded op by op like
// reference.calib_grid_terms (no fused multiply-add), so P is the reference's P; only the
// reductions' summation order differs (reference sums in torch's order).
#include "prr_kernels.h"
#include "common.cuh"
#include "topk.cuh"

#include <cub/block/block_reduce.cuh>

namespace prr {
namespace {

// Threads per CTA: 128 up to 512 blocks per row, else 256 (the kernel is bound by the latency
// of the selection's barriers, so small rows run more, smaller CTAs per SM).
constexpr int kCalibSmallRow = 512;
constexpr size_t kCalibSmemPerBlock = 3 * sizeof(float);   // level, trend, key
static_assert(kCalibMaxBlocks * kCalibSmemPerBlock <= 200 * 1024, "kernel_limits.h: kCalibMaxBlocks");

struct Sums4 {
  float num, den, hits, n_a;
};
struct Sum4Op {
  __device__ __forceinline__ Sums4 operator()(const Sums4& x, const Sums4& y) const {
    return {x.num + y.num, x.den + y.den, x.hits + y.hits, x.n_a + y.n_a};
  }
};

template <int kCalibThreads>
__global__ void __launch_bounds__(kCalibThreads)
calib_grid_terms_kernel(CalibArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(16) unsigned char s_raw[];
  const int NB = a.NB;
  float* s_level = reinterpret_cast<float*>(s_raw);
  float* s_trend = s_level + NB;
  uint32_t* s_key = reinterpret_cast<uint32_t*>(s_trend + NB);
  using Reduce = cub::BlockReduce<Sums4, kCalibThreads>;
  __shared__ typename Reduce::TempStorage s_red;

  const int c = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
  const int C = a.A * a.B * a.G;
  const int tid = threadIdx.x;
  const float al = a.alphas[c / (a.B * a.G)];
  const float be = a.betas[(c / a.G) % a.B];
  const float ga = a.gammas[c % a.G];
  for (int i = tid; i < NB; i += kCalibThreads) { s_level[i] = 0.f; s_trend[i] = 0.f; }
  long long n_init = 0;  // the same for every (candidate, head) of the row
  __syncthreads();
  for (int phi = 0; phi < a.Phi; ++phi) {
    const long long n_raw = a.nblk[(int64_t)r * a.Phi + phi];
    const float* sc = a.scores + (((int64_t)r * a.Phi + phi) * a.Hk + h) * NB;
    if (phi > 0) {
      // P: the top n_pred middle blocks by IS_hat, uninitialised blocks ranked lowest (the
      // order key of -inf), ties to the lower id.
      const int n = clamp_count(n_raw, NB);
      const int keep_lo = a.sink, keep_hi = n - a.local;
      for (int i = tid; i < NB; i += kCalibThreads) {
        uint32_t key = 0;
        if (is_middle(i, n, keep_lo, keep_hi))
          key = order_key(i < n_init ? __fadd_rn(s_level[i], __fmul_rn(ga, s_trend[i]))
                                     : -INFINITY);
        s_key[i] = key;
      }
      // nb = 0: no kept blocks are added (eq 4 scores the middle part only).
      topk_mask<kCalibThreads>(s_key, NB, 0, a.n_pred, 0, 0);
      const int64_t arow = (((int64_t)(phi - 1) * a.R + r) * a.Hk + h) * NB;
      Sums4 t = {0.f, 0.f, 0.f, 0.f};
      for (int i = tid; i < NB; i += kCalibThreads) {
        const float w = a.wa[arow + i];
        const bool in_a = a.am[arow + i];
        const bool in_p = s_key[i] != 0;
        t.num += in_p ? w : w * 0.f;  // NaN where w overflowed, as the reference's
        t.den += w;
        t.hits += (in_p && in_a) ? 1.f : 0.f;
        t.n_a += in_a ? 1.f : 0.f;
      }
      const Sums4 tot = Reduce(s_red).Reduce(t, Sum4Op());
      if (tid == 0) {
        const float plain = tot.n_a > 0.f ? tot.hits / fmaxf(tot.n_a, 1.f) : 1.f;
        const float term = tot.den > 0.f ? tot.num / fmaxf(tot.den, 1e-30f) : plain;
        a.out[(((int64_t)(phi - 1) * a.R + r) * C + c) * a.Hk + h] = term;
      }
      __syncthreads();  // s_key and s_red are reused
    }
    // Eq 3 (a level or trend that is not finite restarts like a new block; blocks past nblk keep
    // their state).
    for (int i = tid; i < NB; i += kCalibThreads) {
      if (i >= n_raw) continue;
      const float s = sc[i];
      const float l0 = s_level[i];
      if (i < n_init && isfinite(l0) && isfinite(s_trend[i])) {
        s_trend[i] = __fadd_rn(__fmul_rn(be, __fsub_rn(s, l0)),
                               __fmul_rn(__fsub_rn(1.f, be), s_trend[i]));
        s_level[i] = __fadd_rn(__fmul_rn(al, s), __fmul_rn(__fsub_rn(1.f, al), l0));
      } else {
        s_trend[i] = 0.f;
        s_level[i] = s;
      }
    }
    n_init = n_init > n_raw ? n_init : n_raw;
    __syncthreads();
  }
}

}  // namespace

int max_calib_blocks() { return kCalibMaxBlocks; }

cudaError_t launch_calib_grid_terms(const CalibArgs& a, cudaStream_t s) {
  if (a.Phi < 2 || a.R == 0 || a.Hk == 0) return cudaSuccess;
  if (a.NB > kCalibMaxBlocks || a.NB < 1) return cudaErrorInvalidValue;
  const size_t smem = kCalibSmemPerBlock * a.NB;
  const dim3 grid(a.A * a.B * a.G, a.Hk, a.R);
  if (a.NB <= kCalibSmallRow) {
    launch_kernel(calib_grid_terms_kernel<128>, grid, 128, smem, s, a);
    return cudaGetLastError();
  }
  cudaError_t e = set_smem_limit(calib_grid_terms_kernel<256>, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(calib_grid_terms_kernel<256>, grid, 256, smem, s, a);
  return cudaGetLastError();
}

}  // namespace prr
