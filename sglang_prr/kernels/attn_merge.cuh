// The fixed-order merge of a (request, KV head) group's partials, shared by the attention
// launches: the launch's inputs, the kept entries sorted by block id, the weights and the rows'
// sums. One copy of the arithmetic, so every launch that merges the same partials in the same
// order writes the same bits.
#pragma once
#include "attn_block.cuh"

#include <cub/block/block_scan.cuh>
#include <climits>

namespace prr {
namespace {

// ============================================================================ fixed-order merge
// The last CTA of a (b, hk) group merges, for the G query heads, the kept partials of this
// launch's list and of the optional first source (the speculative partials over P: exact keeps
// P n A, union all of P; a repeated id of a list counts once) in ascending block id, with the
// speculative entry before the repair entry of the same id. The order, the max and the sums are
// the same for any split of A between P and M, so the output bits are too. Natural-log lse, as
// every state of the ops. Called by every thread of the group's `group` CTAs.

// Bytes of the merge's arrays (its lists, keys, entries and weights: the bytes
// dispatch.attn_merge_smem checks) rounded up to 16, so that a row stage after them is aligned.
__host__ __device__ __forceinline__ size_t merge_arrays_bytes(int N, int N1, int Na, int G) {
  const size_t E = (size_t)N + N1;
  return (((size_t)N + N1 + Na + 3 * E) * sizeof(int) + (size_t)G * E * sizeof(float) + 15) &
         ~(size_t)15;
}

// The merge's inputs a CTA loads (a list entry per thread): counts, lists, the request's length.
struct MergeLoads {
  int64_t sl;
  int c2_raw, pc_raw, ca_raw, x_list, x_p, x_a;
};

// The shape of the merge's sources for this launch.
struct MergeShape {
  int G, N, N1, Na, E;
  bool filt;
  __device__ __forceinline__ explicit MergeShape(const AttnArgs& a)
      : G(a.Hq / a.Hk), N(a.N), N1(a.o1 ? a.N1 : 0),
        Na((a.o1 && a.N1 > 0 && a.p_idx != nullptr && a.p_exact) ? a.Na : 0),
        E(a.N + (a.o1 ? a.N1 : 0)), filt(a.o1 && a.N1 > 0 && a.p_idx != nullptr) {}
};

// The merge's arrays in shared memory (merge_arrays_bytes counts them): the three lists, the
// kept entries' keys, the entries, the entries sorted, then the weights.
struct MergeArrays {
  int* list;  // [N]   this launch's ids
  int* p;     // [N1]  P's ids
  int* a;     // [Na]  A's ids
  int* key;   // [E]   kept entries' sort keys
  int* ent;   // [E]   kept entries: position << 1 | source
  int* srt;   // [E]   the same, sorted by key
  float* w;   // [G, E] weights
  __device__ __forceinline__ MergeArrays(unsigned char* smem, const MergeShape& m)
      : list(reinterpret_cast<int*>(smem)), p(list + m.N), a(p + m.N1), key(a + m.Na),
        ent(key + m.E), srt(ent + m.E), w(reinterpret_cast<float*>(srt + m.E)) {}
};

// The counts and lists are the launch's inputs, not the group's results, so a CTA may load them
// before its ticket (or before its attention): their copies then arrive with the ticket instead
// of one round trip after it (a few hundred bytes of L2 hits per CTA).
__device__ __forceinline__ MergeLoads merge_loads(const AttnArgs& a, int b, int hk) {
  const MergeShape m(a);
  const int tid = threadIdx.x;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, a.idx_rows_n, b) * a.Hk + hk;
  const int64_t prow = slot_of(a.p_rows, a.p_rows64, a.p_rows_n, b) * a.Hk + hk;
  MergeLoads l;
  l.sl = ld_index(a.seq_lens, b, a.seq64);
  l.c2_raw = a.cnt[lrow];
  l.pc_raw = m.filt ? a.p_cnt[prow] : m.N1;
  l.ca_raw = m.Na ? a.a_cnt[row] : 0;
  l.x_list = tid < m.N ? a.idx[lrow * m.N + tid] : 0;
  l.x_p = (m.filt && tid < m.N1) ? a.p_idx[prow * m.N1 + tid] : 0;
  l.x_a = tid < m.Na ? a.a_idx[row * m.Na + tid] : 0;
  return l;
}

// The launch's three lists, from the loaded inputs, into the merge arrays at `smem` (ends with a
// barrier). Called by every thread of the CTA.
__device__ void merge_stage_lists(const AttnArgs& a, int b, int hk, const MergeLoads& l,
                                  unsigned char* smem) {
  const MergeShape m(a);
  const int N = m.N, N1 = m.N1, Na = m.Na;
  const bool filt = m.filt;
  const int tid = threadIdx.x;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, a.idx_rows_n, b) * a.Hk + hk;
  const int64_t prow = slot_of(a.p_rows, a.p_rows64, a.p_rows_n, b) * a.Hk + hk;
  const MergeArrays arr(smem, m);
  int* const s_list = arr.list;
  int* const s_p = arr.p;
  int* const s_a = arr.a;
  if (tid < N) s_list[tid] = l.x_list;
  if (filt && tid < N1) s_p[tid] = l.x_p;
  if (tid < Na) s_a[tid] = l.x_a;
  // Entries past the first kAttnThreads (rows that select every block of a long context): the
  // three lists' loads of a round go out together, then their stores.
#pragma unroll 1
  for (int i = tid + kAttnThreads; i < N || (filt && i < N1) || i < Na; i += kAttnThreads) {
    const int y0 = i < N ? a.idx[lrow * N + i] : 0;
    const int y1 = (filt && i < N1) ? a.p_idx[prow * N1 + i] : 0;
    const int y2 = i < Na ? a.a_idx[row * Na + i] : 0;
    if (i < N) s_list[i] = y0;
    if (filt && i < N1) s_p[i] = y1;
    if (i < Na) s_a[i] = y2;
  }
  __syncthreads();
}

