// Torch op bindings of the selections: Quest's (quest_select, quest_select_predict: scores,
// top-K, M = A \ P and, for the second, the predictor's step, in one launch), select_lists
// (top-K, M and the counters of any method's scores, in one launch) and select_lists_predict
// (select_lists with the predictor's step beside it in the same launch). Their schemas are
// declared in binding.cpp's TORCH_LIBRARY block with the other ops; the CUDA implementations
// register here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "binding_common.h"
#include "prr_kernels.h"

using at::Tensor;

namespace {
using namespace prr_bind;

// The predictor's tensors of quest_select_predict (all set, or none).
struct PredictorTensors {
  Tensor* level; Tensor* trend; Tensor* n_init; const Tensor* theta; const Tensor* rows;
  const Tensor* nblk_next; Tensor* p_out_idx; Tensor* p_out_cnt; const Tensor* p_out_rows;
  int64_t n_pred;
};

// The contiguous copies of a selection's inputs, kept until its launch.
struct SelectionInputs {
  Tensor p_idx, p_cnt, p_rows, dense_row;
};

// P (optional, read at pool rows `p_rows` where given), the dense rows and the counters of a
// selection launch into `a` (both selection bindings: the same checks, the same messages).
void selection_inputs(prr::SelectArgs& a, int64_t B, const c10::optional<Tensor>& p_idx,
                      const c10::optional<Tensor>& p_cnt, const c10::optional<Tensor>& p_rows,
                      const c10::optional<Tensor>& dense_row, const c10::optional<Tensor>& stats,
                      SelectionInputs& keep, const char* op) {
  if (p_idx.has_value()) {
    TORCH_CHECK(p_cnt.has_value(), op, ": p_idx given without p_cnt");
    keep.p_idx = p_idx->contiguous();
    keep.p_cnt = p_cnt->contiguous();
    TORCH_CHECK(keep.p_idx.scalar_type() == at::kInt && keep.p_cnt.scalar_type() == at::kInt,
                op, ": p_idx/p_cnt must be int32");
    a.p_idx = keep.p_idx.data_ptr<int32_t>(); a.p_cnt = keep.p_cnt.data_ptr<int32_t>();
    a.Np = (int)keep.p_idx.size(-1);
  }
  a.p_rows = slots_ptr(p_rows, B, a.p_rows64, keep.p_rows, op);
  a.p_rows_n = keep.p_idx.defined() ? keep.p_idx.size(0) : 0;  // no P: no slot is read
  if (dense_row.has_value()) {
    keep.dense_row = dense_row->contiguous();
    TORCH_CHECK(keep.dense_row.scalar_type() == at::kBool && keep.dense_row.numel() == B,
                op, ": dense_row must be bool [", B, "]");
    a.dense_row = keep.dense_row.data_ptr<bool>();
  }
  if (stats.has_value()) {
    TORCH_CHECK(stats->scalar_type() == at::kLong && stats->is_contiguous() &&
                stats->numel() == prr::kNumStatSlots, op, ": stats must be contiguous int64 [",
                prr::kNumStatSlots, "]");
    a.stats = reinterpret_cast<unsigned long long*>(stats->data_ptr<int64_t>());
  }
}

// Quest scores + top-K + M = A \ P in one launch, with the predictor's step when `pr` is set:
// (scores, a_idx, a_cnt, m_idx, m_cnt).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> select_common(
    const Tensor& q_in, const Tensor& kmin, const Tensor& kmax, const Tensor& table,
    const Tensor& nblk_in, const c10::optional<Tensor>& p_idx_in,
    const c10::optional<Tensor>& p_cnt_in, int64_t k, int64_t sink, int64_t local,
    int64_t n_out, const c10::optional<Tensor>& p_rows, const c10::optional<Tensor>& dense_row,
    const c10::optional<Tensor>& stats, const c10::optional<Tensor>& new_k_in,
    const c10::optional<Tensor>& new_pos_in, int64_t page_size,
    const c10::optional<Tensor>& new_loc_in, const PredictorTensors* pr, const char* op) {
  check_cuda(q_in, "q");
  c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = q_view(q_in);
  const int s_dtype = summary_code(kmin, kmax, op);
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1, op, ": table must be [B, NB]");
  const Tensor nblk = nblk_in.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = kmin.size(1),
                NB = table.size(1);
  TORCH_CHECK(NB <= prr::max_topk_blocks(), op, ": ", NB, " blocks per row, at most ",
              prr::max_topk_blocks(), " supported");
  auto scores = at::empty({B, Hk, NB}, q.options().dtype(at::kFloat));
  auto a_idx = at::empty({B, Hk, n_out}, q.options().dtype(at::kInt));
  auto a_cnt = at::empty({B, Hk}, q.options().dtype(at::kInt));
  auto m_idx = at::empty({B, Hk, n_out}, q.options().dtype(at::kInt));
  auto m_cnt = at::empty({B, Hk}, q.options().dtype(at::kInt));
  prr::SelectArgs a{};
  a.q = q.data_ptr(); a.q_dtype = dtype_code(q); a.q_stride = q.stride(0);
  a.kmin = kmin.data_ptr(); a.kmax = kmax.data_ptr(); a.s_dtype = s_dtype;
  a.num_pages = kmin.size(0);
  a.table = table.data_ptr(); a.table64 = index64(table, "table"); a.table_stride = table.stride(0);
  a.nblk = nblk.data_ptr(); a.nblk64 = index64(nblk, "nblk");
  a.scores = scores.data_ptr<float>();
  SelectionInputs in;
  selection_inputs(a, B, p_idx_in, p_cnt_in, p_rows, dense_row, stats, in, op);
  Tensor rows, nbn, orows;
  a.a_idx = a_idx.data_ptr<int32_t>(); a.a_cnt = a_cnt.data_ptr<int32_t>();
  a.m_idx = m_idx.data_ptr<int32_t>(); a.m_cnt = m_cnt.data_ptr<int32_t>();
  a.n_out = (int)n_out;
  a.sem = group_counters(q, kCntSelect, B * Hk, op);
  a.B = (int)B; a.Hq = (int)Hq; a.Hk = (int)Hk; a.NB = (int)NB; a.D = (int)D;
  a.k = (int)k; a.sink = (int)sink; a.local = (int)local;
  Tensor new_k, new_pos, new_loc;
  TORCH_CHECK(!new_loc_in.has_value() || new_k_in.has_value(), op, ": new_loc needs new_k");
  if (new_k_in.has_value()) {
    TORCH_CHECK(new_pos_in.has_value() && page_size > 0, op,
                ": new_k needs new_pos and a page_size > 0, got page_size ", page_size);
    // Read in place like q (rows strided by the fused projection's other columns).
    new_k = q_view(*new_k_in);
    TORCH_CHECK(new_k.size(0) == B && new_k.size(1) == Hk && new_k.size(2) == D, op,
                ": new_k must be [", B, ", ", Hk, ", ", D, "], got ", new_k.sizes());
    new_pos = new_pos_in->contiguous();
    TORCH_CHECK(new_pos.dim() == 1 && new_pos.size(0) == B, op, ": new_pos must be [", B,
                "], got ", new_pos.sizes());
    a.new_k = new_k.data_ptr(); a.new_k_dtype = dtype_code(new_k);
    a.new_k_stride = new_k.stride(0);
    a.new_pos = new_pos.data_ptr(); a.new_pos64 = index64(new_pos, "new_pos");
    a.page_size = (int)page_size;
    if (new_loc_in.has_value()) {  // the decode update in this launch: bounds written in place
      new_loc = new_loc_in->contiguous();
      TORCH_CHECK(new_loc.dim() == 1 && new_loc.size(0) == B, op, ": new_loc must be [", B,
                  "], got ", new_loc.sizes());
      TORCH_CHECK(kmin.is_contiguous() && kmax.is_contiguous(), op,
                  ": kmin/kmax must be contiguous to be written");
      a.new_loc = new_loc.data_ptr(); a.new_loc64 = index64(new_loc, "new_loc");
      a.w_kmin = kmin.data_ptr(); a.w_kmax = kmax.data_ptr();
    }
  }
  if (pr) {
    Tensor& level = *pr->level;
    Tensor& trend = *pr->trend;
    Tensor& n_init = *pr->n_init;
    TORCH_CHECK(level.is_contiguous() && trend.is_contiguous() && n_init.is_contiguous() &&
                level.scalar_type() == at::kFloat && trend.scalar_type() == at::kFloat &&
                level.dim() == 3 && level.size(1) == Hk && level.size(2) == NB &&
                trend.sizes() == level.sizes(), op,
                ": level/trend must be contiguous float32 [R, ", Hk, ", ", NB, "], got ",
                level.sizes());
    TORCH_CHECK(pr->theta->scalar_type() == at::kFloat && pr->theta->dim() == 2 &&
                pr->theta->size(1) == 3 && pr->theta->stride(1) == 1,
                op, ": theta must be float32 [R, 3]");
    Tensor& po = *pr->p_out_idx;
    Tensor& pco = *pr->p_out_cnt;
    TORCH_CHECK(po.is_contiguous() && pco.is_contiguous() && po.scalar_type() == at::kInt &&
                pco.scalar_type() == at::kInt && po.size(-1) >= pr->n_pred + sink + local,
                op, ": p_idx/p_cnt must be contiguous int32 with at least ",
                pr->n_pred + sink + local, " entries");
    a.rows = slots_ptr(*pr->rows, B, a.rows64, rows, op);
    a.rows_n = level.size(0);
    a.level = level.data_ptr<float>(); a.trend = trend.data_ptr<float>();
    a.n_init = n_init.data_ptr(); a.ninit64 = index64(n_init, "n_init");
    a.theta = pr->theta->data_ptr<float>(); a.theta_stride = pr->theta->stride(0);
    nbn = pr->nblk_next->contiguous();
    a.nblk_next = nbn.data_ptr(); a.nblk_next64 = index64(nbn, "nblk_next");
    a.p_out_rows = slots_ptr(*pr->p_out_rows, B, a.p_out_rows64, orows, op);
    a.p_out_rows_n = po.size(0);
    a.p_out_idx = po.data_ptr<int32_t>(); a.p_out_cnt = pco.data_ptr<int32_t>();
    a.Np_out = (int)po.size(-1);
    a.n_pred = (int)pr->n_pred;
    a.req_sem = group_counters(q, kCntSelectReq, B, op);
  }
  // The one-pass kernel's candidate workspace (static shapes: the caching allocator, or the
  // graph's pool under capture).
  int nch = 0, kca = 0, kcp = 0;
  size_t smem = 0;
  Tensor ws, ws_cnt;
  if (!prr::select_takes_split(B, (int)NB, pr != nullptr) &&
      prr::select_one_pass((int)D, (int)(Hq / Hk), (int)NB, (int)k, pr ? (int)pr->n_pred : 0,
                           a.Np, (int)n_out, &nch, &kca, &kcp, &smem)) {
    ws = at::empty({B * Hk * nch * std::max(kca + kcp, 1)}, q.options().dtype(at::kLong));
    ws_cnt = at::empty({B * Hk * nch * 2}, q.options().dtype(at::kInt));
    a.ws = reinterpret_cast<unsigned long long*>(ws.data_ptr<int64_t>());
    a.ws_cnt = ws_cnt.data_ptr<int32_t>();
    a.nch = nch; a.kca = kca; a.kcp = kcp;
  }
  check_launch(prr::launch_quest_select(a, stream()), op);
  return std::make_tuple(scores, a_idx, a_cnt, m_idx, m_cnt);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> quest_select(
    const Tensor& q, const Tensor& kmin, const Tensor& kmax, const Tensor& table,
    const Tensor& nblk, const c10::optional<Tensor>& p_idx, const c10::optional<Tensor>& p_cnt,
    int64_t k, int64_t sink, int64_t local, int64_t n_out, const c10::optional<Tensor>& p_rows,
    const c10::optional<Tensor>& dense_row, const c10::optional<Tensor>& stats,
    const c10::optional<Tensor>& new_k, const c10::optional<Tensor>& new_pos, int64_t page_size,
    const c10::optional<Tensor>& new_loc) {
  return select_common(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink, local, n_out, p_rows,
                       dense_row, stats, new_k, new_pos, page_size, new_loc, nullptr,
                       "quest_select");
}

