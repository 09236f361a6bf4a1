// Launchers of the PRR SM90 kernels (plain C types: this header is shared by the CUDA translation
// unit and the torch binding, which is compiled by the host compiler).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernel_limits.h"

namespace prr {

// Element types of the tensors the kernels read (q, KV buffers).
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// The decode counters the selection kernels accumulate (int64), in the order of
// sglang_prr/contracts.py's STATS_SLOTS: sum |A|, sum |M|, sum |P| over the sparse (request,
// KV head) rows, and the number of such rows.
enum StatSlot : int {
  kStatSelected = 0, kStatRepair = 1, kStatPredicted = 2, kStatRows = 3, kNumStatSlots = 4
};

struct AttnArgs {
  const void* q; int q_dtype; int64_t q_stride;  // [B, Hq, D], rows q_stride apart, heads packed
  const void* k; const void* v; int kv_dtype;   // [num_slots, Hk, D], last dim contiguous
  int64_t k_stride_slot, k_stride_head, v_stride_slot, v_stride_head;
  const void* table; bool table64; int64_t table_stride;  // [B, NB]
  int NB;                                                    // ids >= NB are padding
  int64_t num_pages;  // KV pages: a page outside [0, num_pages) reads page 0 (in_pool)
  const void* seq_lens; bool seq64;                          // [B]
  const int32_t* idx; const int32_t* cnt;                    // [B, Hk, N], [B, Hk]
  // Optional request slots [B]: idx/cnt are then rows idx_rows[b] of [R, Hk, N] / [R, Hk]
  // (the speculative pass reads P straight from the request pool's predictor state).
  const void* idx_rows; bool idx_rows64; int64_t idx_rows_n;  // n: R (in_pool's bound)
  float* o; float* lse;                                      // [B, Hq, N, D], [B, Hq, N]
  int B, Hq, Hk, N, D, page_size;
  float sm_scale;
  // Fused merge (sem != nullptr): o/lse above are a workspace; the last CTA of each (b, hk)
  // merges the N partials of its G query heads, plus the optional first source (spec partials
  // [B, Hq, N1, D] / [B, Hq, N1], filtered to P n A when p_idx is set), into out_o/out_lse.
  int* sem;                                                  // [B * Hk] zeroed counters
  const float* o1; const float* lse1; int N1;
  const int32_t* p_idx; const int32_t* p_cnt;                // [B, Hk, N1], [B, Hk]
  const void* p_rows; bool p_rows64; int64_t p_rows_n;       // optional slots of p_idx/p_cnt
  const int32_t* a_idx; const int32_t* a_cnt; int Na;        // [B, Hk, Na] ascending, [B, Hk]
  bool p_exact;  // with p_idx: keep only P n A (else P u A); a repeated id of P counts once
  void* out_o; int out_dtype; float* out_lse;                // [B, Hq, D] (f32/f16/bf16), [B, Hq] or null
  int merge_rows;  // set by the launch: the merge tail's row-stage entries a round
  int spread;      // set by the launch: the fused merge spread over the group's CTAs (one wave;
                  // 2: over every CTA of the row, SGLANG_PRR_ATTN_SPREAD=row)
  int spread_wait; // set by the launch: clocks a spread merge's CTA waits before withdrawing
  int pack;        // set by the launch: list entries a CTA computes (1; 64 / page for pages of
                   // 16 tokens on grids of several waves, or of 16 or 32 where
                   // SGLANG_PRR_ATTN_PACK=1 asks: attn_pack)
  int debug_stop;  // timing probes only (SGLANG_PRR_ATTN_DEBUG_STOP): 0 runs everything
  // Timing probe (SGLANG_PRR_ATTN_TIMELINE=1, eager launches only; set by the launch): each CTA
  // below timeline_ctas records kTimelineSlots values (probe.cuh, attn_block.cuh), else null.
  unsigned long long* timeline; int64_t timeline_ctas;
};
cudaError_t launch_sparse_attn_partials(const AttnArgs& a, cudaStream_t s);
// How many attention launches of this process spread their fused merge over the groups' CTAs
// (counted on the host, at launch or capture: the tests' evidence that the form ran).
int64_t attn_spread_launches();

// The timing probe (development only; probe.cu, probe.cuh): a CTA's record, in slots.
constexpr int kTimelineSlots = 16;
// A launch of `ctas` CTAs on stream s asks for records: where the build holds the probes, the
// environment variable `env` is "1" and s is not capturing, the shared buffer's first `ctas`
// records (zeroed on s) go to *timeline / *timeline_ctas, else null / 0.
cudaError_t probe_setup(const char* env, int64_t ctas, cudaStream_t s,
                        unsigned long long** timeline, int64_t* timeline_ctas);
// The records of the last probed launch, copied to `host` (at most max_ctas CTAs of
// kTimelineSlots values; waits for the device): how many CTAs there were (-1: the copy failed).
int64_t probe_timeline_read(unsigned long long* host, int64_t max_ctas);
int64_t probe_timeline_ctas();

struct QuestArgs {
  const void* q; int q_dtype; int64_t q_stride;  // [B, Hq, D], rows q_stride apart, heads packed
  const void* kmin; const void* kmax;          // [num_pages, Hk, D] contiguous
  int64_t num_pages;  // a page outside [0, num_pages) is page 0 (in_pool)
  int s_dtype;                                 // kF32 or kBF16 (the summaries' dtype)
  const void* table; bool table64; int64_t table_stride;  // [B, NB]
  const void* nblk; bool nblk64;                          // [B]
  float* out;                                             // [B, Hk, NB]
  int B, Hq, Hk, NB, D;
  // Optional: the step's new keys folded into their blocks' scores (as SelectArgs::new_k), and
  // written (as SelectArgs::new_loc).
  const void* new_k; int new_k_dtype; int64_t new_k_stride;
  const void* new_pos; bool new_pos64; int page_size;
  const void* new_loc; bool new_loc64; void* w_kmin; void* w_kmax;
};
cudaError_t launch_quest_scores(const QuestArgs& a, cudaStream_t s);
// How many Quest scores launches of this process took the streamed kernel (counted on the host,
// at launch or capture: the tests' evidence that it ran).
int64_t scores_stream_launches();

struct TopkArgs {
  const float* scores;              // [B, Hk, NB] (level when trend != nullptr)
  const float* trend;               // predict mode: IS_hat = level + gamma * trend
  const float* gamma; int64_t gamma_stride;
  const void* n_init; bool ninit64;
  const void* nblk; bool nblk64;    // [B]
  const bool* dense_row;            // [B] optional: every middle block is selected
  int32_t* idx; int32_t* cnt;       // [B, Hk, n_out], [B, Hk]
  int B, Hk, NB, k, sink, local, n_out;
};
cudaError_t launch_select_topk(const TopkArgs& a, cudaStream_t s);
int max_topk_blocks();  // largest NB a row of select_topk may have (shared-memory bound)

// Fused Quest selection: scores + top-K (A) + M = A \ P, and with `level` set the predictor's
// step in the same launch (Holt update of the row's state, P(t+1) into p_out rows).
struct SelectArgs {
  const void* q; int q_dtype; int64_t q_stride;  // [B, Hq, D], rows q_stride apart
  const void* kmin; const void* kmax;          // [num_pages, Hk, D] contiguous
  int64_t num_pages;  // a page outside [0, num_pages) is page 0 (in_pool)
  int s_dtype;                                 // kF32 or kBF16 (the summaries' dtype)
  const void* table; bool table64; int64_t table_stride;  // [B, NB]
  const void* nblk; bool nblk64;                          // [B]
  float* scores;                                          // [B, Hk, NB]
  const int32_t* p_idx; const int32_t* p_cnt; int Np;     // P (nullptr: M = A)
  const void* p_rows; bool p_rows64; int64_t p_rows_n;    // optional slots of p_idx/p_cnt
  const bool* dense_row;                                  // [B] optional: A = every block
  // Optional counters [4] (sum |A|, sum |M|, sum |P|, rows) over the (b, hk) rows that are not
  // dense: PRR's statistics, accumulated by the kernel that already knows them.
  unsigned long long* stats;
  int32_t* a_idx; int32_t* a_cnt; int32_t* m_idx; int32_t* m_cnt; int n_out;
  int* sem;                                               // [B * Hk] zeroed counters
  int B, Hq, Hk, NB, D, k, sink, local;
  // The predictor (level != nullptr): state rows [B] of level/trend [R, Hk, NB], n_init [R],
  // theta [R, 3]; P(t+1) (n_pred predicted + kept blocks at nblk_next) goes to rows p_out_rows
  // of p_out_idx [., Hk, Np_out] / p_out_cnt [., Hk] (may be P's own tensors: P(t) is read
  // first, by the same CTA).
  const void* rows; bool rows64; int64_t rows_n;
  float* level; float* trend; void* n_init; bool ninit64;
  const float* theta; int64_t theta_stride;
  const void* nblk_next; bool nblk_next64;
  const void* p_out_rows; bool p_out_rows64; int64_t p_out_rows_n;
  int32_t* p_out_idx; int32_t* p_out_cnt; int Np_out;
  int n_pred;
  int* req_sem;                                           // [B] zeroed counters (n_init)
  // Candidate workspace of the one-pass kernel: [B * Hk, nch, kca + kcp] keys, counts.
  unsigned long long* ws; int* ws_cnt; int nch, kca, kcp;
  int debug_stop;  // timing probes only (SGLANG_PRR_SELECT_DEBUG_STOP): 0 runs everything
  // Timing probe of the one-pass kernel (SGLANG_PRR_SELECT_TIMELINE=1, eager launches only; set
  // by the launch): each CTA below timeline_ctas records kTimelineSlots values, else null.
  unsigned long long* timeline; int64_t timeline_ctas;
  // The step's new keys (new_k != nullptr): row b's key at position new_pos[b] enters the score
  // of its block (new_pos[b] / page_size) as the decode update folds it into the summary (the
  // first position of a page: the key alone). Folded in registers: a concurrent update of the
  // same page leaves the scores unchanged (folding the key twice is folding it once).
  const void* new_k; int new_k_dtype; int64_t new_k_stride;  // [B, Hk, D], rows new_k_stride apart
  const void* new_pos; bool new_pos64; int page_size;        // [B]
  // The decode update in the same launch (new_loc != nullptr): the lanes that folded row b's key
  // also store the folded bounds to page new_loc[b] / page_size of w_kmin / w_kmax (the summaries
  // read, [num_pages, Hk, D]): the key's own page in the server, whose only reader in the launch
  // is the CTA that writes it (a request's newest page is its own; padding rows write page 0).
  const void* new_loc; bool new_loc64; void* w_kmin; void* w_kmax;  // [B]
};
// Whether the one-pass kernel takes these sizes (else scores + top-K kernels, then the
// predictor's own kernel); its chunk count and candidate widths, and its dynamic shared memory.
bool select_one_pass(int D, int G, int NB, int k, int n_pred, int Np, int n_out, int* nch,
                     int* kca, int* kcp, size_t* smem);
cudaError_t launch_quest_select(const SelectArgs& a, cudaStream_t s);
// The row-tail kernel alone (scores by chunks, top-K by the last CTA of a row; no predictor).
cudaError_t launch_quest_select_rowtail(const SelectArgs& a, cudaStream_t s);
// The same results in two launches (no predictor): the scores (quest_scores' kernel, new keys
// folded), then a CTA per row for its top-K, M and counters.
cudaError_t launch_quest_select_split(const SelectArgs& a, cudaStream_t s);
// The second of those launches alone, over any method's scores (a.scores, [B, Hk, NB] float32,
// complete): A, M = A \ P and the counters, a CTA per (request, KV head) row (select_lists).
cudaError_t launch_select_lists(const SelectArgs& a, cudaStream_t s);
// Whether launch_quest_select takes the two launches for a batch of B rows over NB table blocks,
// with or without the predictor's step (the shape's rule, or SGLANG_PRR_SELECT_KERNEL where set).
bool select_takes_split(int64_t B, int NB, bool predictor);
int max_select_group_dim();  // largest G * D of quest_select (shared-memory bound)

// Fused predictor: Holt update (eq 3) + P(t+1) (eq 2 + top-K), one launch.
struct PredictArgs {
  // State rows: b, or rows[b] when rows is set (level/trend [R, Hk, NB], n_init [R], theta
  // [R, 3], idx/cnt [R, Hk, n_out] / [R, Hk]: the request pool's state, updated in place).
  const void* rows; bool rows64; int64_t rows_n;  // rows_n: R (in_pool's bound)
  float* level; float* trend; void* n_init; bool ninit64;  // [B, Hk, NB], [B]
  const float* scores;                                     // [B, Hk, NB]
  const void* nblk; bool nblk64; const void* nblk_next; bool nblk_next64;  // [B]
  const float* theta; int64_t theta_stride;                // [B, 3] (alpha, beta, gamma)
  int32_t* idx; int32_t* cnt; int n_out;                   // [B, Hk, n_out], [B, Hk]
  const void* p_rows; bool p_rows64; int64_t p_rows_n;     // optional rows of idx/cnt (else rows)
  int* sem;                                                // [B] zeroed counters
  int B, Hk, NB, k, sink, local;
};
cudaError_t launch_predict_update(const PredictArgs& a, cudaStream_t s);
// launch_select_lists and launch_predict_update over the same rows (p.scores = a.scores, the same
// B, Hk and NB) in one launch: the predictor's CTAs beside the top-K's (select_lists_predict).
cudaError_t launch_select_lists_predict(const SelectArgs& a, const PredictArgs& p,
                                        cudaStream_t s);

// M = A \ P per (request, KV head) row. P's row of row r = (b, h) is p_rows[b] * Hk + h with
// p_rows given (pool-wide P), r without. With stats, the row's |A|, |M|, |P| (clamped at 0) and
// 1 are added into the counters (StatSlot) unless dense_row[b].
struct SetDiffArgs {
  const int32_t* a_idx; const int32_t* a_cnt; int Na;
  const int32_t* p_idx; const int32_t* p_cnt; int Np;
  int32_t* m_idx; int32_t* m_cnt; int n_out;
  int rows, nb, Hk;
  const void* p_rows; bool p_rows64; int64_t p_rows_n;  // [B] or null; n: P's rows
  unsigned long long* stats;                       // [kNumStatSlots] or null
  const bool* dense_row;                           // [B] or null
};
cudaError_t launch_set_difference(const SetDiffArgs& a, cudaStream_t s);

// The decode counters (StatSlot) of a selection composed from separate ops: sums over the
// (request, KV head) rows that are not dense rows, added into stats in one launch.
struct StatsArgs {
  unsigned long long* stats;                       // [kNumStatSlots]
  const int32_t* a_cnt; const int32_t* m_cnt;      // [B, Hk] contiguous
  const int32_t* p_cnt;                            // [B, Hk] or null (no prediction: 0)
  const bool* dense_row;                           // [B] or null
  int B, Hk;
};
cudaError_t launch_accumulate_stats(const StatsArgs& a, cudaStream_t s);

struct HoltArgs {
  float* level; float* trend; void* n_init; bool ninit64;
  const float* scores; const void* nblk; bool nblk64;
  const float* alpha; int64_t alpha_stride; const float* beta; int64_t beta_stride;
  int B, Hk, NB;
};
cudaError_t launch_holt_update(const HoltArgs& a, cudaStream_t s);

struct MergeArgs {
  const float* o1; const float* lse1; int N1;     // [R, N1, D], [R, N1]
  const float* o2; const float* lse2; int N2;     // optional second source (repair), N2 may be 0
  // PRR filter on source 1 (p_idx nullptr: keep all): an entry repeating the id of the entry
  // before it (ascending lists) is dropped; exact also keeps entry i of row (b, hq) only if
  // i < p_cnt[b, hk], p_idx >= 0 and p_idx is in A.
  const int32_t* p_idx; const int32_t* p_cnt; const int32_t* a_idx; const int32_t* a_cnt;
  int Na, nb, Hq, Hk;
  bool exact;
  float* o; float* lse;                            // [R, D], [R]
  int R, D;
};
cudaError_t launch_merge(const MergeArgs& a, cudaStream_t s);

struct QuestUpdateArgs {
  void* kmin; void* kmax;              // [num_pages, Hk, D]
  int64_t num_pages;                   // a slot outside the pool writes page 0 (slot_page)
  int s_dtype;                         // kF32 or kBF16: bf16 rounds kmin down and kmax up
  const void* k; int k_dtype;          // [N, Hk, D] contiguous
  const void* out_loc; bool loc64; const void* positions; bool pos64;
  int N, Hk, D, page_size;
  bool one_per_page;  // no two tokens share a page (decode): reset and fold in one launch
};
cudaError_t launch_quest_update(const QuestUpdateArgs& a, cudaStream_t s);

// Prefill calibration (calib_kernels.cu): eq 4's row term for every candidate of the grid
// alphas x betas x gammas (alpha-major), one CTA per (candidate, KV head, row).
struct CalibArgs {
  const float* scores;         // [R, Phi, Hk, NB]
  const long long* nblk;       // [R, Phi]
  const float* wa;             // [Phi-1, R, Hk, NB] weights of A's middle blocks
  const bool* am;              // [Phi-1, R, Hk, NB] A's middle blocks
  const float* alphas; const float* betas; const float* gammas;  // [A], [B], [G]
  float* out;                  // [Phi-1, R, A*B*G, Hk]
  int R, Phi, Hk, NB, A, B, G, n_pred, sink, local;
};
cudaError_t launch_calib_grid_terms(const CalibArgs& a, cudaStream_t s);
// The largest NB the calibration kernel takes (its per-row state lives in shared memory).
int max_calib_blocks();

// Whether this process launches the kernels with programmatic dependent launch
// (SGLANG_PRR_PDL=1; see pdl_begin in common.cuh).
bool launches_with_pdl();

}  // namespace prr