// The kept entries of the merge in ascending block id (s_srt, returned: how many), from the lists
// merge_stage_lists staged in the arrays at `smem`. Called by every thread of the CTA.
__device__ int merge_sort(const AttnArgs& a, const MergeLoads& l, unsigned char* smem) {
  const MergeShape m(a);
  const int N = m.N, N1 = m.N1, Na = m.Na, E = m.E;
  const bool filt = m.filt;
  const int tid = threadIdx.x;
  const int64_t sl = l.sl;
  using Scan = cub::BlockScan<int, kAttnThreads>;
  __shared__ typename Scan::TempStorage s_scan;
  const MergeArrays arr(smem, m);
  const int* const s_list = arr.list;
  const int* const s_p = arr.p;
  const int* const s_a = arr.a;
  int* const s_key = arr.key;
  int* const s_ent = arr.ent;
  int* const s_srt = arr.srt;
  const int c2 = clamp_count(l.c2_raw, N);
  const int pc = filt ? clamp_count(l.pc_raw, N1) : N1;
  const int ca = Na ? clamp_count(l.ca_raw, Na) : 0;
  // A block is kept only if it holds tokens of the request; others have the state (0, -inf),
  // which would add exact zeros.
  auto has_tokens = [&](int id) {
    return id >= 0 && id < a.NB && (int64_t)id * a.page_size < sl;
  };
  // Keys: P's entry of block x sorts as 2x, this launch's as 2x + 1; without P's ids (union
  // with no list) the first source's entries come first, in their order.
  int pos_base = 0;
#pragma unroll 1
  for (int e0 = 0; e0 < E; e0 += kAttnThreads) {
    const int e = e0 + tid;
    int keep = 0, key = 0, ent = 0;
    if (e < N1) {
      if (!filt) {
        keep = 1; key = INT_MIN + e;
      } else {
        // Membership tests as independent compares (broadcast reads, many in flight), not
        // early-exit loops whose every step waits on the one before.
        const int x = s_p[e];
        keep = e < pc && has_tokens(x) && !occurs_in(s_p, e, x);  // a repeat counts once
        if (a.p_exact) keep = keep && occurs_in(s_a, ca, x);
        key = 2 * x;
      }
      ent = e << 1;
    } else if (e < E) {
      const int n = e - N1, x = s_list[n];
      keep = n < c2 && has_tokens(x) && !occurs_in(s_list, n, x);
      key = 2 * x + 1;
      ent = (n << 1) | 1;
    }
    int pos, total;
    Scan(s_scan).ExclusiveSum(keep, pos, total);
    if (keep) { s_key[pos_base + pos] = key; s_ent[pos_base + pos] = ent; }
    pos_base += total;
    __syncthreads();
  }
  const int nk = pos_base;
  // Rank sort (keys are distinct): a few hundred entries at most.
#pragma unroll 1
  for (int i = tid; i < nk; i += kAttnThreads) {
    const int k = s_key[i];
    int r = 0, j = 0;
#pragma unroll 1
    for (; j + 8 <= nk; j += 8) {
#pragma unroll
      for (int u = 0; u < 8; ++u) r += s_key[j + u] < k;
    }
#pragma unroll 1
    for (; j < nk; ++j) r += s_key[j] < k;
    s_srt[r] = s_ent[i];
  }
  __syncthreads();
  return nk;
}

