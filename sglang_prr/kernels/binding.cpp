// Torch op registrations of the PRR SM90 kernels: namespace `sglang_prr_cuda`, CUDA dispatch key.
// Registered with TORCH_LIBRARY (no Python module init), so the library loads with
// torch.ops.load_library under any Python version that has the same torch. The Python side
// (sglang_prr/kernels/__init__.py) registers these as the CUDA implementations of the
// `sglang_prr::*` ops; argument checks that would need a host sync are never done here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <tuple>

#include "prr_kernels.h"
#include "binding_common.h"

using at::Tensor;

// The helpers every binding file shares (binding_common.h declares them).
namespace prr_bind {

int dtype_code(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return prr::kF32;
    case at::kHalf: return prr::kF16;
    case at::kBFloat16: return prr::kBF16;
    default:
      TORCH_CHECK(false, "sglang_prr_cuda: dtype ", t.scalar_type(),
                  " not supported: expected float32, float16 or bfloat16");
  }
  return -1;
}

// Quest summaries: float32, or bfloat16 rounded outward (kmin down, kmax up).
int summary_code(const Tensor& kmin, const Tensor& kmax, const char* op) {
  TORCH_CHECK(kmin.is_contiguous() && kmax.is_contiguous(), op, ": kmin/kmax must be contiguous");
  TORCH_CHECK(kmin.scalar_type() == kmax.scalar_type() &&
              (kmin.scalar_type() == at::kFloat || kmin.scalar_type() == at::kBFloat16),
              op, ": kmin/kmax must both be float32 or both bfloat16, got ", kmin.scalar_type(),
              " and ", kmax.scalar_type());
  return kmin.scalar_type() == at::kFloat ? prr::kF32 : prr::kBF16;
}

bool index64(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "sglang_prr_cuda: ",
              name, " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kLong;
}

void check_cuda(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "sglang_prr_cuda: ", name, " must be a CUDA tensor");
}

void check_launch(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, "sglang_prr_cuda::", op, " launch failed: ",
              cudaGetErrorString(e));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// q as the kernels read it: [B, Hq, D] with packed heads and any row stride. SGLang's q is a
// view of the fused qkv projection (rows strided by the k/v columns): it is read in place rather
// than copied, which would cost a launch per op.
Tensor q_view(const Tensor& q) {
  TORCH_CHECK(q.dim() == 3, "sglang_prr_cuda: q must be [B, Hq, D], got ", q.sizes());
  if (q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) % 8 == 0 &&
      reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0)
    return q;
  return q.contiguous();
}

// Optional request-slot vector [B] (int32 or int64) of a list that lives in the request pool.
const void* slots_ptr(const c10::optional<Tensor>& rows, int64_t B, bool& is64, Tensor& keep,
                      const char* op) {
  is64 = false;
  if (!rows.has_value()) return nullptr;
  keep = rows->contiguous();
  TORCH_CHECK(keep.dim() == 1 && keep.size(0) == B, op, ": rows must be [", B, "], got ",
              keep.sizes());
  is64 = index64(keep, "rows");
  return keep.data_ptr();
}

// Zero-initialised int32 counters of the fused kernels ("last CTA of a group finishes"), one
// array per device and per kind of launch, so that launches of different kinds may run
// concurrently on two streams (PRR's selection beside its attention). Each group's counter returns
// to zero at the end of every launch, so the arrays are allocated and zeroed once (outside any
// graph capture: `prepare` is called when the kernels load) and then reused by every launch and
// graph replay. Two launches of the same kind must not overlap in time on one device.
constexpr int64_t kMaxCounterRows = 1 << 18;
constexpr int kMaxDevices = 64;

int* counters(int kind, int device) {
  static int* ptrs[kMaxDevices][kNumCounterKinds] = {};
  static std::mutex mu;
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "sglang_prr_cuda: device index ", device,
              " out of range [0, ", kMaxDevices, ")");
  std::lock_guard<std::mutex> lock(mu);
  if (!ptrs[device][kind]) {
    void* p = nullptr;
    const size_t bytes = kMaxCounterRows * sizeof(int);
    TORCH_CHECK(cudaMalloc(&p, bytes) == cudaSuccess && cudaMemset(p, 0, bytes) == cudaSuccess &&
                cudaDeviceSynchronize() == cudaSuccess,
                "sglang_prr_cuda: could not allocate the fused-kernel counters on device ", device,
                " (call sglang_prr.kernels.prepare(device) before CUDA-graph capture)");
    ptrs[device][kind] = static_cast<int*>(p);
  }
  return ptrs[device][kind];
}

int* group_counters(const Tensor& like, int kind, int64_t rows, const char* op) {
  TORCH_CHECK(rows <= kMaxCounterRows, op, ": ", rows, " groups, at most ", kMaxCounterRows,
              " supported");
  return counters(kind, like.get_device());
}

void prepare(const Tensor& like) {
  check_cuda(like, "like");
  c10::cuda::CUDAGuard guard(like.device());
  for (int k = 0; k < kNumCounterKinds; ++k) counters(k, like.get_device());
}

