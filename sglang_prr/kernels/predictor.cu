// The Holt predictor on SM90 (eqs 2-3): the fused decode step (Holt update, P(t+1) and its
// top-K in one launch) and the element-wise Holt update the prefill replay uses.
// Plain CUDA: these kernels are memory- and latency-bound, so they are written around wide loads
// and many independent requests in flight rather than tensor cores. Every kernel is graph-safe:
// static launch shapes, device-side counts, no host reads.
#include "prr_kernels.h"
#include "common.cuh"
#include "topk.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <cmath>

namespace prr {
namespace {

// ============================================================================ fused predictor
// Holt update (eq 3) + next-step prediction (eq 2) + top-K of P(t+1) in one launch, one CTA per
// row (b, hk). n_init[b] is read by all Hk rows of the request and raised by the last of them.
__global__ void __launch_bounds__(kTopkThreads)
predict_update_kernel(PredictArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ uint32_t s_key[];  // [NB]
  const int hk = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x;
  const int NB = a.NB;
  // The prologue in two round trips, not three: the state row's slot beside the block counts,
  // then n_init, theta, the scores and the state together (the state is read for every block
  // of the round, not only below n_init, and zeroed past it after the loads: the reference's
  // values without waiting for n_init first). Loads are converted only after they are all
  // issued (ld_index_raw / index_of: converted beside its load, each load waits in turn).
  const RawIndex row_raw =
      ld_index_raw(a.rows ? a.rows : a.nblk, b, a.rows ? a.rows64 : a.nblk64);
  const RawIndex nb_raw = ld_index_raw(a.nblk, b, a.nblk64);
  const RawIndex nbn_raw = ld_index_raw(a.nblk_next, b, a.nblk_next64);
  // the state row (a slot outside the pool is its padding row 0: in_pool)
  const int64_t srow = a.rows ? in_pool(index_of(row_raw, a.rows64), a.rows_n) : (int64_t)b;
  const int64_t row = srow * a.Hk + hk;
  const int64_t brow = (int64_t)b * a.Hk + hk;        // this step's scores
  RawIndex ninit_raw = ld_index_raw(a.n_init, srow, a.ninit64);
  const float al = a.theta[srow * a.theta_stride], be = a.theta[srow * a.theta_stride + 1];
  const float gam = a.theta[srow * a.theta_stride + 2];
  const int nb = clamp_count(index_of(nb_raw, a.nblk64), NB);
  const int nbn = clamp_count(index_of(nbn_raw, a.nblk_next64), NB);
  float* lv = a.level + row * NB;
  float* tr = a.trend + row * NB;
  const float* sc = a.scores + brow * NB;
  const int keep_lo = a.sink, keep_hi = nbn - a.local;
  // Blocks past both counts are neither updated nor predictable: the loops stop before them.
  // A thread's kPer blocks of a round are loaded before any is stored: the state's stores could
  // alias the next blocks' loads, so a loop of load-compute-store pays one DRAM round trip per
  // block a thread owns (four at 128K, block 64).
  constexpr int kPer = 4;
  const int L = max(nb, nbn);
  // (a negative n_init acts as 0 either way: it bounds block ids and is max'ed with nb)
  // The first round runs whatever L (its loads predicated): a loop-entry branch would have the
  // compiler convert n_init before it, waiting for it ahead of the state's loads.
  int ninit = 0, ninit_new = nb;
  int i0 = tid;
  do {
    float s[kPer], l0[kPer], t0[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = i0 + u * kTopkThreads;
      s[u] = 0.f; l0[u] = 0.f; t0[u] = 0.f;
      // (bounded by the rows' width, not by nb and L: the loads wait for no count)
      if (i < NB) { s[u] = sc[i]; l0[u] = lv[i]; t0[u] = tr[i]; }
    }
    // n_init's value is taken here, after the round's loads: without this fence the compiler
    // moves it (uniform) to its uniform registers ahead of them, and they wait for it.
    asm volatile("" : "+r"(ninit_raw.v32), "+l"(ninit_raw.v64) : : "memory");
    ninit = clamp_count(index_of(ninit_raw, a.ninit64), NB);
    ninit_new = max(ninit, nb);
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = i0 + u * kTopkThreads;
      if (i >= L) break;
      if (i >= ninit_new) { l0[u] = 0.f; t0[u] = 0.f; }  // the reference's state past n_init
      if (i >= nb) s[u] = 0.f;
      float l = 0.f, v = 0.f;
      if (i < nb) {  // eq 3, rounded op by op like the reference
        // A level or trend that is not finite (InfLLM-v2 scores -inf before a complete
        // compressed key; scores near the float limits) restarts like a new block, as in the
        // reference.
        if (i < ninit && isfinite(l0[u]) && isfinite(t0[u])) {
          v = __fadd_rn(__fmul_rn(be, __fsub_rn(s[u], l0[u])),
                        __fmul_rn(__fsub_rn(1.f, be), t0[u]));
          l = __fadd_rn(__fmul_rn(al, s[u]), __fmul_rn(__fsub_rn(1.f, al), l0[u]));
        } else {
          l = s[u];
        }
        lv[i] = l;
        tr[i] = v;
      } else if (i < ninit_new) {
        l = l0[u];
        v = t0[u];
      }
      uint32_t key = 0;
      if (is_middle(i, nbn, keep_lo, keep_hi))
        key = order_key(i < ninit_new ? __fadd_rn(l, __fmul_rn(gam, v)) : -INFINITY);
      s_key[i] = key;
    }
    i0 += kPer * kTopkThreads;
  } while (i0 < L);
  topk_mask<kTopkThreads>(s_key, L, nbn, a.k, keep_lo, keep_hi);
  const int64_t prow =
      (a.p_rows ? slot_of(a.p_rows, a.p_rows64, a.p_rows_n, b) : srow) * a.Hk + hk;
  write_list<kTopkThreads>(s_key, L, 1u, a.idx + prow * a.n_out, a.n_out, a.cnt + prow);
  if (last_of_group(a.sem + b, gridDim.x) && tid == 0) {
    if (a.ninit64) reinterpret_cast<long long*>(a.n_init)[srow] = ninit_new;
    else reinterpret_cast<int*>(a.n_init)[srow] = ninit_new;
  }
}

// ============================================================================ Holt update
__global__ void holt_update_kernel(HoltArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  const int64_t total = (int64_t)a.B * a.Hk * a.NB;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int i = (int)(e % a.NB);
    const int b = (int)(e / ((int64_t)a.Hk * a.NB));
    const int64_t nb = ld_index(a.nblk, b, a.nblk64);
    if (i >= nb) continue;
    const int64_t ni = ld_index(a.n_init, b, a.ninit64);
    const float s = a.scores[e];
    const float lv = a.level[e], tv = a.trend[e];
    if (i < ni && isfinite(lv) && isfinite(tv)) {  // a non-finite state restarts like a new block
      const float al = a.alpha[b * a.alpha_stride], be = a.beta[b * a.beta_stride];
      // Rounded op by op like the reference (no fused multiply-add): the state feeds top-K ties.
      a.trend[e] = __fadd_rn(__fmul_rn(be, __fsub_rn(s, lv)), __fmul_rn(__fsub_rn(1.f, be), tv));
      a.level[e] = __fadd_rn(__fmul_rn(al, s), __fmul_rn(__fsub_rn(1.f, al), lv));
    } else {
      a.trend[e] = 0.f;
      a.level[e] = s;
    }
  }
}
// A separate launch: the element kernel must see the old n_init everywhere.
__global__ void holt_ninit_kernel(HoltArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= a.B) return;
  const int64_t nb = ld_index(a.nblk, b, a.nblk64);
  if (a.ninit64) {
    long long* p = reinterpret_cast<long long*>(a.n_init) + b;
    if (nb > *p) *p = nb;
  } else {
    int* p = reinterpret_cast<int*>(a.n_init) + b;
    if (nb > *p) *p = (int)nb;
  }
}