// quest_select and the predictor's step in the same launch: P(t) at rows p_rows gives M, the
// Holt update runs on state rows `rows`, and P(t+1) goes to rows p_next_rows of p_idx/p_cnt.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> quest_select_predict(
    const Tensor& q, const Tensor& kmin, const Tensor& kmax, const Tensor& table,
    const Tensor& nblk, const Tensor& nblk_next, Tensor& p_idx, Tensor& p_cnt,
    const Tensor& p_rows, const Tensor& p_next_rows, Tensor& level, Tensor& trend,
    Tensor& n_init, const Tensor& theta, const Tensor& rows, int64_t k, int64_t n_pred,
    int64_t sink, int64_t local, int64_t n_out, const c10::optional<Tensor>& dense_row,
    const c10::optional<Tensor>& stats, const c10::optional<Tensor>& new_k,
    const c10::optional<Tensor>& new_pos, int64_t page_size,
    const c10::optional<Tensor>& new_loc) {
  TORCH_CHECK(p_idx.is_contiguous() && p_cnt.is_contiguous(),
              "quest_select_predict: p_idx/p_cnt must be contiguous (written in place)");
  PredictorTensors pr{&level, &trend, &n_init, &theta, &rows, &nblk_next, &p_idx, &p_cnt,
                      &p_next_rows, n_pred};
  return select_common(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink, local, n_out,
                       p_rows, dense_row, stats, new_k, new_pos, page_size, new_loc, &pr,
                       "quest_select_predict");
}