prr::PredictArgs predict_args(Tensor& level, Tensor& trend, Tensor& n_init,
                              const Tensor& scores_in, const Tensor& nblk_in, const Tensor& theta,
                              const Tensor& nblk_next_in, int64_t n_pred, int64_t sink,
                              int64_t local, Tensor& idx, Tensor& cnt,
                              const c10::optional<Tensor>& rows_in,
                              const c10::optional<Tensor>& p_rows_in, PredictInputs& keep,
                              const char* op) {
  TORCH_CHECK(level.is_contiguous() && trend.is_contiguous() && n_init.is_contiguous() &&
              level.scalar_type() == at::kFloat && trend.scalar_type() == at::kFloat,
              op, ": level/trend must be contiguous float32 and n_init contiguous");
  TORCH_CHECK(theta.scalar_type() == at::kFloat && theta.dim() == 2 && theta.size(1) == 3 &&
              theta.stride(1) == 1, op, ": theta must be float32 [B, 3]");
  keep.scores = scores_in.contiguous().to(at::kFloat);
  keep.nblk = nblk_in.contiguous();
  keep.nblk_next = nblk_next_in.contiguous();
  const Tensor& scores = keep.scores;
  const Tensor& nblk = keep.nblk;
  const Tensor& nblk_next = keep.nblk_next;
  const int64_t B = scores.size(0), Hk = level.size(1), NB = level.size(2);
  TORCH_CHECK(NB <= prr::max_topk_blocks(), op, ": ", NB, " blocks per row, at most ",
              prr::max_topk_blocks(), " supported");
  TORCH_CHECK(scores.dim() == 3 && scores.size(1) == Hk && scores.size(2) == NB,
              op, ": scores must be [B, ", Hk, ", ", NB, "], got ", scores.sizes());
  // P may be wider than this step's n_pred + sink + local (the request pool's P has the width of
  // the largest budget): the list is written over the whole width, -1 past its count.
  const int64_t n_out = n_pred + sink + local;
  TORCH_CHECK(idx.is_contiguous() && cnt.is_contiguous() && idx.scalar_type() == at::kInt &&
              cnt.scalar_type() == at::kInt && idx.size(-1) >= n_out,
              op, ": p_idx/p_cnt must be contiguous int32 with at least ", n_out,
              " entries, got ", idx.size(-1));
  prr::PredictArgs a{};
  a.rows = slots_ptr(rows_in, B, a.rows64, keep.rows, op);
  a.p_rows = slots_ptr(p_rows_in, B, a.p_rows64, keep.p_rows, op);
  a.rows_n = level.size(0); a.p_rows_n = idx.size(0);
  if (!rows_in.has_value())
    TORCH_CHECK(level.size(0) == B, op, ": level has ", level.size(0), " rows, scores ",
                B);
  a.level = level.data_ptr<float>(); a.trend = trend.data_ptr<float>();
  a.n_init = n_init.data_ptr(); a.ninit64 = index64(n_init, "n_init");
  a.scores = scores.data_ptr<float>();
  a.nblk = nblk.data_ptr(); a.nblk64 = index64(nblk, "nblk");
  a.nblk_next = nblk_next.data_ptr(); a.nblk_next64 = index64(nblk_next, "nblk_next");
  a.theta = theta.data_ptr<float>(); a.theta_stride = theta.stride(0);
  a.idx = idx.data_ptr<int32_t>(); a.cnt = cnt.data_ptr<int32_t>(); a.n_out = (int)idx.size(-1);
  a.sem = group_counters(level, kCntPredict, B, op);
  a.B = (int)B; a.Hk = (int)Hk; a.NB = (int)NB; a.k = (int)n_pred; a.sink = (int)sink;
  a.local = (int)local;
  return a;
}

}  // namespace prr_bind

namespace {
using namespace prr_bind;

// Fills the attention arguments shared by sparse_attn_partials and sparse_attn_merge; the
// partials go to o/lse ([B, Hq, N, D] / [B, Hq, N], allocated here).
prr::AttnArgs attn_args(const Tensor& q, const Tensor& k_buf, const Tensor& v_buf,
                        const Tensor& table, const Tensor& sl, const Tensor& idx,
                        const Tensor& cnt, int64_t page_size, double sm_scale, Tensor& o,
                        Tensor& lse, const char* op) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, op,
              ": q must be [B, Hq, D] and k_buf/v_buf [num_slots, Hk, D]");
  TORCH_CHECK(k_buf.stride(2) == 1 && v_buf.stride(2) == 1, op,
              ": KV buffers need a contiguous last dim");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), op, ": k_buf is ",
              k_buf.scalar_type(), " but v_buf is ", v_buf.scalar_type());
  TORCH_CHECK(k_buf.scalar_type() == at::kHalf || k_buf.scalar_type() == at::kBFloat16, op,
              ": the kernel reads float16 or bfloat16 KV (16-bit MMAs), got ",
              k_buf.scalar_type(), "; sglang_prr.ops runs the reference for float32 KV");
  TORCH_CHECK(idx.scalar_type() == at::kInt && cnt.scalar_type() == at::kInt, op,
              ": idx/cnt must be int32");
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1, op,
              ": table must be [B, NB] with a contiguous last dim");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hk = idx.size(1), N = idx.size(2);
  o = at::empty({B, Hq, N, D}, q.options().dtype(at::kFloat));
  lse = at::empty({B, Hq, N}, q.options().dtype(at::kFloat));
  prr::AttnArgs a{};
  a.q = q.data_ptr(); a.q_dtype = dtype_code(q); a.q_stride = q.stride(0);
  a.k = k_buf.data_ptr(); a.v = v_buf.data_ptr(); a.kv_dtype = dtype_code(k_buf);
  a.k_stride_slot = k_buf.stride(0); a.k_stride_head = k_buf.stride(1);
  a.v_stride_slot = v_buf.stride(0); a.v_stride_head = v_buf.stride(1);
  a.table = table.data_ptr(); a.table64 = index64(table, "table"); a.table_stride = table.stride(0);
  a.NB = (int)table.size(1);
  a.num_pages = k_buf.size(0) / page_size;
  a.seq_lens = sl.data_ptr(); a.seq64 = index64(sl, "seq_lens");
  a.idx = idx.data_ptr<int32_t>(); a.cnt = cnt.data_ptr<int32_t>();
  a.o = o.data_ptr<float>(); a.lse = lse.data_ptr<float>();
  a.B = (int)B; a.Hq = (int)Hq; a.Hk = (int)Hk; a.N = (int)N; a.D = (int)D;
  a.page_size = (int)page_size; a.sm_scale = (float)sm_scale;
  return a;
}

