// The helpers the op bindings share (binding.cpp defines them; select_binding.cpp and
// binding.cpp use them): dtype codes, argument checks, the current stream and the fused
// kernels' group counters.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>

#include "prr_kernels.h"

namespace prr_bind {

using at::Tensor;

// The kinds of launch that own an array of group counters (see counters() in binding.cpp).
enum CounterKind {
  kCntAttnMerge = 0, kCntSelect = 1, kCntPredict = 2, kCntSelectReq = 3, kNumCounterKinds = 4
};

int dtype_code(const Tensor& t);                 // prr::kF32 / kF16 / kBF16, or an error
int summary_code(const Tensor& kmin, const Tensor& kmax, const char* op);
bool index64(const Tensor& t, const char* name);  // int64 (true) or int32 (false), or an error
void check_cuda(const Tensor& t, const char* name);
void check_launch(cudaError_t e, const char* op);
cudaStream_t stream();
Tensor q_view(const Tensor& q);  // [B, Hq, D], packed heads, any 16-byte row stride
const void* slots_ptr(const c10::optional<Tensor>& rows, int64_t B, bool& is64, Tensor& keep,
                      const char* op);
int* group_counters(const Tensor& like, int kind, int64_t rows, const char* op);

// The predictor's step over `scores` [B, Hk, NB] on the state level/trend [R, Hk, NB], n_init,
// theta [R, 3] (rows: the state rows of the batch's entries, else R = B), P(t+1) into idx/cnt
// [R', Hk, >= n_pred + sink + local] / [R', Hk] at rows p_rows (else the state rows): checked
// (messages name `op`) and packed into PredictArgs. `keep` holds the contiguous copies until
// the launch.
struct PredictInputs { Tensor scores, nblk, nblk_next, rows, p_rows; };
prr::PredictArgs predict_args(Tensor& level, Tensor& trend, Tensor& n_init, const Tensor& scores,
                              const Tensor& nblk, const Tensor& theta, const Tensor& nblk_next,
                              int64_t n_pred, int64_t sink, int64_t local, Tensor& idx,
                              Tensor& cnt, const c10::optional<Tensor>& rows,
                              const c10::optional<Tensor>& p_rows, PredictInputs& keep,
                              const char* op);

}  // namespace prr_bind
