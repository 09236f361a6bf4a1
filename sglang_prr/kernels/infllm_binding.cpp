// Torch op registrations of the InfLLM-v2 SM90 kernels (namespace `sglang_prr_cuda`, CUDA
// dispatch key), as a fragment of the library that binding.cpp defines; the schemas match the
// `sglang_prr::infllm_*` ops of sglang_prr/ops.py. Argument checks that need a host sync are never
// done here; the workspace of infllm_scores comes from the caching allocator with static shapes,
// so the op records into CUDA graphs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "infllm_kernels.h"

using at::Tensor;

namespace {

int infllm_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return prr::kInfF32;
    case at::kHalf: return prr::kInfF16;
    case at::kBFloat16: return prr::kInfBF16;
    default:
      TORCH_CHECK(false, "sglang_prr_cuda: ", name, " has dtype ", t.scalar_type(),
                  ": expected float32, float16 or bfloat16");
  }
  return -1;
}

bool infllm_index64(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "sglang_prr_cuda: ",
              name, " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kLong;
}

void infllm_check(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, "sglang_prr_cuda::", op, " launch failed: ",
              cudaGetErrorString(e));
}

void check_ck(const Tensor& ck, int64_t page_size, const char* op) {
  TORCH_CHECK(ck.is_cuda(), op, ": ck must be a CUDA tensor");
  TORCH_CHECK(ck.dim() == 4 && ck.is_contiguous() &&
              (ck.scalar_type() == at::kFloat || ck.scalar_type() == at::kBFloat16), op,
              ": ck must be a contiguous float32 or bfloat16 [num_pages, page_size/16, Hk, D] "
              "tensor, got ", ck.scalar_type());
  TORCH_CHECK(page_size >= prr::kInfllmStride && page_size % prr::kInfllmStride == 0, op,
              ": page_size=", page_size, " must be a positive multiple of 16");
  TORCH_CHECK(ck.size(1) == page_size / prr::kInfllmStride, op, ": ck has ", ck.size(1),
              " compressed keys per page, page_size=", page_size, " needs ",
              page_size / prr::kInfllmStride);
}

void infllm_update(Tensor& ck, const Tensor& k_buf, const Tensor& req_to_token,
                   const Tensor& req_idx_in, const Tensor& out_loc_in,
                   const Tensor& positions_in, int64_t page_size) {
  check_ck(ck, page_size, "infllm_update");
  c10::cuda::CUDAGuard guard(ck.device());
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.stride(2) == 1 && k_buf.size(1) == ck.size(2) &&
              k_buf.size(2) == ck.size(3),
              "infllm_update: k_buf must be [num_slots, Hk, D] (Hk, D as ck) with a contiguous "
              "last dim");
  TORCH_CHECK(ck.size(3) % 8 == 0, "infllm_update: head dim ", ck.size(3),
              " must be a multiple of 8");
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "infllm_update: req_to_token must be [max_reqs, max_ctx] with a contiguous last dim");
  const Tensor req_idx = req_idx_in.contiguous(), out_loc = out_loc_in.contiguous(),
               positions = positions_in.contiguous();
  prr::InfllmUpdateArgs a{};
  a.ck = ck.data_ptr(); a.ck_dtype = infllm_dtype(ck, "ck");
  a.k = k_buf.data_ptr(); a.k_dtype = infllm_dtype(k_buf, "k_buf");
  a.k_stride_slot = k_buf.stride(0); a.k_stride_head = k_buf.stride(1);
  a.req_to_token = req_to_token.data_ptr(); a.rtt64 = infllm_index64(req_to_token, "req_to_token");
  a.rtt_stride = req_to_token.stride(0);
  a.req_idx = req_idx.data_ptr(); a.req64 = infllm_index64(req_idx, "req_idx");
  a.out_loc = out_loc.data_ptr(); a.loc64 = infllm_index64(out_loc, "out_loc");
  a.positions = positions.data_ptr(); a.pos64 = infllm_index64(positions, "positions");
  a.N = (int)positions.numel(); a.Hk = (int)ck.size(2); a.D = (int)ck.size(3);
  a.page_size = (int)page_size;
  a.rtt_rows = req_to_token.size(0); a.rtt_cols = req_to_token.size(1);
  a.num_slots = k_buf.size(0); a.num_pages = ck.size(0);
  infllm_check(prr::launch_infllm_update(a, c10::cuda::getCurrentCUDAStream().stream()),
               "infllm_update");
}

Tensor infllm_scores(const Tensor& q_in, const Tensor& ck, const Tensor& table,
                     const Tensor& seq_lens_in, int64_t page_size, double sm_scale) {
  check_ck(ck, page_size, "infllm_scores");
  c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = q_in.contiguous();
  TORCH_CHECK(q.dim() == 3 && q.size(2) == ck.size(3), "infllm_scores: q must be [B, Hq, D] "
              "with D = ck.shape[3]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = ck.size(2);
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0 && Hq / Hk <= prr::kInfllmMaxGroup, "infllm_scores: ",
              Hq, " query heads over ", Hk, " KV heads: the group must be 1..",
              prr::kInfllmMaxGroup);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "infllm_scores: head dim ", D,
              " not supported: expected 64, 128 or 256");
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1 && table.size(0) == B,
              "infllm_scores: table must be [B, NB] with a contiguous last dim");
  const Tensor seq_lens = seq_lens_in.contiguous();
  const int64_t NB = table.size(1), pp = page_size / prr::kInfllmStride;
  const int64_t E = NB * pp;
  const int64_t NC = prr::infllm_num_chunks((int)B, (int)Hq, (int)Hk, (int)NB, (int)D,
                                            (int)page_size);
  auto out = at::empty({B, Hk, NB}, q.options().dtype(at::kFloat));
  auto logits = at::empty({B, Hq, E}, q.options().dtype(at::kFloat));
  auto stats = at::empty({B, Hq, NC, 2}, q.options().dtype(at::kFloat));
  prr::InfllmScoresArgs a{};
  a.q = q.data_ptr(); a.q_dtype = infllm_dtype(q, "q");
  a.ck = ck.data_ptr(); a.ck_dtype = infllm_dtype(ck, "ck"); a.num_pages = ck.size(0);
  a.table = table.data_ptr(); a.table64 = infllm_index64(table, "table");
  a.table_stride = table.stride(0);
  a.seq_lens = seq_lens.data_ptr(); a.seq64 = infllm_index64(seq_lens, "seq_lens");
  a.logits = logits.data_ptr<float>(); a.stats = stats.data_ptr<float>(); a.num_chunks = (int)NC;
  a.out = out.data_ptr<float>();
  a.B = (int)B; a.Hq = (int)Hq; a.Hk = (int)Hk; a.NB = (int)NB; a.D = (int)D;
  a.page_size = (int)page_size; a.sm_scale = (float)sm_scale;
  infllm_check(prr::launch_infllm_scores(a, c10::cuda::getCurrentCUDAStream().stream()),
               "infllm_scores");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sglang_prr_cuda, m) {
  m.def("infllm_update(Tensor(a!) ck, Tensor k_buf, Tensor req_to_token, Tensor req_idx, "
        "Tensor out_loc, Tensor positions, int page_size) -> ()");
  m.def("infllm_scores(Tensor q, Tensor ck, Tensor table, Tensor seq_lens, int page_size, "
        "float sm_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglang_prr_cuda, CUDA, m) {
  m.impl("infllm_update", &infllm_update);
  m.impl("infllm_scores", &infllm_scores);
}