std::tuple<Tensor, Tensor> sparse_attn_partials(const Tensor& q_in, const Tensor& k_buf,
                                                const Tensor& v_buf, const Tensor& table,
                                                const Tensor& seq_lens, const Tensor& idx_in,
                                                const Tensor& cnt_in, int64_t page_size,
                                                double sm_scale,
                                                const c10::optional<Tensor>& idx_rows) {
  check_cuda(q_in, "q");
  c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = q_view(q_in), idx = idx_in.contiguous(), cnt = cnt_in.contiguous();
  const Tensor sl = seq_lens.contiguous();
  Tensor o, lse, rows;
  prr::AttnArgs a = attn_args(q, k_buf, v_buf, table, sl, idx, cnt, page_size, sm_scale, o, lse,
                              "sparse_attn_partials");
  // With idx_rows the lists are pool rows [R, Hk, N]; the partials stay [B, Hq, N, ...].
  a.idx_rows = slots_ptr(idx_rows, q.size(0), a.idx_rows64, rows, "sparse_attn_partials");
  a.idx_rows_n = idx.size(0);
  check_launch(prr::launch_sparse_attn_partials(a, stream()), "sparse_attn_partials");
  return std::make_tuple(o, lse);
}

// Attention over idx and the merge of its partials (plus the optional speculative partials,
// filtered to P n A when exact) in one launch: (o [B, Hq, D] f32, lse [B, Hq] f32).
std::tuple<Tensor, Tensor> sparse_attn_merge(
    const Tensor& q_in, const Tensor& k_buf, const Tensor& v_buf, const Tensor& table,
    const Tensor& seq_lens, const Tensor& idx_in, const Tensor& cnt_in, int64_t page_size,
    double sm_scale, const c10::optional<Tensor>& o_spec, const c10::optional<Tensor>& lse_spec,
    const c10::optional<Tensor>& p_idx, const c10::optional<Tensor>& p_cnt,
    const c10::optional<Tensor>& a_idx, const c10::optional<Tensor>& a_cnt, int64_t nb,
    bool exact, const c10::optional<Tensor>& p_rows,
    c10::optional<at::ScalarType> out_dtype) {
  check_cuda(q_in, "q");
  c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = q_view(q_in), idx = idx_in.contiguous(), cnt = cnt_in.contiguous();
  const Tensor sl = seq_lens.contiguous();
  Tensor o_ws, lse_ws;
  prr::AttnArgs a = attn_args(q, k_buf, v_buf, table, sl, idx, cnt, page_size, sm_scale, o_ws,
                              lse_ws, "sparse_attn_merge");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  auto o = at::empty({B, Hq, D}, q.options().dtype(out_dtype.value_or(at::kFloat)));
  auto lse = at::empty({B, Hq}, q.options().dtype(at::kFloat));
  a.out_o = o.data_ptr(); a.out_dtype = dtype_code(o); a.out_lse = lse.data_ptr<float>();
  Tensor os, ls, pi, pc, ai, ac, pr;
  if (o_spec.has_value()) {
    TORCH_CHECK(lse_spec.has_value(), "sparse_attn_merge: o_spec given without lse_spec");
    os = o_spec->contiguous(); ls = lse_spec->contiguous();
    TORCH_CHECK(os.scalar_type() == at::kFloat && ls.scalar_type() == at::kFloat &&
                os.dim() == 4 && os.size(0) == B && os.size(1) == Hq && os.size(3) == D,
                "sparse_attn_merge: o_spec must be float32 [B, Hq, N1, D] = [", B, ", ", Hq,
                ", N1, ", D, "], got ", os.sizes());
    a.o1 = os.data_ptr<float>(); a.lse1 = ls.data_ptr<float>(); a.N1 = (int)os.size(2);
    if (exact) {
      TORCH_CHECK(p_idx.has_value() && p_cnt.has_value() && a_idx.has_value() &&
                  a_cnt.has_value(), "sparse_attn_merge: exact needs p_idx, p_cnt, a_idx, a_cnt");
      ai = a_idx->contiguous(); ac = a_cnt->contiguous();
      TORCH_CHECK(ai.scalar_type() == at::kInt && ac.scalar_type() == at::kInt,
                  "sparse_attn_merge: lists and counts must be int32");
      a.a_idx = ai.data_ptr<int32_t>(); a.a_cnt = ac.data_ptr<int32_t>();
      a.Na = (int)ai.size(-1);
      a.p_exact = true;
    }
    // P's list (exact: always; union: when given) drops repeated ids of P.
    if (p_idx.has_value() && p_cnt.has_value()) {
      pi = p_idx->contiguous(); pc = p_cnt->contiguous();
      TORCH_CHECK(pi.scalar_type() == at::kInt && pc.scalar_type() == at::kInt,
                  "sparse_attn_merge: lists and counts must be int32");
      TORCH_CHECK(pi.size(-1) == a.N1, "sparse_attn_merge: p_idx has ", pi.size(-1),
                  " entries but o_spec has ", a.N1);
      a.p_idx = pi.data_ptr<int32_t>(); a.p_cnt = pc.data_ptr<int32_t>();
      a.p_rows = slots_ptr(p_rows, B, a.p_rows64, pr, "sparse_attn_merge");
      a.p_rows_n = pi.size(0);
    }
  }
  a.sem = group_counters(q, kCntAttnMerge, B * a.Hk, "sparse_attn_merge");
  check_launch(prr::launch_sparse_attn_partials(a, stream()), "sparse_attn_merge");
  return std::make_tuple(o, lse);
}

