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

}  // namespace prr_bind