// The kept entries of the merge in ascending block id (s_srt, returned: how many), from the
// loaded inputs, into the merge arrays at `smem`. Called by every thread of the CTA.
__device__ __forceinline__ int merge_entries(const AttnArgs& a, int b, int hk,
                                             const MergeLoads& l, unsigned char* smem) {
  merge_stage_lists(a, b, hk, l, smem);
  return merge_sort(a, l, smem);
}

// The merge's weights: with s_w[g * nk + i] the lse of head g's sorted entry i, each becomes
// exp(lse - max) (an empty state: exp(-inf) = 0), s_msafe[g] the max (0 where not finite) and
// s_lsum[g] their sum (a warp per head: lane-strided sums, then a fixed xor tree). Called by
// every thread of the CTA; the caller's barrier orders the results before their reads.
__device__ __forceinline__ void merge_weights(float* s_w, int nk, int G, float* s_msafe,
                                              float* s_lsum) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = warp; g < G; g += kAttnWarps) {
    float* w = s_w + g * nk;
    float mx = -INFINITY;
#pragma unroll 1
    for (int i = lane; i < nk; i += 32) mx = fmaxf(mx, w[i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_safe = (mx == -INFINITY || mx == INFINITY || mx != mx) ? 0.f : mx;
    float ls = 0.f;
#pragma unroll 1
    for (int i = lane; i < nk; i += 32) {
      const float ex = expf(w[i] - m_safe);  // an empty state: exp(-inf) = 0
      w[i] = ex;
      ls += ex;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
    if (lane == 0) { s_msafe[g] = m_safe; s_lsum[g] = ls; }
  }
}

// One weighted partial row added to a merge's sum. A row of weight 0 (an empty state, or an lse
// far below the max) is skipped, not multiplied, so that whatever it holds adds nothing; a kept
// row's NaN or inf (a non-finite V inside the request) reaches the output, as in the reference
// and in dense attention. Skipping adds nothing a multiplication by 0 would have: the sum starts
// at +0 and never becomes -0, so finite inputs give the same bits either way.
__device__ __forceinline__ void merge_accum(float4& acc, float wt, float4 y) {
  if (wt == 0.f) return;
  acc.x = fmaf(wt, y.x, acc.x); acc.y = fmaf(wt, y.y, acc.y);
  acc.z = fmaf(wt, y.z, acc.z); acc.w = fmaf(wt, y.w, acc.w);
}

// A merged item (4 dims [4c, 4c + 4) of output row r) normalised and stored in the output dtype;
// the row's lse with its first item.
__device__ __forceinline__ void merge_store(const AttnArgs& a, int64_t r, int c, int D,
                                            float4 acc, float m_safe, float lsum) {
  const float inv = 1.f / fmaxf(lsum, 1e-30f);
  acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
  store4_any(a.out_o, r * D + 4 * c, a.out_dtype, acc);
  if (c == 0 && a.out_lse) a.out_lse[r] = m_safe + logf(lsum);
}

// The merge of the sorted entries (nk of them, s_srt in the arrays at `smem`) into out_o /
// out_lse for the group's output items [lo, hi) (item e: head e / (D / 4), dims 4 (e % (D / 4))
// and up), the partial rows staged at `s_rows` (room for a.merge_rows entries of all G * D / 4
// items: a narrower range takes more entries a round). Each item's sum visits the entries in
// the same order whichever CTA computes it, so a range has the bits of the whole. Called by
// every thread of the CTA that merges the range.
__device__ void merge_rows(const AttnArgs& a, int b, int hk, unsigned char* smem,
                           float4* s_rows, int nk, int D, int lo, int hi) {
  const MergeShape m(a);
  const int G = m.G, N = m.N, N1 = m.N1;
  const int tid = threadIdx.x;
  __shared__ float s_msafe[kHeadsN], s_lsum[kHeadsN];
  const MergeArrays arr(smem, m);
  const int* s_srt = arr.srt;
  // The merge in sorted order: lse of every (query head, entry) to shared memory, the max and
  // the weights per head (a warp per head; lane-strided sums, then a fixed xor tree), then a
  // thread per (query head, 4 dims) item sums its weighted rows.
  float* s_w = arr.w;  // [G, E]
  const int64_t r0 = (int64_t)b * a.Hq + (int64_t)hk * G;  // first query head of the group
  // Partial rows go to shared memory by cp.async (no registers held), in passes of at most
  // kAttnThreads items (a thread sums one item of a pass) and rounds of `cap` entries, as many
  // as the stage holds for the pass's items (the launch sizes it: a.merge_rows entries of all G
  // * D / 4 items). A round's (entry, item) copies are spread over all threads, so a narrow
  // range (a few items a CTA) still issues them at once, and a barrier separates the copies
  // from the sums. They depend on the sorted entries only: the first round goes out here,
  // beside the lse loads, and the two round trips overlap.
  const int D4 = D / 4, items = hi - lo, width = min(items, kAttnThreads);
  const int sh = __ffs(D4) - 1;  // D / 4 is a power of two: item e is head e >> sh, piece e & mask
  const int cap = (int)max((int64_t)1, (int64_t)a.merge_rows * G * D4 / max(width, 1));
  // Rows [i0, i0 + cap) of the pass's items [lo + le0, lo + le0 + w) -> s_rows[u][j]; a
  // thread's (u, j) advance by kAttnThreads copies a step (one division a round).
  auto issue_rows = [&](int le0, int w, int i0) {
    const int nu = min(cap, nk - i0), du = kAttnThreads / w, dj = kAttnThreads % w;
    int u = tid / w, j = tid % w;
#pragma unroll 1
    while (u < nu) {
      const int e = lo + le0 + j, ent = s_srt[i0 + u];
      const int64_t r = r0 + (e >> sh);
      const float4* src = (ent & 1) ? reinterpret_cast<const float4*>(a.o + r * N * D)
                                    : reinterpret_cast<const float4*>(a.o1 + r * N1 * D);
      cute::SM80_CP_ASYNC_CACHEGLOBAL<uint4>::copy(
          *reinterpret_cast<const uint4*>(src + (ent >> 1) * D4 + (e & (D4 - 1))),
          *reinterpret_cast<uint4*>(s_rows + (size_t)u * w + j));
      u += du;
      j += dj;
      if (j >= w) { j -= w; ++u; }
    }
    cute::cp_async_fence();
  };
  // lse of (query head g, sorted entry i) -> s_w[g * nk + i], kLse loads in flight a thread. The
  // first round goes out before the first round of rows: the weights wait on the lse values,
  // the rows' sums on the weights, so the lse loads must not queue behind the rows.
  // Entry e = g * nk + i; the thread's (g, i) advance by kAttnThreads entries a step (one
  // division per thread, not one per load: the tail runs once per group, its code cold).
  constexpr int kLse = 4;
  float v[kLse];
  const int nk1 = nk > 0 ? nk : 1;
  const int dq = kAttnThreads / nk1, dr = kAttnThreads % nk1;
  int lg = tid / nk1, li = tid % nk1;  // (g, i) of the next entry load_lse reads
  auto load_lse = [&](int e0) {
#pragma unroll
    for (int u = 0; u < kLse; ++u) {
      const int e = e0 + u * kAttnThreads;
      if (e < G * nk) {
        const int ent = s_srt[li], pos = ent >> 1;
        v[u] = (ent & 1) ? __ldcg(a.lse + (r0 + lg) * N + pos)
                         : __ldcg(a.lse1 + (r0 + lg) * N1 + pos);
      }
      li += dr;
      lg += dq;
      if (li >= nk1) { li -= nk1; ++lg; }
    }
  };
  auto store_lse = [&](int e0) {
#pragma unroll
    for (int u = 0; u < kLse; ++u) {
      const int e = e0 + u * kAttnThreads;
      if (e < G * nk) s_w[e] = v[u];
    }
  };
  load_lse(tid);
  if (items > 0) issue_rows(0, width, 0);
  store_lse(tid);
#pragma unroll 1
  for (int e0 = tid + kLse * kAttnThreads; e0 < G * nk; e0 += kLse * kAttnThreads) {
    load_lse(e0);
    store_lse(e0);
  }
  __syncthreads();
  merge_weights(s_w, nk, G, s_msafe, s_lsum);
  __syncthreads();
  if (a.debug_stop == 3) return;  // timing probe: + the lse loads and the weights
  // Passes and rounds are uniform over the CTA (their barriers are reached by every thread).
#pragma unroll 1
  for (int le0 = 0; le0 < items; le0 += kAttnThreads) {
    const int w = min(kAttnThreads, items - le0);
    const bool mine = tid < w;
    const int e = lo + le0 + tid, g = mine ? e >> sh : 0, c = e & (D4 - 1);
    const float* wt = s_w + g * nk;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
    for (int i0 = 0; i0 < nk; i0 += cap) {
      if (le0 != 0 || i0 != 0) {  // (the first round went out above)
        __syncthreads();          // the stage's last sums are read
        issue_rows(le0, w, i0);
      }
      cute::cp_async_wait<0>();
      __syncthreads();
      if (mine) {
#pragma unroll 4
        for (int u = 0; u < cap && i0 + u < nk; ++u) {
          merge_accum(acc, wt[i0 + u], s_rows[(size_t)u * w + tid]);
        }
      }
    }
    if (mine) merge_store(a, r0 + g, c, D, acc, s_msafe[g], s_lsum[g]);
  }
}

// The fused merge of a group's partials, after the CTA's own partial. Either the group's last
// CTA (its ticket says so) sorts the entries and merges every output item, or, where the launch
// spreads the merge (`a.spread`: its CTAs are all resident at once), CTA n of the group's `group`
// merges its share of the G * D / 4 items after a barrier over the group: it sorts the entries
// between its arrival and its wait, beside the other CTAs' last partials, and pulls only its
// items' rows, so the tail after the last partial is the barrier and one round trip of L2 reads,
// not one CTA's sort and its pull of every row. A member that waits longer than a.spread_wait
// clocks withdraws (group_wait), and the last CTA, whose ticket counts the withdrawals, then
// merges every item: the members that did not withdraw write the same bits for their own items,
// so the output is the same whoever merges what. A group `alone` (its list empty: no partial of
// its own to wait for) has no ticket and no barrier: CTA n merges its share at once. The same
// sort, weights and sums every way (one copy of their code), so the same bits. Arrays at 0, the
// row stage after them. Called by every thread of CTA n (n < group).
__device__ void merge_tail(const AttnArgs& a, int b, int hk, int n, unsigned char* smem,
                           int group, int D, bool alone) {
  const MergeLoads l = merge_loads(a, b, hk);
  const MergeShape m(a);
  int* counter = a.sem + (int64_t)b * a.Hk + hk;
  const int items = m.G * (D / 4);
  int lo = 0, hi = items;
  bool wait = false;
  if (alone) {
    lo = (int)((int64_t)items * n / group);
    hi = (int)((int64_t)items * (n + 1) / group);
    if (lo == hi) return;  // more CTAs than items: nothing of this one's
  } else if (a.spread) {
    const int prev = group_ticket(counter, group, kGroupArrivals);
    const bool last = (prev & kGroupArrivals) == group - 1;
    if (!(last && prev >= kGroupWithdrawal)) {  // else a member withdrew: merge every item
      lo = (int)((int64_t)items * n / group);
      hi = (int)((int64_t)items * (n + 1) / group);
      if (lo == hi) return;  // more CTAs than items: this one only arrives
      wait = !last;
    }
  } else if (!last_of_group(counter, group)) {
    return;
  }
  stamp(a, kTlArrival);
  if (a.debug_stop == 1) return;  // timing probe: the chain up to the ticket (the arrival)
  const int nk = merge_entries(a, b, hk, l, smem);
  if (wait && !group_wait(counter, group, a.spread_wait)) return;
  stamp(a, kTlRows);
  if (a.debug_stop == 2) return;  // timing probe: + the lists, their sort (and the barrier)
  merge_rows(a, b, hk, smem,
             reinterpret_cast<float4*>(smem + merge_arrays_bytes(m.N, m.N1, m.Na, m.G)), nk, D,
             lo, hi);
}

}  // namespace
}  // namespace prr