Tensor quest_scores(const Tensor& q_in, const Tensor& kmin, const Tensor& kmax,
                    const Tensor& table, const Tensor& nblk_in) {
  check_cuda(q_in, "q");
  c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = q_in.contiguous();
  const int s_dtype = summary_code(kmin, kmax, "quest_scores");
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1, "quest_scores: table must be [B, NB]");
  const Tensor nblk = nblk_in.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = kmin.size(1),
                NB = table.size(1);
  auto out = at::empty({B, Hk, NB}, q.options().dtype(at::kFloat));
  prr::QuestArgs a{};
  a.q = q.data_ptr(); a.q_dtype = dtype_code(q); a.q_stride = q.stride(0);
  a.kmin = kmin.data_ptr(); a.kmax = kmax.data_ptr(); a.s_dtype = s_dtype;
  a.num_pages = kmin.size(0);
  a.table = table.data_ptr(); a.table64 = index64(table, "table"); a.table_stride = table.stride(0);
  a.nblk = nblk.data_ptr(); a.nblk64 = index64(nblk, "nblk");
  a.out = out.data_ptr<float>();
  a.B = (int)B; a.Hq = (int)Hq; a.Hk = (int)Hk; a.NB = (int)NB; a.D = (int)D;
  check_launch(prr::launch_quest_scores(a, stream()), "quest_scores");
  return out;
}

std::tuple<Tensor, Tensor> topk_common(const Tensor& scores, const Tensor* trend,
                                       const Tensor* gamma, const Tensor* n_init,
                                       const Tensor& nblk_in, int64_t k, int64_t sink,
                                       int64_t local, int64_t n_out,
                                       const c10::optional<Tensor>& dense_row = c10::nullopt) {
  check_cuda(scores, "scores");
  c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(scores.is_contiguous() && scores.scalar_type() == at::kFloat,
              "select_topk: scores must be contiguous float32");
  const Tensor nblk = nblk_in.contiguous();
  const int64_t B = scores.size(0), Hk = scores.size(1), NB = scores.size(2);
  TORCH_CHECK(NB <= prr::max_topk_blocks(), "select_topk: ", NB, " blocks per row, at most ",
              prr::max_topk_blocks(), " supported");
  auto idx = at::empty({B, Hk, n_out}, scores.options().dtype(at::kInt));
  auto cnt = at::empty({B, Hk}, scores.options().dtype(at::kInt));
  prr::TopkArgs a{};
  a.scores = scores.data_ptr<float>();
  Tensor ni;
  if (trend) {
    TORCH_CHECK(trend->is_contiguous() && trend->scalar_type() == at::kFloat,
                "predict_set: trend must be contiguous float32");
    TORCH_CHECK(gamma->scalar_type() == at::kFloat, "predict_set: gamma must be float32");
    a.trend = trend->data_ptr<float>();
    a.gamma = gamma->data_ptr<float>(); a.gamma_stride = gamma->stride(0);
    ni = n_init->contiguous();
    a.n_init = ni.data_ptr(); a.ninit64 = index64(ni, "n_init");
  }
  a.nblk = nblk.data_ptr(); a.nblk64 = index64(nblk, "nblk");
  Tensor dr;
  if (dense_row.has_value()) {
    dr = dense_row->contiguous();
    TORCH_CHECK(dr.scalar_type() == at::kBool && dr.numel() == B,
                "select_topk: dense_row must be bool [", B, "]");
    a.dense_row = dr.data_ptr<bool>();
  }
  a.idx = idx.data_ptr<int32_t>(); a.cnt = cnt.data_ptr<int32_t>();
  a.B = (int)B; a.Hk = (int)Hk; a.NB = (int)NB; a.k = (int)k; a.sink = (int)sink;
  a.local = (int)local; a.n_out = (int)n_out;
  check_launch(prr::launch_select_topk(a, stream()), "select_topk");
  return std::make_tuple(idx, cnt);
}

std::tuple<Tensor, Tensor> select_topk(const Tensor& scores, const Tensor& nblk, int64_t k,
                                       int64_t sink, int64_t local, int64_t n_out,
                                       const c10::optional<Tensor>& dense_row) {
  return topk_common(scores, nullptr, nullptr, nullptr, nblk, k, sink, local, n_out, dense_row);
}

std::tuple<Tensor, Tensor> predict_set(const Tensor& level, const Tensor& trend,
                                       const Tensor& gamma, const Tensor& n_init,
                                       const Tensor& nblk_next, int64_t n_pred, int64_t sink,
                                       int64_t local) {
  return topk_common(level, &trend, &gamma, &n_init, nblk_next, n_pred, sink, local,
                     n_pred + sink + local);
}

std::tuple<Tensor, Tensor> set_difference(const Tensor& a_idx_in, const Tensor& a_cnt_in,
                                          const Tensor& p_idx_in, const Tensor& p_cnt_in,
                                          int64_t nb, const c10::optional<Tensor>& p_rows_in,
                                          const c10::optional<Tensor>& stats,
                                          const c10::optional<Tensor>& dense_row_in) {
  check_cuda(a_idx_in, "a_idx");
  c10::cuda::CUDAGuard guard(a_idx_in.device());
  const Tensor a_idx = a_idx_in.contiguous(), a_cnt = a_cnt_in.contiguous();
  const Tensor p_idx = p_idx_in.contiguous(), p_cnt = p_cnt_in.contiguous();
  TORCH_CHECK(a_idx.scalar_type() == at::kInt && p_idx.scalar_type() == at::kInt &&
              a_cnt.scalar_type() == at::kInt && p_cnt.scalar_type() == at::kInt,
              "set_difference: lists and counts must be int32");
  auto m_idx = at::empty(a_idx.sizes(), a_idx.options());
  auto m_cnt = at::empty(a_cnt.sizes(), a_cnt.options());
  prr::SetDiffArgs a{};
  a.a_idx = a_idx.data_ptr<int32_t>(); a.a_cnt = a_cnt.data_ptr<int32_t>();
  a.Na = (int)a_idx.size(-1);
  a.p_idx = p_idx.data_ptr<int32_t>(); a.p_cnt = p_cnt.data_ptr<int32_t>();
  a.Np = (int)p_idx.size(-1);
  a.m_idx = m_idx.data_ptr<int32_t>(); a.m_cnt = m_cnt.data_ptr<int32_t>();
  a.n_out = a.Na; a.rows = (int)a_cnt.numel(); a.nb = (int)nb; a.Hk = (int)a_idx.size(1);
  Tensor p_rows, dense_row;
  if (p_rows_in.has_value()) {
    p_rows = p_rows_in->contiguous();
    a.p_rows = p_rows.data_ptr(); a.p_rows64 = index64(p_rows, "p_rows");
    a.p_rows_n = p_idx.size(0);
  }
  if (stats.has_value()) {
    TORCH_CHECK(stats->scalar_type() == at::kLong && stats->is_contiguous() &&
                stats->numel() == prr::kNumStatSlots, "set_difference: stats must be contiguous "
                "int64 [", prr::kNumStatSlots, "]");
    a.stats = reinterpret_cast<unsigned long long*>(stats->data_ptr<int64_t>());
    if (dense_row_in.has_value()) {
      dense_row = dense_row_in->contiguous();
      a.dense_row = dense_row.data_ptr<bool>();
    }
  }
  check_launch(prr::launch_set_difference(a, stream()), "set_difference");
  return std::make_tuple(m_idx, m_cnt);
}

