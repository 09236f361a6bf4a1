// The Holt predictor's step of one (request, KV head) row (eqs 2-3): the update of level and
// trend with the step's scores, the prediction of the next step's scores and their top-K, P(t+1),
// by one CTA of kTopkThreads threads. The predictor's own launch (predictor.cu) runs one CTA a
// row; InfLLM-v2's top-K launch runs these CTAs beside its own rows (selection.cu), so that a
// composed selection's predictor is no launch of its own.
#pragma once
#include "prr_kernels.h"
#include "common.cuh"
#include "topk.cuh"

#include <cmath>

namespace prr {
namespace {

// Called by every thread of the row's CTA (contains __syncthreads), after pdl_begin(); the CTAs
// of one request must share one launch's grid x (Hk CTAs: the last of them raises n_init[b]).
// s_key: [NB] words of dynamic shared memory.
__device__ __forceinline__ void predict_row(const PredictArgs& a, int hk, int b,
                                            uint32_t* s_key) {
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

}  // namespace
}  // namespace prr
