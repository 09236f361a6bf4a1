// PRR's Quest selection on SM90 in one pass over the summaries: scores, top-K (A), M = A \ P(t)
// and, with the predictor's state given, its step (Holt update, P(t+1)) in the same launch
// (quest_select_onepass_kernel), and the launcher that picks it or the row-tail kernel of
// selection.cu (then the predictor's own kernel). Every kernel is graph-safe: static launch
// shapes, device-side counts, no host reads.
#include "prr_kernels.h"
#include "common.cuh"
#include "probe.cuh"
#include "topk.cuh"

#include <cuda_bf16.h>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cmath>

namespace prr {
namespace {

// ============================================================================ one-pass selection
// Quest scores, top-K (A), M = A \ P(t), and with the predictor set the Holt update of the
// row's state and P(t+1), in one launch and one pass over the bf16 (or fp32) summaries.
// Grid (chunks of kOpChunk blocks, Hk, B), kOpThreads threads. A CTA scores its chunk with D/8
// lanes per block (16-byte loads; q of the GQA group in shared memory), updates the chunk's level
// and trend while the scores are in registers, and keeps its chunk's best min(K, chunk) blocks by
// score and best min(|P|, chunk) by prediction: composite keys (order key << 32 | ~id: larger is
// better, ties to the lower id, as the reference's stable sort), ranked among the chunk and
// written to a candidate workspace. The last CTA of the row takes the K best of the chunks'
// sorted candidate lists (a threshold from a sample of their heads, then the survivors ranked),
// then writes A, M and P(t+1) as ascending lists with the kept sink/local blocks. Every CTA of a
// request counts itself out on a second counter, and the last one raises n_init, after every CTA
// has read it.
constexpr int kOpThreads = 256;
constexpr int kOpChunk = 64;
constexpr size_t kOpMaxSmem = 160 * 1024;

// The one-pass kernel's links for the timing probe (probe.cuh's slots 0-2 and 9-11 are the entry,
// exit and id; a CTA that loops over chunks stamps its first chunk's links).
enum SelectLink {
  kSlLoaded = 3,  // q in shared memory
  kSlScored,      // the summaries' round trip, the chunk's scores and Holt step, its keys
  kSlRanked,      // the chunk's candidates ranked and written (every chunk of the CTA)
  kSlArrival,     // the row's ticket taken (every CTA; the last one goes on to the tail)
  kSlTailLoads,   // the tail's loads of the chunks' candidates
  kSlTopK,        // the row's top-K (and P(t+1)'s)
  kSlLists = 12,  // A, P(t+1) and M written
  kSlCounts,      // the block counts' round trip (the chunk known to hold blocks)
  kSlIssued       // the pages' round trip: the summaries' loads issued
};
static_assert(kSlTopK == 8 && kSlIssued < kTimelineSlots, "the selection's links fit the record");

__device__ __forceinline__ unsigned long long comp_key(uint32_t key, int id) {
  return key ? ((unsigned long long)key << 32) | (unsigned long long)(0xFFFFFFFFu - (uint32_t)id)
             : 0ull;
}
__device__ __forceinline__ int comp_id(unsigned long long ck) {
  return (int)(0xFFFFFFFFu - (uint32_t)(ck & 0xFFFFFFFFull));
}

// 8 summary values as raw registers (loaded early, converted at use: half the registers of
// floats for bf16).
template <typename S> struct Sum8;
template <> struct Sum8<float> {
  float4 x, y;
  __device__ __forceinline__ void load(const float* p) {
    x = __ldg(reinterpret_cast<const float4*>(p));
    y = __ldg(reinterpret_cast<const float4*>(p) + 1);
  }
  __device__ __forceinline__ void get(float* f) const {
    f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w; f[4] = y.x; f[5] = y.y; f[6] = y.z; f[7] = y.w;
  }
};
template <> struct Sum8<__nv_bfloat16> {
  uint4 u;
  __device__ __forceinline__ void load(const __nv_bfloat16* p) {
    u = __ldg(reinterpret_cast<const uint4*>(p));
  }
  __device__ __forceinline__ void get(float* f) const {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 v = __bfloat1622float2(h[i]); f[2 * i] = v.x; f[2 * i + 1] = v.y; }
  }
};

// How many of v[0, n) exceed x (shared memory; every thread of a warp reads the same entry:
// broadcast loads, eight in flight).
__device__ __forceinline__ int count_above(const unsigned long long* v, int n,
                                           unsigned long long x) {
  int r = 0, i = 0;
#pragma unroll 1
  for (; i + 8 <= n; i += 8) {
#pragma unroll
    for (int u = 0; u < 8; ++u) r += v[i + u] > x;
  }
#pragma unroll 1
  for (; i < n; ++i) r += v[i] > x;
  return r;
}

// Writes the ascending list [0, lo) ++ ids ++ [hi, n) (ids ascending, lo <= ids < hi) clamped
// to width w, -1 padded, and its count (also into `copy`, shared memory, when given); returns
// the count. Called by the whole CTA.
__device__ int write_kept_list(const int* ids, int nid, int lo, int hi, int n, int32_t* out,
                               int w, int32_t* cnt, int* copy = nullptr) {
  const int nlo = lo, nhi = n > hi ? n - hi : 0;
  const int total = nlo + nid + nhi;
  for (int e = threadIdx.x; e < w; e += blockDim.x) {
    int x = -1;
    if (e < total) x = e < nlo ? e : (e < nlo + nid ? ids[e - nlo] : hi + (e - nlo - nid));
    out[e] = x;
    if (copy) copy[e] = x;
  }
  const int c = total < w ? total : w;
  if (threadIdx.x == 0) *cnt = c;
  return c;
}

// A lane's 8 dims [8 ln, 8 ln + 8) of one query head's row in s_q (stored in halves: dims
// [8 ln, 8 ln + 4) at 4 ln, [8 ln + 4, 8 ln + 8) at D / 2 + 4 ln).
__device__ __forceinline__ void group_q8(const float* row, int D, int ln, float* qv) {
  const float4 qa = *reinterpret_cast<const float4*>(row + ln * 4);
  const float4 qb = *reinterpret_cast<const float4*>(row + D / 2 + ln * 4);
  qv[0] = qa.x; qv[1] = qa.y; qv[2] = qa.z; qv[3] = qa.w;
  qv[4] = qb.x; qv[5] = qb.y; qv[6] = qb.z; qv[7] = qb.w;
}

// Three CTAs per SM (<= 85 registers): more requests in flight for the latency-bound chain.
// Loop: the grid's x may be narrower than the row's chunks (select_grid_x), and a CTA loops over
// chunks blockIdx.x, + gridDim.x, ...; without it a CTA takes one chunk (the loop's state stays
// out of the default kernel's registers).
constexpr int kOpCtasPerSm = 3;
template <typename S, int D, bool Loop>
__global__ void __launch_bounds__(kOpThreads, kOpCtasPerSm)
quest_select_onepass_kernel(SelectArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  probe_entry(a, ((unsigned long long)blockIdx.z << 40) | ((unsigned long long)blockIdx.y << 20) |
                     blockIdx.x);
  constexpr int L = D / 8;               // lanes per block (8 dims each)
  constexpr int BPP = kOpThreads / L;    // blocks per pass
  constexpr int PASSES = kOpChunk / BPP;
  extern __shared__ __align__(16) unsigned char s_dyn[];
  __shared__ unsigned long long s_ck[2][kOpChunk];
  // q of the GQA group (few registers), each head's row in halves: a lane's dims [8 ln, 8 ln + 4)
  // at 4 ln, [8 ln + 4, 8 ln + 8) at D / 2 + 4 ln, so that the float4 reads of a quarter-warp's
  // eight lanes are 128 contiguous bytes (no bank conflict).
  __shared__ __align__(16) float s_q[kMaxGroup * D];
  // Lane ln's q sums, [qp 8 | qn 8] in a row of kQpnRow floats (padded: a quarter-warp's eight
  // rows fall in distinct banks).
  constexpr int kQpnRow = 20;
  __shared__ __align__(16) float s_qpn[D / 8 * kQpnRow];
  int ch = blockIdx.x;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, grp = tid / L, ln = tid % L;
  const int G = a.Hq / a.Hk, NB = a.NB;
  const bool pred = a.level != nullptr;
  const int64_t row = (int64_t)b * a.Hk + hk;
  // ---- every load that does not depend on another, in one round trip: the chunk's pages (read
  // for every block of the table's width: the count is not known yet; past the width, the row's
  // first entry, unused), the block counts, the new key's position and slot, q, the state and
  // theta. A chunk past the row's blocks then exits. Their raw forms are converted only after
  // (index_of, raw8_floats): converted beside its load, each load waited in turn (3 us of the
  // kernel's 16 at 128K / 1, bench_select_timeline, run 28).
  // Issue order matters: the pages first (the summaries wait on them), q kept in registers until
  // the summary loads are out, the state (which waits on the request's row) last.
  RawIndex page_raw[PASSES];
  const auto load_pages = [&](int c) {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int blk = c * kOpChunk + p * BPP + grp;
      page_raw[p] = ld_index_raw(a.table, (int64_t)b * a.table_stride + (blk < NB ? blk : 0),
                                 a.table64);
    }
  };
  load_pages(ch);
  // Optional tensors are read without a branch (a branch's join would convert the value there,
  // waiting for it): an absent one's load reads nblk instead, and its value is not used.
  const auto or_nblk = [&](const void* p) { return p ? p : a.nblk; };
  const RawIndex nb_raw = ld_index_raw(a.nblk, b, a.nblk64);
  const RawIndex nbn_raw =
      ld_index_raw(or_nblk(pred ? a.nblk_next : nullptr), b, pred ? a.nblk_next64 : a.nblk64);
  const RawIndex pos_raw =
      ld_index_raw(or_nblk(a.new_k ? a.new_pos : nullptr), b, a.new_k ? a.new_pos64 : a.nblk64);
  const RawIndex loc_raw = ld_index_raw(or_nblk(a.new_loc), b, a.new_loc ? a.new_loc64 : a.nblk64);
  const int qe = tid * 8;  // G * D <= 8 * kOpThreads: one 8-wide piece per thread at most
  // (a thread past the group's G * D reads its first piece again, unused: no branch)
  const Raw8Any q_raw =
      ld8_raw(a.q, b * a.q_stride + (int64_t)hk * G * D + (qe < G * D ? qe : 0), a.q_dtype);
  const int nb = clamp_count(index_of(nb_raw, a.nblk64), NB);
  const int nbn = pred ? clamp_count(index_of(nbn_raw, a.nblk_next64), NB) : nb;
  bool first_tok = false;
  const int newest =
      a.new_k ? new_key_block_at(index_of(pos_raw, a.new_pos64), a.page_size, first_tok) : -1;
  // the update's page (new_key_page's value)
  const int64_t wpage =
      a.new_loc ? slot_page(index_of(loc_raw, a.new_loc64), a.page_size, a.num_pages) : -1;
  const int64_t srow = pred ? slot_of(a.rows, a.rows64, a.rows_n, b) : 0;
  float al = 0.f, be = 0.f, gam = 0.f;
  int ninit = 0;
  float l0[PASSES], v0[PASSES];
  const int64_t srow_hk = (srow * a.Hk + hk) * NB;
  if (pred) {
    al = a.theta[srow * a.theta_stride];
    be = a.theta[srow * a.theta_stride + 1];
    gam = a.theta[srow * a.theta_stride + 2];
    ninit = clamp_count(ld_index(a.n_init, srow, a.ninit64), NB);
  }
  const auto load_state = [&](int c) {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int blk = c * kOpChunk + p * BPP + grp;
      l0[p] = v0[p] = 0.f;
      if (pred && ln == 0 && blk < NB) {
        l0[p] = a.level[srow_hk + blk];
        v0[p] = a.trend[srow_hk + blk];
      }
    }
  };
  load_state(ch);
  const int Lr = max(nb, nbn);
  const int nch = max((Lr + kOpChunk - 1) / kOpChunk, 1);
  if (ch >= nch) return probe_exit(a);  // chunks past the row's blocks (the table is as wide
                                        // as the longest)
  stamp(a, kSlCounts);
  // The CTAs of the row that hold chunks: the group the last-CTA counters wait for.
  const int nwork = Loop ? min((int)gridDim.x, nch) : nch;
  const int ninit_new = max(ninit, nb);
  float* srow_out = a.scores ? a.scores + row * NB : nullptr;
  int ticket = -1;
  bool first = true;
  for (;;) {  // this CTA's chunks
    // ---- the summaries (second round trip), all passes in flight
    Sum8<S> rlo[PASSES], rhi[PASSES];
    const S* kmin = reinterpret_cast<const S*>(a.kmin);
    const S* kmax = reinterpret_cast<const S*>(a.kmax);
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int blk = ch * kOpChunk + p * BPP + grp;
      if (blk < nb) {
        const int64_t page = in_pool(index_of(page_raw[p], a.table64), a.num_pages);
        const int64_t off = (page * a.Hk + hk) * D + ln * 8;
        rlo[p].load(kmin + off);
        rhi[p].load(kmax + off);
      }
    }
    // The new key's 8 values of this lane, with the summaries' round trip (one block a row).
    float kf[8];
    const int rel = newest - ch * kOpChunk - grp;
    const bool has_new = newest >= 0 && newest < nb && rel >= 0 && rel < kOpChunk && rel % BPP == 0;
    if (has_new)
      load8_any(a.new_k, b * a.new_k_stride + (int64_t)hk * D + ln * 8, a.new_k_dtype, kf);
    if (first) stamp(a, kSlIssued);
    if (first && qe < G * D) {
      float qf8[8];
      raw8_floats(q_raw, a.q_dtype, qf8);
      const int qrow = qe - qe % D, ql = (qe % D) / 8;  // the head's row, the lane of the dims
      *reinterpret_cast<float4*>(s_q + qrow + ql * 4) = make_float4(qf8[0], qf8[1], qf8[2], qf8[3]);
      *reinterpret_cast<float4*>(s_q + qrow + D / 2 + ql * 4) =
          make_float4(qf8[4], qf8[5], qf8[6], qf8[7]);
    }
    __syncthreads();  // s_q (the first chunk); the previous chunk's s_ck reads (the others)
    if (first) {
      stamp(a, kSlLoaded);
      // Lane ln's dims [8 ln, 8 ln + 8) of the group's q as two sums (quest_fold_q), in shared
      // memory (registers over the passes would spill), while the summaries are in flight.
      if (tid < L) {
        float qp[8] = {}, qn[8] = {};
#pragma unroll 1
        for (int g = 0; g < G; ++g) {
          float qv[8];
          group_q8(s_q + g * D, D, tid, qv);
          quest_fold_q<8>(qv, qp, qn);
        }
#pragma unroll
        for (int i = 0; i < 8; i += 4) {
          *reinterpret_cast<float4*>(s_qpn + tid * kQpnRow + i) =
              make_float4(qp[i], qp[i + 1], qp[i + 2], qp[i + 3]);
          *reinterpret_cast<float4*>(s_qpn + tid * kQpnRow + 8 + i) =
              make_float4(qn[i], qn[i + 1], qn[i + 2], qn[i + 3]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int blk = ch * kOpChunk + p * BPP + grp;
      float part = 0.f;
      if (blk < nb) {
        float lo[8], hi[8];
        rlo[p].get(lo);
        rhi[p].get(hi);
        if (has_new && blk == newest) {
#pragma unroll
          for (int i = 0; i < 8; ++i) fold_key<S>(kf[i], first_tok, lo[i], hi[i]);
          if (wpage >= 0) {  // the decode update (SelectArgs::new_loc): this lane's 8 dims
            const int64_t off = (wpage * a.Hk + hk) * D + ln * 8;
            store_bounds4<S>(a.w_kmin, a.w_kmax, off, make_float4(lo[0], lo[1], lo[2], lo[3]),
                             make_float4(hi[0], hi[1], hi[2], hi[3]));
            store_bounds4<S>(a.w_kmin, a.w_kmax, off + 4, make_float4(lo[4], lo[5], lo[6], lo[7]),
                             make_float4(hi[4], hi[5], hi[6], hi[7]));
          }
        }
        // The group's bound from q's two sums (quest_piece_sum), or the reference's per-head sum
        // where that is not finite.
        {
          const float4* r = reinterpret_cast<const float4*>(s_qpn + ln * kQpnRow);
          const float4 p0 = r[0], p1 = r[1], n0 = r[2], n1 = r[3];
          const float qp[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
          const float qn[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
          part = quest_piece_sum<8>(lo, hi, qp, qn, 0.f);
        }
        if (!isfinite(part)) {
          part = 0.f;
#pragma unroll 1
          for (int g = 0; g < G; ++g) {
            float qv[8];
            group_q8(s_q + g * D, D, ln, qv);
#pragma unroll
            for (int i = 0; i < 8; ++i) part += fmaxf(qv[i] * hi[i], qv[i] * lo[i]);
          }
        }
      }
#pragma unroll
      for (int off = L / 2; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
      if (ln == 0) {
        const int li = p * BPP + grp;
        if (srow_out && blk < NB) srow_out[blk] = blk < nb ? part : -INFINITY;
        uint32_t ka = 0, kp = 0;
        if (blk < nb && is_middle(blk, nb, a.sink, nb - a.local)) ka = order_key(part);
        if (pred && blk < Lr) {
          float l = 0.f, v = 0.f;
          if (blk < nb) {  // eq 3, rounded op by op like the reference
            // A level or trend that is not finite (InfLLM-v2 scores -inf before a complete
            // compressed key) restarts like a new block, as in the reference.
            if (blk < ninit && isfinite(l0[p]) && isfinite(v0[p])) {
              v = __fadd_rn(__fmul_rn(be, __fsub_rn(part, l0[p])),
                            __fmul_rn(__fsub_rn(1.f, be), v0[p]));
              l = __fadd_rn(__fmul_rn(al, part), __fmul_rn(__fsub_rn(1.f, al), l0[p]));
            } else {
              l = part;
            }
            a.level[srow_hk + blk] = l;
            a.trend[srow_hk + blk] = v;
          } else if (blk < ninit_new) {
            l = l0[p];
            v = v0[p];
          }
          if (is_middle(blk, nbn, a.sink, nbn - a.local))
            kp = order_key(blk < ninit_new ? __fadd_rn(l, __fmul_rn(gam, v)) : -INFINITY);
        }
        s_ck[0][li] = comp_key(ka, blk);
        s_ck[1][li] = comp_key(kp, blk);
      }
    }
    __syncthreads();
    if (first) stamp(a, kSlScored);
    // n_init: raised once every CTA of the request has read it (every read above was used). The
    // ticket is taken here, its answer used at the end, so its round trip overlaps the rest.
    if (first && pred && tid == 0) ticket = atomicAdd(a.req_sem + b, 1);
    // ---- the chunk's candidates: rank among the chunk (keys are distinct), keep the best kc
    const int na = __syncthreads_count(tid < kOpChunk && s_ck[0][tid] != 0);
    const int np = __syncthreads_count(tid < kOpChunk && s_ck[1][tid] != 0);
    if (tid < 2 * kOpChunk) {
      const int kind = tid / kOpChunk, i = tid % kOpChunk;
      const unsigned long long x = s_ck[kind][i];
      const int kc = kind == 0 ? a.kca : a.kcp;
      if (x != 0 && (kind == 0 || pred)) {
        int r = 0;
#pragma unroll 8
        for (int j = 0; j < kOpChunk; ++j) r += s_ck[kind][j] > x;
        if (r < kc) a.ws[(row * a.nch + ch) * (a.kca + a.kcp) + kind * a.kca + r] = x;
      }
    }
    if (tid == 0) {
      a.ws_cnt[(row * a.nch + ch) * 2] = min(na, a.kca);
      a.ws_cnt[(row * a.nch + ch) * 2 + 1] = pred ? min(np, a.kcp) : 0;
    }
    ch += gridDim.x;
    if (!Loop || ch >= nch) break;
    first = false;
    load_pages(ch);  // the next chunk's round trips (the summaries wait on the pages)
    load_state(ch);
  }
  stamp(a, kSlRanked);
  if (a.debug_stop == 1) return probe_exit(a);  // timing probe: the chunks' pass alone
  // P(t) is an input, not the row's result: every CTA issues its count and first entries before
  // the ticket, so the last CTA's copies arrive with the ticket (a round trip off its tail).
  int pc_raw = 0, p_first = -1;
  const int64_t prow = a.p_idx ? slot_of(a.p_rows, a.p_rows64, a.p_rows_n, b) * a.Hk + hk : 0;
  if (a.p_idx) {
    pc_raw = a.p_cnt[prow];
    if (tid < a.Np) p_first = a.p_idx[prow * a.Np + tid];
  }
  const bool last = last_of_group(a.sem + row, nwork);
  stamp(a, kSlArrival);
  if (ticket == a.Hk * nwork - 1) {
    atomicExch(a.req_sem + b, 0);
    if (a.ninit64) reinterpret_cast<long long*>(a.n_init)[srow] = ninit_new;
    else reinterpret_cast<int*>(a.n_init)[srow] = ninit_new;
  }
  if (!last) return probe_exit(a);
  pdl_trigger();  // only the rows' tails are left: the next kernel's CTAs may be scheduled

  // ================================================================ the row's tail
  if (srow_out)
    for (int i = nch * kOpChunk + tid; i < NB; i += kOpThreads) srow_out[i] = -INFINITY;
  const int KA = max(a.k, 0), KP = pred ? max(a.n_pred, 0) : 0;
  // Shared memory, sized by the row's chunks (select_one_pass sizes it by the table's): the
  // chunks' candidates as the workspace holds them (chunk c's A list at cand[c * W], its P list
  // at cand[c * W + kca]: a flat copy), then a second buffer of each kind (A1, P1: the sample,
  // then the survivors), the counts (chunk c's at cA[c], cP[c]); the top-K (A's at cand[0],
  // P(t+1)'s at cand[nch * kca]) overwrites the candidates once they are read.
  const int W = a.kca + a.kcp;
  unsigned long long* const cand = reinterpret_cast<unsigned long long*>(s_dyn);
  unsigned long long* const A1 = cand + (size_t)nch * W;
  unsigned long long* const P1 = A1 + (size_t)nch * a.kca;
  unsigned long long* const resA = cand;
  unsigned long long* const resP = cand + (size_t)nch * a.kca;
  int* const cA = reinterpret_cast<int*>(P1 + (size_t)nch * a.kcp);
  int* const cP = cA + nch;
  int* s_pl = cP + nch;                   // P(t) [Np]
  int* s_ida = s_pl + a.Np;               // A's top ids, ascending [KA]
  int* s_idp = s_ida + KA;                // P(t+1)'s top ids, ascending [KP]
  int* s_alist = s_idp + KP;              // A [n_out]
  // candidates (third round trip, L2), and P(t) for M: the counts' loads, then every candidate
  // load in flight at once (kTailLoads per thread per round trip).
  constexpr int kTailLoads = 16;
  const unsigned long long* wrow = a.ws + row * a.nch * W;
  const int* crow = a.ws_cnt + row * a.nch * 2;
  int cnt_a = 0, cnt_p = 0;
  if (tid < nch) { cnt_a = __ldcg(crow + 2 * tid); cnt_p = __ldcg(crow + 2 * tid + 1); }
#pragma unroll 1
  for (int e0 = tid; e0 < nch * W; e0 += kTailLoads * kOpThreads) {
    unsigned long long x[kTailLoads];
#pragma unroll
    for (int u = 0; u < kTailLoads; ++u) {
      const int e = e0 + u * kOpThreads;
      if (e < nch * W) x[u] = __ldcg(wrow + e);
    }
#pragma unroll
    for (int u = 0; u < kTailLoads; ++u) {
      const int e = e0 + u * kOpThreads;
      if (e < nch * W) cand[e] = x[u];
    }
  }
  if (tid < nch) { cA[tid] = cnt_a; cP[tid] = cnt_p; }
#pragma unroll 1
  for (int c = tid + kOpThreads; c < nch; c += kOpThreads) {
    cA[c] = __ldcg(crow + 2 * c);
    cP[c] = __ldcg(crow + 2 * c + 1);
  }
  int pc = 0;
  if (a.p_idx) {
    pc = min(max(pc_raw, 0), a.Np);
    if (tid < pc) s_pl[tid] = p_first;
#pragma unroll 1
    for (int i = tid + kOpThreads; i < pc; i += kOpThreads) s_pl[i] = a.p_idx[prow * a.Np + i];
  }
  __syncthreads();
  stamp(a, kSlTailLoads);
  if (a.debug_stop == 2) return probe_exit(a);  // timing probe: up to the tail's loads
  // The K best candidates of each kind without log2(chunks) rounds of merges:
  // (1) a sample S, every list's first j (|S| ~ 2K), flat in the second buffer with 0 (below
  //     every key) where a list is shorter; T = S's K-th best. S holds >= K candidates, so T is
  //     at most the K-th best of all and the top K are >= T (T = 0, every candidate, when S
  //     holds fewer than K);
  // (2) the survivors (>= T: about K to 2K when the best blocks spread over the chunks, every
  //     candidate at worst) gathered over S in the second buffer;
  // (3) each survivor's rank among the survivors, which is its rank among all candidates for the
  //     top K (distinct keys); rank < K writes it at its place in the top-K (resA / resP).
  // A rank is a flat loop of broadcast loads (independent, unrolled), not a chain of searches.
  // One chunk: its lists are the answer (kca <= K, kcp <= |P|).
  __shared__ unsigned long long s_thr[2];
  __shared__ int s_nsurv[2];
  if (nch > 1) {
    const int jA = min(a.kca, max(1, (2 * KA + nch - 1) / nch));
    const int jP = min(a.kcp, max(1, (2 * KP + nch - 1) / nch));
    const int nsa = nch * jA, nsp = nch * jP;
#pragma unroll 1
    for (int e = tid; e < nsa + nsp; e += kOpThreads) {
      const bool isA = e < nsa;
      const int j = isA ? jA : jP, ee = isA ? e : e - nsa, c = ee / j, i = ee % j;
      const unsigned long long* lst = cand + c * W + (isA ? 0 : a.kca);
      (isA ? A1 : P1)[ee] = i < (isA ? cA : cP)[c] ? lst[i] : 0ull;
    }
    if (tid < 2) { s_thr[tid] = 0ull; s_nsurv[tid] = 0; }
    __syncthreads();
#pragma unroll 1
    for (int e = tid; e < nsa + nsp; e += kOpThreads) {
      const bool isA = e < nsa;
      const unsigned long long* sv = isA ? A1 : P1;
      const unsigned long long x = sv[isA ? e : e - nsa];
      // one key at most has rank K - 1 (distinct keys)
      if (x != 0 && count_above(sv, isA ? nsa : nsp, x) == (isA ? KA : KP) - 1)
        s_thr[isA ? 0 : 1] = x;
    }
    __syncthreads();
#pragma unroll 1
    for (int e = tid; e < nch * W; e += kOpThreads) {
      const int c = e / W, j = e - c * W;
      const bool isA = j < a.kca;
      if ((isA ? j : j - a.kca) >= (isA ? cA : cP)[c]) continue;
      const unsigned long long x = cand[e];
      if (x >= s_thr[isA ? 0 : 1]) (isA ? A1 : P1)[atomicAdd(s_nsurv + (isA ? 0 : 1), 1)] = x;
    }
    __syncthreads();
    const int nsA = s_nsurv[0], nsP = s_nsurv[1];
#pragma unroll 1
    for (int e = tid; e < nsA + nsP; e += kOpThreads) {
      const bool isA = e < nsA;
      const unsigned long long* sv = isA ? A1 : P1;
      const unsigned long long x = sv[isA ? e : e - nsA];
      const int r = count_above(sv, isA ? nsA : nsP, x);
      if (r < (isA ? KA : KP)) (isA ? resA : resP)[r] = x;
    }
    if (tid == 0) {
      cA[0] = min(KA, nsA);
      cP[0] = min(KP, nsP);
    }
    __syncthreads();
  }
  stamp(a, kSlTopK);
  if (a.debug_stop == 3) return probe_exit(a);  // timing probe: up to the top-K
  const int ca = min(cA[0], KA), cp = min(cP[0], KP);
  // the chosen ids in ascending order (rank sort: distinct ids)
#pragma unroll 1
  for (int e = tid; e < ca + cp; e += kOpThreads) {
    const bool isA = e < ca;
    const unsigned long long* lst = isA ? resA : resP;
    const int c = isA ? ca : cp, i = isA ? e : e - ca;
    const int id = comp_id(lst[i]);
    int r = 0;
#pragma unroll 4
    for (int j = 0; j < c; ++j) r += comp_id(lst[j]) < id;
    (isA ? s_ida : s_idp)[r] = id;
  }
  __syncthreads();
  const bool dense = a.dense_row && a.dense_row[b];
  // A: dense rows take every block; else [0, sink) ++ top-K ++ [nb - local, nb).
  const int lo_a = min(a.sink, nb), hi_a = max(a.sink, nb - a.local);
  int32_t* arow = a.a_idx + row * a.n_out;
  const int acnt = dense ? write_kept_list(s_ida, 0, nb, nb, nb, arow, a.n_out, a.a_cnt + row,
                                           s_alist)
                         : write_kept_list(s_ida, ca, lo_a, hi_a, nb, arow, a.n_out,
                                           a.a_cnt + row, s_alist);
  // P(t+1): [0, sink) ++ top-|P| ++ [nbn - local, nbn), into its own rows.
  if (pred) {
    const int64_t orow = slot_of(a.p_out_rows, a.p_out_rows64, a.p_out_rows_n, b) * a.Hk + hk;
    write_kept_list(s_idp, cp, min(a.sink, nbn), max(a.sink, nbn - a.local), nbn,
                    a.p_out_idx + orow * a.Np_out, a.Np_out, a.p_out_cnt + orow);
  }
  __syncthreads();
  // M = A \ P(t), ascending (A's order), by a block scan over A's entries.
  using Scan = cub::BlockScan<int, kOpThreads>;
  __shared__ typename Scan::TempStorage s_scan;
  int base = 0;
  int32_t* mrow = a.m_idx + row * a.n_out;
  if (!a.p_idx) {  // no P (serial DSA): M = A, a copy without the scan
    for (int e = tid; e < a.n_out; e += kOpThreads) mrow[e] = e < acnt ? s_alist[e] : -1;
    base = acnt;
  } else {
    for (int e0 = 0; e0 < a.n_out; e0 += kOpThreads) {
      const int e = e0 + tid;
      int keep = 0, x = -1;
      if (e < acnt) {  // x < nb, so an entry of P equal to it is a block of the row
        x = s_alist[e];
        keep = !occurs_in(s_pl, pc, x);
      }
      int pos, tot;
      Scan(s_scan).ExclusiveSum(keep, pos, tot);
      if (keep) mrow[base + pos] = x;
      base += tot;
      __syncthreads();
    }
    for (int e = base + tid; e < a.n_out; e += kOpThreads) mrow[e] = -1;
  }
  if (tid == 0) {
    a.m_cnt[row] = base;
    if (a.stats && !dense) {
      atomicAdd(a.stats + kStatSelected, (unsigned long long)acnt);
      atomicAdd(a.stats + kStatRepair, (unsigned long long)base);
      // |P| as the reference counts it (clamped at 0, not at the list's width)
      atomicAdd(a.stats + kStatPredicted, (unsigned long long)(pc_raw > 0 ? pc_raw : 0));
      atomicAdd(a.stats + kStatRows, 1ull);
    }
  }
  stamp(a, kSlLists);
  probe_exit(a);
}

template <typename S, int D, bool Loop>
cudaError_t onepass_launch_grid(SelectArgs a, int gx, size_t smem, cudaStream_t s) {
  cudaError_t e = set_smem_limit(quest_select_onepass_kernel<S, D, Loop>, smem);
  if (e == cudaSuccess && carveout_mode() == Carveout::kSelect)
    e = ask_carveout_max(quest_select_onepass_kernel<S, D, Loop>);
  if (e != cudaSuccess) return e;
  e = probe_setup("SGLANG_PRR_SELECT_TIMELINE", (int64_t)gx * a.Hk * a.B, s, &a.timeline,
                  &a.timeline_ctas);
  if (e != cudaSuccess) return e;
  launch_kernel(quest_select_onepass_kernel<S, D, Loop>, dim3(gx, a.Hk, a.B), kOpThreads, smem,
                s, a);
  return cudaGetLastError();
}
template <typename S, int D>
cudaError_t onepass_launch(const SelectArgs& a, size_t smem, cudaStream_t s) {
  const int gx = select_grid_x((int64_t)a.B * a.Hk, a.nch, kOpCtasPerSm, false);
  return gx < a.nch ? onepass_launch_grid<S, D, true>(a, gx, smem, s)
                    : onepass_launch_grid<S, D, false>(a, gx, smem, s);
}
template <typename S>
cudaError_t onepass_dispatch(const SelectArgs& a, size_t smem, cudaStream_t s) {
  switch (a.D) {
    case 64: return onepass_launch<S, 64>(a, smem, s);
    case 128: return onepass_launch<S, 128>(a, smem, s);
    default: return onepass_launch<S, 256>(a, smem, s);
  }
}

// SGLANG_PRR_SELECT_KERNEL=rowtail|onepass|split forces one selection path where it applies (a
// tuning and test knob, read at each launch on the host: a captured graph keeps the kernel it was
// captured with): the row-tail kernel, the one-pass kernel, or the scores and the rows' tails in
// two launches; by default the shape picks (select_takes_split), and the one-pass kernel runs
// where it fits and the shape does not split.
inline int select_kernel_env() {
  const char* e = getenv("SGLANG_PRR_SELECT_KERNEL");
  if (!e) return 0;
  if (!strcmp(e, "rowtail")) return 1;
  if (!strcmp(e, "onepass")) return 2;
  if (!strcmp(e, "split")) return 3;
  return 0;
}

// Batch x table blocks from which the scores and the rows' tails in two launches beat the one-pass
// kernel for serial DSA and for PRR's selection beside the side predictor (H200, bf16 summaries,
// cold L2, bench_kernel_stages --parts selection, the streamed scores kernel): at 128K (2048
// blocks) the one-pass kernel wins at batch 1 (13.7 vs 17.3 us), the two launches from batch 2
// (19.7 vs 20.3) and 4 (24.2 vs 29.9); with a 32K table (516 blocks) they tie at batch 4 (14.6 vs
// 14.4) and win from 8 (17.4 vs 20.4) and 16 (21.7 vs 29.8). In the server at 32K / 8 the
// selection takes 17.9 us a layer against the one-pass kernel's 22.0 (ITL 6.244 vs 6.365 ms). The
// one-pass kernel's per-CTA fence, ticket and candidate merge cost more once a row's chunks fill
// waves of their own. With the predictor in the epilogue (--prr-predictor fused) the one-pass
// kernel stays: its fused update beat the two launches plus the predictor's own in the server
// (ITL 9.18 vs 9.32 ms at 32K / 16, the warp-per-block scores kernel).
constexpr int64_t kSplitMinBlocks = 4096;

}  // namespace

bool select_takes_split(int64_t B, int NB, bool predictor) {
  const int forced = select_kernel_env();
  if (forced != 0) return forced == 3;
  return !predictor && B * (int64_t)NB >= kSplitMinBlocks;
}

bool select_one_pass(int D, int G, int NB, int k, int n_pred, int Np, int n_out, int* nch,
                     int* kca, int* kcp, size_t* smem) {
  if (!(D == 64 || D == 128 || D == 256) || G < 1 || G > kMaxGroup || NB <= 0) return false;
  const int n = (NB + kOpChunk - 1) / kOpChunk;
  const int ka = std::min(std::max(k, 0), kOpChunk), kp = std::min(std::max(n_pred, 0), kOpChunk);
  // The tail's candidates, its second buffers and the chunks' counts (the kernel's layout),
  // then P(t), A's and P(t+1)'s ids and A. Sized by the chunks, not by a power of two above
  // them: a table a few tokens past 128K (2051 blocks, 33 chunks, the server's at 128K) takes
  // 43 KB a CTA, not 82.
  const size_t bytes = 2 * (size_t)n * (ka + kp) * sizeof(unsigned long long) +
                       2 * (size_t)n * sizeof(int) +
                       ((size_t)Np + std::max(k, 0) + std::max(n_pred, 0) + n_out) * sizeof(int);
  *nch = n; *kca = ka; *kcp = kp; *smem = bytes;
  return bytes <= kOpMaxSmem;
}

cudaError_t launch_quest_select(const SelectArgs& a, cudaStream_t s) {
  if (a.D % 8 != 0 || a.Hq % a.Hk != 0 || a.NB > kTopkMaxBlocks)
    return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0 || a.NB == 0) return cudaSuccess;
  int nch, kca, kcp;
  size_t smem;
  const int forced = select_kernel_env();
  const bool split = select_takes_split(a.B, a.NB, a.level != nullptr);
  if (a.ws && !split && forced != 1 &&
      select_one_pass(a.D, a.Hq / a.Hk, a.NB, a.k, a.level ? a.n_pred : 0, a.Np,
                      a.n_out, &nch, &kca, &kcp, &smem)) {
    if (nch != a.nch || kca != a.kca || kcp != a.kcp) return cudaErrorInvalidValue;
    // Timing probes of the kernel's stages (development only).
    static const int stop = debug_stop_env("SGLANG_PRR_SELECT_DEBUG_STOP");
    SelectArgs c = a;
    c.debug_stop = stop;
    return c.s_dtype == kBF16 ? onepass_dispatch<__nv_bfloat16>(c, smem, s)
                              : onepass_dispatch<float>(c, smem, s);
  }
  cudaError_t e = split ? launch_quest_select_split(a, s) : launch_quest_select_rowtail(a, s);
  if (e != cudaSuccess || !a.level) return e;
  // The predictor's own kernel, after the scores (sizes the one-pass kernel does not take).
  PredictArgs p{};
  p.rows = a.rows; p.rows64 = a.rows64; p.rows_n = a.rows_n;
  p.level = a.level; p.trend = a.trend; p.n_init = a.n_init; p.ninit64 = a.ninit64;
  p.scores = a.scores; p.nblk = a.nblk; p.nblk64 = a.nblk64;
  p.nblk_next = a.nblk_next; p.nblk_next64 = a.nblk_next64;
  p.theta = a.theta; p.theta_stride = a.theta_stride;
  p.idx = a.p_out_idx; p.cnt = a.p_out_cnt; p.n_out = a.Np_out;
  p.p_rows = a.p_out_rows; p.p_rows64 = a.p_out_rows64; p.p_rows_n = a.p_out_rows_n;
  p.sem = a.req_sem;
  p.B = a.B; p.Hk = a.Hk; p.NB = a.NB; p.k = a.n_pred; p.sink = a.sink; p.local = a.local;
  return launch_predict_update(p, s);
}

}  // namespace prr