void accumulate_stats(Tensor& stats, const Tensor& a_cnt_in, const Tensor& m_cnt_in,
                      const c10::optional<Tensor>& p_cnt_in,
                      const c10::optional<Tensor>& dense_row_in) {
  check_cuda(a_cnt_in, "a_cnt");
  c10::cuda::CUDAGuard guard(a_cnt_in.device());
  TORCH_CHECK(stats.scalar_type() == at::kLong && stats.is_contiguous() &&
              stats.numel() == prr::kNumStatSlots, "accumulate_stats: stats must be contiguous "
              "int64 [", prr::kNumStatSlots, "]");
  const Tensor a_cnt = a_cnt_in.contiguous(), m_cnt = m_cnt_in.contiguous();
  TORCH_CHECK(a_cnt.dim() == 2 && a_cnt.scalar_type() == at::kInt &&
              m_cnt.sizes() == a_cnt.sizes() && m_cnt.scalar_type() == at::kInt,
              "accumulate_stats: a_cnt and m_cnt must be int32 [B, Hk]");
  prr::StatsArgs a{};
  Tensor p_cnt, dense_row;
  if (p_cnt_in.has_value()) {
    p_cnt = p_cnt_in->contiguous();
    TORCH_CHECK(p_cnt.sizes() == a_cnt.sizes() && p_cnt.scalar_type() == at::kInt,
                "accumulate_stats: p_cnt must be int32 like a_cnt");
    a.p_cnt = p_cnt.data_ptr<int32_t>();
  }
  if (dense_row_in.has_value()) {
    dense_row = dense_row_in->contiguous();
    TORCH_CHECK(dense_row.scalar_type() == at::kBool && dense_row.numel() == a_cnt.size(0),
                "accumulate_stats: dense_row must be bool [", a_cnt.size(0), "]");
    a.dense_row = dense_row.data_ptr<bool>();
  }
  a.stats = reinterpret_cast<unsigned long long*>(stats.data_ptr<int64_t>());
  a.a_cnt = a_cnt.data_ptr<int32_t>(); a.m_cnt = m_cnt.data_ptr<int32_t>();
  a.B = (int)a_cnt.size(0); a.Hk = (int)a_cnt.size(1);
  check_launch(prr::launch_accumulate_stats(a, stream()), "accumulate_stats");
}

void holt_update(Tensor& level, Tensor& trend, Tensor& n_init, const Tensor& scores_in,
                 const Tensor& nblk_in, const Tensor& alpha, const Tensor& beta) {
  check_cuda(level, "level");
  c10::cuda::CUDAGuard guard(level.device());
  TORCH_CHECK(level.is_contiguous() && trend.is_contiguous() && n_init.is_contiguous() &&
              level.scalar_type() == at::kFloat && trend.scalar_type() == at::kFloat,
              "holt_update: level/trend must be contiguous float32 and n_init contiguous");
  TORCH_CHECK(alpha.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat,
              "holt_update: alpha/beta must be float32");
  const Tensor scores = scores_in.contiguous().to(at::kFloat);
  const Tensor nblk = nblk_in.contiguous();
  prr::HoltArgs a{};
  a.level = level.data_ptr<float>(); a.trend = trend.data_ptr<float>();
  a.n_init = n_init.data_ptr(); a.ninit64 = index64(n_init, "n_init");
  a.scores = scores.data_ptr<float>();
  a.nblk = nblk.data_ptr(); a.nblk64 = index64(nblk, "nblk");
  a.alpha = alpha.data_ptr<float>(); a.alpha_stride = alpha.stride(0);
  a.beta = beta.data_ptr<float>(); a.beta_stride = beta.stride(0);
  a.B = (int)level.size(0); a.Hk = (int)level.size(1); a.NB = (int)level.size(2);
  check_launch(prr::launch_holt_update(a, stream()), "holt_update");
}