// A = kept + top-K of any method's scores, M = A \ P and the counters in one launch (the rows
// kernel of Quest's two-launch selection): (a_idx, a_cnt, m_idx, m_cnt).
// The rows' inputs of select_lists / select_lists_predict into `a` and the four lists, allocated
// (the launch's caller keeps `nblk`).
std::tuple<Tensor, Tensor, Tensor, Tensor> lists_args(
    prr::SelectArgs& a, const Tensor& scores, const Tensor& nblk,
    const c10::optional<Tensor>& p_idx, const c10::optional<Tensor>& p_cnt, int64_t k,
    int64_t sink, int64_t local, int64_t n_out, const c10::optional<Tensor>& p_rows,
    const c10::optional<Tensor>& dense_row, const c10::optional<Tensor>& stats,
    SelectionInputs& in, const char* op) {
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous() && scores.scalar_type() == at::kFloat,
              op, ": scores must be contiguous float32 [B, Hk, NB], got ", scores.sizes());
  const int64_t B = scores.size(0), Hk = scores.size(1), NB = scores.size(2);
  TORCH_CHECK(NB <= prr::max_topk_blocks(), op, ": ", NB, " blocks per row, at most ",
              prr::max_topk_blocks(), " supported");
  auto a_idx = at::empty({B, Hk, n_out}, scores.options().dtype(at::kInt));
  auto a_cnt = at::empty({B, Hk}, scores.options().dtype(at::kInt));
  auto m_idx = at::empty({B, Hk, n_out}, scores.options().dtype(at::kInt));
  auto m_cnt = at::empty({B, Hk}, scores.options().dtype(at::kInt));
  a.nblk = nblk.data_ptr(); a.nblk64 = index64(nblk, "nblk");
  a.scores = scores.data_ptr<float>();  // read only (the rows' tails)
  selection_inputs(a, B, p_idx, p_cnt, p_rows, dense_row, stats, in, op);
  a.a_idx = a_idx.data_ptr<int32_t>(); a.a_cnt = a_cnt.data_ptr<int32_t>();
  a.m_idx = m_idx.data_ptr<int32_t>(); a.m_cnt = m_cnt.data_ptr<int32_t>();
  a.n_out = (int)n_out;
  a.B = (int)B; a.Hk = (int)Hk; a.NB = (int)NB;
  a.k = (int)k; a.sink = (int)sink; a.local = (int)local;
  return std::make_tuple(a_idx, a_cnt, m_idx, m_cnt);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> select_lists(
    const Tensor& scores, const Tensor& nblk_in, const c10::optional<Tensor>& p_idx,
    const c10::optional<Tensor>& p_cnt, int64_t k, int64_t sink, int64_t local,
    int64_t n_out, const c10::optional<Tensor>& p_rows, const c10::optional<Tensor>& dense_row,
    const c10::optional<Tensor>& stats) {
  const char* op = "select_lists";
  check_cuda(scores, "scores");
  c10::cuda::CUDAGuard guard(scores.device());
  const Tensor nblk = nblk_in.contiguous();
  prr::SelectArgs a{};
  SelectionInputs in;
  auto lists = lists_args(a, scores, nblk, p_idx, p_cnt, k, sink, local, n_out, p_rows,
                          dense_row, stats, in, op);
  check_launch(prr::launch_select_lists(a, stream()), op);
  return lists;
}

