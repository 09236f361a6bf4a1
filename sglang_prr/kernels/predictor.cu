// The Holt predictor on SM90 (eqs 2-3): the fused decode step (Holt update, P(t+1) and its
// top-K in one launch) and the element-wise Holt update the prefill replay uses.
// Plain CUDA: these kernels are memory- and latency-bound, so they are written around wide loads
// and many independent requests in flight rather than tensor cores. Every kernel is graph-safe:
// static launch shapes, device-side counts, no host reads.
#include "prr_kernels.h"
#include "common.cuh"
#include "topk.cuh"
#include "predict_row.cuh"

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
// row (b, hk): predict_row. n_init[b] is read by all Hk rows of the request and raised by the
// last of them.
__global__ void __launch_bounds__(kTopkThreads)
predict_update_kernel(PredictArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ uint32_t s_key[];  // [NB]
  predict_row(a, blockIdx.x, blockIdx.y, s_key);
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