Tensor calib_grid_terms(const Tensor& scores, const Tensor& nblk, const Tensor& wa,
                        const Tensor& am, const Tensor& alphas, const Tensor& betas,
                        const Tensor& gammas, int64_t n_pred, int64_t sink, int64_t local) {
  check_cuda(scores, "scores");
  c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(scores.dim() == 4 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "calib_grid_terms: scores must be contiguous float32 [R, Phi, Hk, NB]");
  const int64_t R = scores.size(0), Phi = scores.size(1), Hk = scores.size(2), NB = scores.size(3);
  TORCH_CHECK(nblk.scalar_type() == at::kLong && nblk.is_contiguous() && nblk.numel() == R * Phi,
              "calib_grid_terms: nblk must be contiguous int64 [R, Phi]");
  TORCH_CHECK(NB <= prr::max_calib_blocks(), "calib_grid_terms: ", NB, " blocks per row, at most ",
              prr::max_calib_blocks());
  const int64_t rows = Phi > 1 ? (Phi - 1) * R * Hk * NB : 0;
  TORCH_CHECK(wa.scalar_type() == at::kFloat && wa.is_contiguous() && wa.numel() == rows &&
              am.scalar_type() == at::kBool && am.is_contiguous() && am.numel() == rows,
              "calib_grid_terms: wa/am must be contiguous float32/bool [Phi-1, R, Hk, NB]");
  for (const Tensor* t : {&alphas, &betas, &gammas})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1,
                "calib_grid_terms: alphas/betas/gammas must be contiguous float32 vectors");
  const int64_t C = alphas.numel() * betas.numel() * gammas.numel();
  Tensor out = at::empty({Phi > 1 ? Phi - 1 : 0, R, C, Hk}, scores.options());
  prr::CalibArgs a{};
  a.scores = scores.data_ptr<float>();
  a.nblk = reinterpret_cast<const long long*>(nblk.data_ptr<int64_t>());
  a.wa = wa.data_ptr<float>(); a.am = am.data_ptr<bool>();
  a.alphas = alphas.data_ptr<float>(); a.betas = betas.data_ptr<float>();
  a.gammas = gammas.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.R = (int)R; a.Phi = (int)Phi; a.Hk = (int)Hk; a.NB = (int)NB;
  a.A = (int)alphas.numel(); a.B = (int)betas.numel(); a.G = (int)gammas.numel();
  a.n_pred = (int)n_pred; a.sink = (int)sink; a.local = (int)local;
  check_launch(prr::launch_calib_grid_terms(a, stream()), "calib_grid_terms");
  return out;
}

std::tuple<Tensor, Tensor> merge_common(const Tensor& o1_in, const Tensor& lse1_in,
                                        const Tensor* o2_in, const Tensor* lse2_in,
                                        const Tensor* p_idx_in, const Tensor* p_cnt_in,
                                        const Tensor* a_idx_in, const Tensor* a_cnt_in,
                                        int64_t nb, bool exact = true) {
  check_cuda(o1_in, "o");
  c10::cuda::CUDAGuard guard(o1_in.device());
  const Tensor o1 = o1_in.contiguous().to(at::kFloat), lse1 = lse1_in.contiguous().to(at::kFloat);
  const int64_t D = o1.size(-1), N1 = o1.size(-2);
  const int64_t R = N1 > 0 ? lse1.numel() / N1 : 0;
  std::vector<int64_t> oshape(o1.sizes().begin(), o1.sizes().end() - 2);
  std::vector<int64_t> lshape = oshape;
  oshape.push_back(D);
  auto o = at::empty(oshape, o1.options().dtype(at::kFloat));
  auto lse = at::empty(lshape, o1.options().dtype(at::kFloat));
  prr::MergeArgs a{};
  a.o1 = o1.data_ptr<float>(); a.lse1 = lse1.data_ptr<float>(); a.N1 = (int)N1;
  Tensor o2, lse2, p_idx, p_cnt, a_idx, a_cnt;
  if (o2_in) {
    o2 = o2_in->contiguous().to(at::kFloat); lse2 = lse2_in->contiguous().to(at::kFloat);
    a.o2 = o2.data_ptr<float>(); a.lse2 = lse2.data_ptr<float>(); a.N2 = (int)o2.size(-2);
  }
  if (p_idx_in) {
    p_idx = p_idx_in->contiguous(); p_cnt = p_cnt_in->contiguous();
    a_idx = a_idx_in->contiguous(); a_cnt = a_cnt_in->contiguous();
    TORCH_CHECK(p_idx.scalar_type() == at::kInt && a_idx.scalar_type() == at::kInt &&
                p_cnt.scalar_type() == at::kInt && a_cnt.scalar_type() == at::kInt,
                "prr_merge: lists and counts must be int32");
    a.p_idx = p_idx.data_ptr<int32_t>(); a.p_cnt = p_cnt.data_ptr<int32_t>();
    a.a_idx = a_idx.data_ptr<int32_t>(); a.a_cnt = a_cnt.data_ptr<int32_t>();
    a.Na = (int)a_idx.size(-1); a.Hk = (int)p_idx.size(1); a.Hq = (int)o1.size(1);
    TORCH_CHECK(p_idx.size(-1) == N1, "prr_merge: p_idx has ", p_idx.size(-1),
                " entries but o_spec has ", N1);
  }
  a.nb = (int)nb;
  a.exact = exact;
  a.o = o.data_ptr<float>(); a.lse = lse.data_ptr<float>();
  a.R = (int)R; a.D = (int)D;
  if (R > 0) check_launch(prr::launch_merge(a, stream()), "merge");
  return std::make_tuple(o, lse);
}

std::tuple<Tensor, Tensor> prr_merge(const Tensor& o_spec, const Tensor& lse_spec,
                                     const Tensor& p_idx, const Tensor& p_cnt,
                                     const Tensor& a_idx, const Tensor& a_cnt,
                                     const Tensor& o_rep, const Tensor& lse_rep, int64_t nb,
                                     bool exact) {
  return merge_common(o_spec, lse_spec, &o_rep, &lse_rep, &p_idx, &p_cnt, &a_idx, &a_cnt, nb,
                      exact);
}

std::tuple<Tensor, Tensor> merge_partials(const Tensor& o, const Tensor& lse) {
  return merge_common(o, lse, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0);
}

