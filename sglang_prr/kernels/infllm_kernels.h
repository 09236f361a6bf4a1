// Launchers of the InfLLM-v2 SM90 kernels: compressed-key update and block scores (plain C types:
// shared by the CUDA translation unit and the torch binding, compiled by the host compiler).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernel_limits.h"

namespace prr {

// Element types of q / k_buf (same codes as prr::DType in prr_kernels.h).
enum InfllmDType : int { kInfF32 = 0, kInfF16 = 1, kInfBF16 = 2 };

// Compressed keys: key i = mean of the keys at positions [16 i, 16 i + 32) (reference.py).
constexpr int kInfllmWindow = 32;
constexpr int kInfllmStride = 16;

// Compressed keys are stored as float32 (kInfF32) or bfloat16 (kInfBF16, rounded to nearest
// from the float32 mean).
struct InfllmUpdateArgs {
  void* ck; int ck_dtype;                           // [num_pages, page_size/16, Hk, D] contiguous
  const void* k; int k_dtype;                       // [num_slots, Hk, D], last dim contiguous
  int64_t k_stride_slot, k_stride_head;
  const void* req_to_token; bool rtt64; int64_t rtt_stride;  // [max_reqs, max_ctx]
  const void* req_idx; bool req64;                  // [N]
  const void* out_loc; bool loc64;                  // [N]
  const void* positions; bool pos64;                // [N]
  int N, Hk, D, page_size;
  // The pools' sizes: a request slot, KV slot or page outside its pool is 0 (in_pool)
  int64_t rtt_rows, rtt_cols, num_slots, num_pages;
};
cudaError_t launch_infllm_update(const InfllmUpdateArgs& a, cudaStream_t s);

struct InfllmScoresArgs {
  const void* q; int q_dtype;                       // [B, Hq, D] contiguous
  const void* ck; int ck_dtype;                     // [num_pages, page_size/16, Hk, D] contiguous
  int64_t num_pages;                                // a page outside it reads page 0 (in_pool)
  const void* table; bool table64; int64_t table_stride;  // [B, NB]
  const void* seq_lens; bool seq64;                 // [B]
  float* logits;                                    // workspace [B, Hq, NB * page_size/16]
  float* stats;                                     // workspace [B, Hq, num_chunks, 2]
  int num_chunks;                                   // infllm_num_chunks() of these shapes
  float* out;                                       // [B, Hk, NB]
  int B, Hq, Hk, NB, D, page_size;
  float sm_scale;
};
// Chunks of the logits pass per (request, query head), from the shapes only: the workspace
// holds [B, Hq, num_chunks] (max, sum) pairs.
int infllm_num_chunks(int B, int Hq, int Hk, int NB, int D, int page_size);
cudaError_t launch_infllm_scores(const InfllmScoresArgs& a, cudaStream_t s);

}  // namespace prr