// SGLANG_PRR_PREDICT_SMEM_KB=N (a measuring knob, read once per process): the predictor's CTAs
// ask for N KB of dynamic shared memory (at most what the device's per-block limit leaves beside
// the kernel's static arrays) however few their keys need, so that no CTA needing more than what
// is left of an SM's shared memory lands beside one: from N = 201, at 2048 blocks, not the top-K's
// (15 KB) nor the repair's. Beside the predictor's 8 CTAs (batch 1) the top-K's 8 took 11.3 us
// instead of 6.4 and the repair's 14.2 instead of 7.3 (run 66): CTAs sharing SMs with it would
// explain that. Unset or 0: the keys' bytes.
size_t predict_smem_floor() {
  static const size_t v = [] {
    const char* e = std::getenv("SGLANG_PRR_PREDICT_SMEM_KB");
    const long kb = e != nullptr ? std::strtol(e, nullptr, 10) : 0;
    int dev = 0, most = 0;
    cudaFuncAttributes fa = {};
    if (kb <= 0 || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess ||
        cudaFuncGetAttributes(&fa, predict_update_kernel) != cudaSuccess ||
        (size_t)most <= fa.sharedSizeBytes)
      return (size_t)0;
    return std::min((size_t)kb * 1024, (size_t)most - fa.sharedSizeBytes);
  }();
  return v;
}

}  // namespace

cudaError_t launch_predict_update(const PredictArgs& a, cudaStream_t s) {
  if (a.NB > kTopkMaxBlocks) return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0) return cudaSuccess;
  const size_t smem =
      std::max((size_t)(a.NB > 0 ? a.NB : 1) * sizeof(uint32_t), predict_smem_floor());
  cudaError_t e = set_smem_limit(predict_update_kernel, smem);
  if (e != cudaSuccess) return e;
  launch_kernel(predict_update_kernel, dim3(a.Hk, a.B), kTopkThreads, smem, s, a);
  return cudaGetLastError();
}

cudaError_t launch_holt_update(const HoltArgs& a, cudaStream_t s) {
  const int64_t total = (int64_t)a.B * a.Hk * a.NB;
  if (total > 0) {
    const int threads = 256;
    int64_t blocks = (total + threads - 1) / threads;
    if (blocks > 4096) blocks = 4096;
    launch_kernel(holt_update_kernel, (int)blocks, threads, 0, s, a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (a.B > 0) launch_kernel(holt_ninit_kernel, (a.B + 127) / 128, 128, 0, s, a);
  return cudaGetLastError();
}

}  // namespace prr