// Fused Holt update + P(t+1) into idx/cnt; with rows, every state tensor (and idx/cnt) is the
// request pool's [R, ...] and batch entry b updates row rows[b] in place.
void predict_common(Tensor& level, Tensor& trend, Tensor& n_init, const Tensor& scores,
                    const Tensor& nblk, const Tensor& theta, const Tensor& nblk_next,
                    int64_t n_pred, int64_t sink, int64_t local, Tensor& idx, Tensor& cnt,
                    const c10::optional<Tensor>& rows,
                    const c10::optional<Tensor>& p_rows = c10::nullopt) {
  check_cuda(level, "level");
  c10::cuda::CUDAGuard guard(level.device());
  PredictInputs keep;
  const prr::PredictArgs a = predict_args(level, trend, n_init, scores, nblk, theta, nblk_next,
                                          n_pred, sink, local, idx, cnt, rows, p_rows, keep,
                                          "predict_update");
  check_launch(prr::launch_predict_update(a, stream()), "predict_update");
}

std::tuple<Tensor, Tensor> predict_update(Tensor& level, Tensor& trend, Tensor& n_init,
                                          const Tensor& scores, const Tensor& nblk,
                                          const Tensor& theta, const Tensor& nblk_next,
                                          int64_t n_pred, int64_t sink, int64_t local) {
  const int64_t B = level.size(0), Hk = level.size(1);
  auto idx = at::empty({B, Hk, n_pred + sink + local}, level.options().dtype(at::kInt));
  auto cnt = at::empty({B, Hk}, level.options().dtype(at::kInt));
  predict_common(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred, sink, local, idx,
                 cnt, c10::nullopt);
  return std::make_tuple(idx, cnt);
}

// The request pool's state in place: level/trend [R, Hk, NB], n_init [R], theta [R, 3],
// p_idx/p_cnt [R, Hk, >= n_pred + sink + local] / [R, Hk]; batch entry b is row rows[b].
void predict_update_rows(Tensor& level, Tensor& trend, Tensor& n_init, Tensor& p_idx,
                         Tensor& p_cnt, const Tensor& theta, const Tensor& rows,
                         const Tensor& scores, const Tensor& nblk, const Tensor& nblk_next,
                         int64_t n_pred, int64_t sink, int64_t local,
                         const c10::optional<Tensor>& p_rows) {
  predict_common(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred, sink, local,
                 p_idx, p_cnt, rows, p_rows);
}

void quest_update(Tensor& kmin, Tensor& kmax, const Tensor& k_in, const Tensor& out_loc_in,
                  const Tensor& positions_in, int64_t page_size, bool one_per_page) {
  check_cuda(kmin, "kmin");
  c10::cuda::CUDAGuard guard(kmin.device());
  const int s_dtype = summary_code(kmin, kmax, "quest_update");
  const Tensor k = k_in.contiguous(), out_loc = out_loc_in.contiguous(),
               positions = positions_in.contiguous();
  prr::QuestUpdateArgs a{};
  a.kmin = kmin.data_ptr(); a.kmax = kmax.data_ptr(); a.s_dtype = s_dtype;
  a.num_pages = kmin.size(0);
  a.k = k.data_ptr(); a.k_dtype = dtype_code(k);
  a.out_loc = out_loc.data_ptr(); a.loc64 = index64(out_loc, "out_loc");
  a.positions = positions.data_ptr(); a.pos64 = index64(positions, "positions");
  a.N = (int)k.size(0); a.Hk = (int)kmin.size(1); a.D = (int)kmin.size(2);
  a.page_size = (int)page_size; a.one_per_page = one_per_page;
  check_launch(prr::launch_quest_update(a, stream()), "quest_update");
}

bool launches_with_pdl() { return prr::launches_with_pdl(); }

int64_t attn_spread_launches() { return prr::attn_spread_launches(); }

int64_t scores_stream_launches() { return prr::scores_stream_launches(); }

// The timing probe's records of the last probed launch (SGLANG_PRR_ATTN_TIMELINE=1 or
// SGLANG_PRR_SELECT_TIMELINE=1): [ctas, kTimelineSlots] int64 on the host, and the SM clock in
// kHz (clock64 stamps to time). Waits for the device: development only.
std::tuple<Tensor, int64_t> probe_timeline() {
  const int64_t n = prr::probe_timeline_ctas();
  Tensor t = at::empty({n, prr::kTimelineSlots}, at::TensorOptions().dtype(at::kLong));
  if (n > 0) {
    TORCH_CHECK(cudaDeviceSynchronize() == cudaSuccess, "probe_timeline: the device failed");
    TORCH_CHECK(prr::probe_timeline_read(
                    reinterpret_cast<unsigned long long*>(t.data_ptr<int64_t>()), n) >= 0,
                "probe_timeline: the copy failed");
  }
  int dev = 0, khz = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) != cudaSuccess)
    khz = 0;
  return std::make_tuple(t, (int64_t)khz);
}

}  // namespace