// select_lists and the predictor's step over the same scores in one launch: P(t) at rows p_rows
// gives M, the Holt update runs on state rows `rows`, P(t+1) goes to rows p_next_rows of
// p_idx/p_cnt (the other half of P's double buffer).
std::tuple<Tensor, Tensor, Tensor, Tensor> select_lists_predict(
    const Tensor& scores, const Tensor& nblk_in, const Tensor& nblk_next, Tensor& p_idx,
    Tensor& p_cnt, const Tensor& p_rows, const Tensor& p_next_rows, Tensor& level,
    Tensor& trend, Tensor& n_init, const Tensor& theta, const Tensor& rows, int64_t k,
    int64_t n_pred, int64_t sink, int64_t local, int64_t n_out,
    const c10::optional<Tensor>& dense_row, const c10::optional<Tensor>& stats) {
  const char* op = "select_lists_predict";
  check_cuda(scores, "scores");
  c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(p_idx.is_contiguous() && p_cnt.is_contiguous(), op,
              ": p_idx/p_cnt must be contiguous (written in place)");
  const Tensor nblk = nblk_in.contiguous();
  prr::SelectArgs a{};
  SelectionInputs in;
  auto lists = lists_args(a, scores, nblk, p_idx, p_cnt, k, sink, local, n_out, p_rows,
                          dense_row, stats, in, op);
  PredictInputs keep;
  const prr::PredictArgs pa = predict_args(level, trend, n_init, scores, nblk, theta, nblk_next,
                                           n_pred, sink, local, p_idx, p_cnt, rows,
                                           p_next_rows, keep, op);
  check_launch(prr::launch_select_lists_predict(a, pa, stream()), op);
  return lists;
}

}  // namespace

TORCH_LIBRARY_IMPL(sglang_prr_cuda, CUDA, m) {
  m.impl("select_lists", &select_lists);
  m.impl("select_lists_predict", &select_lists_predict);
  m.impl("quest_select", &quest_select);
  m.impl("quest_select_predict", &quest_select_predict);
}