TORCH_LIBRARY(sglang_prr_cuda, m) {
  m.def("sparse_attn_partials(Tensor q, Tensor k_buf, Tensor v_buf, Tensor table, "
        "Tensor seq_lens, Tensor idx, Tensor cnt, int page_size, float sm_scale, "
        "Tensor? idx_rows=None) -> (Tensor, Tensor)");
  m.def("quest_scores(Tensor q, Tensor kmin, Tensor kmax, Tensor table, Tensor nblk) -> Tensor");
  m.def("select_topk(Tensor scores, Tensor nblk, int k, int sink_blocks, int local_blocks, "
        "int n_out, Tensor? dense_row=None) -> (Tensor, Tensor)");
  m.def("predict_set(Tensor level, Tensor trend, Tensor gamma, Tensor n_init, Tensor nblk_next, "
        "int n_pred, int sink_blocks, int local_blocks) -> (Tensor, Tensor)");
  m.def("set_difference(Tensor a_idx, Tensor a_cnt, Tensor p_idx, Tensor p_cnt, int nb, "
        "Tensor? p_rows=None, Tensor(a!)? stats=None, Tensor? dense_row=None) "
        "-> (Tensor, Tensor)");
  m.def("accumulate_stats(Tensor(a!) stats, Tensor a_cnt, Tensor m_cnt, Tensor? p_cnt, "
        "Tensor? dense_row) -> ()");
  m.def("select_lists(Tensor scores, Tensor nblk, Tensor? p_idx, Tensor? p_cnt, int k, "
        "int sink_blocks, int local_blocks, int n_out, Tensor? p_rows=None, "
        "Tensor? dense_row=None, Tensor(a!)? stats=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("holt_update(Tensor(a!) level, Tensor(b!) trend, Tensor(c!) n_init, Tensor scores, "
        "Tensor nblk, Tensor alpha, Tensor beta) -> ()");
  m.def("prr_merge(Tensor o_spec, Tensor lse_spec, Tensor p_idx, Tensor p_cnt, Tensor a_idx, "
        "Tensor a_cnt, Tensor o_rep, Tensor lse_rep, int nb, bool exact) -> (Tensor, Tensor)");
  m.def("merge_partials(Tensor o, Tensor lse) -> (Tensor, Tensor)");
  m.def("quest_update(Tensor(a!) kmin, Tensor(b!) kmax, Tensor k, Tensor out_loc, "
        "Tensor positions, int page_size, bool one_per_page=False) -> ()");
  m.def("sparse_attn_merge(Tensor q, Tensor k_buf, Tensor v_buf, Tensor table, "
        "Tensor seq_lens, Tensor idx, Tensor cnt, int page_size, float sm_scale, "
        "Tensor? o_spec, Tensor? lse_spec, Tensor? p_idx, Tensor? p_cnt, Tensor? a_idx, "
        "Tensor? a_cnt, int nb, bool exact, Tensor? p_rows=None, ScalarType? out_dtype=None) "
        "-> (Tensor, Tensor)");
  m.def("quest_select(Tensor q, Tensor(a!) kmin, Tensor(b!) kmax, Tensor table, Tensor nblk, "
        "Tensor? p_idx, Tensor? p_cnt, int k, int sink_blocks, int local_blocks, int n_out, "
        "Tensor? p_rows=None, Tensor? dense_row=None, Tensor(c!)? stats=None, "
        "Tensor? new_k=None, Tensor? new_pos=None, int page_size=0, Tensor? new_loc=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("predict_update(Tensor(a!) level, Tensor(b!) trend, Tensor(c!) n_init, Tensor scores, "
        "Tensor nblk, Tensor theta, Tensor nblk_next, int n_pred, int sink_blocks, "
        "int local_blocks) -> (Tensor, Tensor)");
  m.def("predict_update_rows(Tensor(a!) level, Tensor(b!) trend, Tensor(c!) n_init, "
        "Tensor(d!) p_idx, Tensor(e!) p_cnt, Tensor theta, Tensor rows, Tensor scores, "
        "Tensor nblk, Tensor nblk_next, int n_pred, int sink_blocks, int local_blocks, "
        "Tensor? p_rows=None) -> ()");
  m.def("quest_select_predict(Tensor q, Tensor(a!) kmin, Tensor(b!) kmax, Tensor table, "
        "Tensor nblk, Tensor nblk_next, Tensor(c!) p_idx, Tensor(d!) p_cnt, Tensor p_rows, "
        "Tensor p_next_rows, Tensor(e!) level, Tensor(f!) trend, Tensor(g!) n_init, "
        "Tensor theta, Tensor rows, int k, int n_pred, int sink_blocks, int local_blocks, "
        "int n_out, Tensor? dense_row=None, Tensor(h!)? stats=None, Tensor? new_k=None, "
        "Tensor? new_pos=None, int page_size=0, Tensor? new_loc=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("select_lists_predict(Tensor scores, Tensor nblk, Tensor nblk_next, Tensor(a!) p_idx, "
        "Tensor(b!) p_cnt, Tensor p_rows, Tensor p_next_rows, Tensor(c!) level, "
        "Tensor(d!) trend, Tensor(e!) n_init, Tensor theta, Tensor rows, int k, int n_pred, "
        "int sink_blocks, int local_blocks, int n_out, Tensor? dense_row=None, "
        "Tensor(f!)? stats=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("calib_grid_terms(Tensor scores, Tensor nblk, Tensor wa, Tensor am, Tensor alphas, "
        "Tensor betas, Tensor gammas, int n_pred, int sink_blocks, int local_blocks) -> Tensor");
  m.def("prepare(Tensor like) -> ()");
  // No tensor argument: a catch-all kernel (dispatched without a device).
  m.def("launches_with_pdl() -> bool", &launches_with_pdl);
  m.def("attn_spread_launches() -> int", &attn_spread_launches);
  m.def("scores_stream_launches() -> int", &scores_stream_launches);
  m.def("probe_timeline() -> (Tensor, int)", &probe_timeline);
}

TORCH_LIBRARY_IMPL(sglang_prr_cuda, CUDA, m) {
  m.impl("sparse_attn_partials", &sparse_attn_partials);
  m.impl("quest_scores", &quest_scores);
  m.impl("select_topk", &select_topk);
  m.impl("predict_set", &predict_set);
  m.impl("set_difference", &set_difference);
  m.impl("accumulate_stats", &accumulate_stats);
  m.impl("holt_update", &holt_update);
  m.impl("prr_merge", &prr_merge);
  m.impl("merge_partials", &merge_partials);
  m.impl("quest_update", &quest_update);
  m.impl("sparse_attn_merge", &sparse_attn_merge);
  m.impl("predict_update", &predict_update);
  m.impl("predict_update_rows", &predict_update_rows);
  m.impl("calib_grid_terms", &calib_grid_terms);
  m.impl("prepare", &prepare);
}
