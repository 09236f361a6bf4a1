// Sparse attention over listed KV pages on SM90 (H100/H200): per-block (o, lse) partials, and
// the fused merge of a (request, KV head) group in the last CTA (serial DSA's attention over A,
// PRR's speculative pass over P and its repair over M merged exactly).
// Plain CUDA: these kernels are memory- and latency-bound, so they are written around wide loads
// and many independent requests in flight rather than tensor cores. Every kernel is graph-safe:
// static launch shapes, device-side counts, no host reads.
#include "prr_kernels.h"
#include "common.cuh"
#include "topk.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <cmath>

namespace prr {
namespace {

template <typename T>
__device__ __forceinline__ Raw8<T> zero_raw8() {
  Raw8<T> x;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) x.r[i] = make_uint4(0, 0, 0, 0);
  return x;
}
__device__ __forceinline__ void cvt8(const Raw8<float>& x, float* f) {
  const float* p = reinterpret_cast<const float*>(x.r);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = p[i];
}
__device__ __forceinline__ void cvt8(const Raw8<__half>& x, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(x.r);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 v = __half22float2(h[i]); f[2 * i] = v.x; f[2 * i + 1] = v.y; }
}
__device__ __forceinline__ void cvt8(const Raw8<__nv_bfloat16>& x, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(x.r);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 v = __bfloat1622float2(h[i]); f[2 * i] = v.x; f[2 * i + 1] = v.y; }
}

// Fused merge of one (b, hk) group of the attention kernels (AttnArgs::sem set): the last CTA of
// the group merges, for each of the G query heads (a warp per head), the partials of this launch
// with the optional first source. The exact filter keeps an entry i of the first source iff
// i < p_cnt, p_idx >= 0 and p_idx is in A (A is ascending: binary search). The kept entries
// (finite lse) are compacted first, so padding and filtered entries cost no loads, and their
// rows are then read 8 at a time (this runs after the group's other CTAs, so its L2 round trips
// are on the critical path). Arithmetic as merge_kernel. Called by every thread of the group's
// `group` CTAs (it contains __syncthreads).
constexpr int kAttnThreads = 128;
constexpr int kTailLoads = 8;

// Block lists are sets: an id listed again at a later entry is padding, so a repeated block is
// attended (and merged) once. Called by every thread of the CTA; the loads of the earlier entries
// go out beside the load of the entry's own id.
__device__ __forceinline__ bool repeats_earlier(const int32_t* list, int n, int cnt, int blk) {
  int dup = 0;
  const int lim = n < cnt ? n : cnt;
  for (int j = threadIdx.x; j < lim; j += blockDim.x) dup |= list[j] == blk;
  return __syncthreads_or(dup) != 0;
}

__device__ void attn_merge_tail(const AttnArgs& a, int b, int hk, unsigned char* smem,
                                int group) {
  const int64_t row = (int64_t)b * a.Hk + hk;
  if (!last_of_group(a.sem + row, group)) return;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, b) * a.Hk + hk;  // this launch's list
  const int64_t prow = slot_of(a.p_rows, a.p_rows64, b) * a.Hk + hk;      // P's list
  constexpr int NW = kAttnThreads / 32;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int G = a.Hq / a.Hk, D = a.D, N2 = a.N;
  const int N1 = a.o1 ? a.N1 : 0, Nt = N1 + N2;
  int* s_a = reinterpret_cast<int*>(smem);
  float* s_w = reinterpret_cast<float*>(s_a + ((a.Na + 3) & ~3)) + warp * Nt;
  int* s_e = reinterpret_cast<int*>(s_w + (NW - warp) * Nt) + warp * Nt;  // kept entry ids
  // P's partials: exact keeps those of P n A; both modes drop a repeated id of P (lists are
  // ascending, so a repeat is the entry before).
  const bool filt = N1 > 0 && a.p_idx != nullptr;
  int ca = 0, n1 = N1, pc = 0;
  if (filt) {
    pc = min(max(a.p_cnt[prow], 0), N1);
    if (a.p_exact) {
      ca = min(a.a_cnt[row], a.Na);
      for (int i = tid; i < ca; i += kAttnThreads) s_a[i] = a.a_idx[row * a.Na + i];
      n1 = pc;
    }
  }
  const int n2 = min(max(a.cnt[lrow], 0), N2);  // entries past the count are padding (0, -inf)
  __syncthreads();
  for (int g = warp; g < G; g += NW) {
    const int64_t r = (int64_t)b * a.Hq + (int64_t)hk * G + g;
    int nk = 0;  // kept entries so far (warp-uniform)
    float mx = -INFINITY;
    for (int c0 = 0; c0 < n1 + n2; c0 += 32) {
      const int c = c0 + lane;
      float v = -INFINITY;
      int e = 0;
      if (c < n1) {
        e = c;
        v = a.lse1[r * N1 + c];
        if (filt) {
          const int x = c < pc ? a.p_idx[prow * N1 + c] : -1;
          bool keep = !(c > 0 && x >= 0 && a.p_idx[prow * N1 + c - 1] == x);
          if (a.p_exact && keep) keep = x >= 0;
          if (a.p_exact && keep) {
            int lo = 0, hi = ca;
            while (lo < hi) {
              const int mid = (lo + hi) >> 1;
              if (s_a[mid] < x) lo = mid + 1; else hi = mid;
            }
            keep = lo < ca && s_a[lo] == x;
          }
          if (!keep) v = -INFINITY;
        }
      } else if (c < n1 + n2) {
        e = N1 + (c - n1);
        v = __ldcg(a.lse + r * N2 + (c - n1));
      }
      const bool kept = v != -INFINITY;
      const unsigned m = __ballot_sync(0xffffffffu, kept);
      if (kept) {
        const int pos = nk + __popc(m & ((1u << lane) - 1u));
        s_w[pos] = v;
        s_e[pos] = e;
      }
      nk += __popc(m);
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_safe = (mx == -INFINITY || mx == INFINITY || mx != mx) ? 0.f : mx;
    __syncwarp();
    float ls = 0.f;
    for (int i = lane; i < nk; i += 32) {
      const float w = expf(s_w[i] - m_safe);
      s_w[i] = w;
      ls += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
    __syncwarp();
    const float inv = 1.f / fmaxf(ls, 1e-30f);
    for (int c = lane; c < D / 4; c += 32) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int i0 = 0; i0 < nk; i0 += kTailLoads) {
        float4 x[kTailLoads];
#pragma unroll
        for (int u = 0; u < kTailLoads; ++u) {
          const int i = i0 + u;
          if (i < nk) {
            const int e = s_e[i];
            x[u] = e < N1 ? __ldg(reinterpret_cast<const float4*>(a.o1 + (r * N1 + e) * D) + c)
                          : __ldcg(reinterpret_cast<const float4*>(a.o + (r * N2 + (e - N1)) * D) + c);
          }
        }
#pragma unroll
        for (int u = 0; u < kTailLoads; ++u) {
          if (i0 + u >= nk) break;
          const float w = s_w[i0 + u];
          float4 y = x[u];
          y.x = y.x != y.x ? 0.f : y.x; y.y = y.y != y.y ? 0.f : y.y;
          y.z = y.z != y.z ? 0.f : y.z; y.w = y.w != y.w ? 0.f : y.w;
          acc.x = fmaf(w, y.x, acc.x); acc.y = fmaf(w, y.y, acc.y);
          acc.z = fmaf(w, y.z, acc.z); acc.w = fmaf(w, y.w, acc.w);
        }
      }
      acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
      store4_any(a.out_o, r * D + 4 * c, a.out_dtype, acc);
    }
    if (lane == 0 && a.out_lse) a.out_lse[r] = m_safe + logf(ls);
    __syncwarp();  // s_w / s_e are refilled for the next head of this warp
  }
}

// ============================================================================ sparse attention
// One CTA per (listed block n, KV head hk, request b): the whole GQA group of hk is computed from
// one load of each K/V row. A token is handled by L = D/8 lanes holding 8 dims each (16-byte
// loads of bf16/fp16); a CTA pass covers 128/L tokens and UNROLL passes are loaded before use so
// that many loads are in flight. Each token group keeps an online softmax in the log2 domain;
// groups are combined through shared memory at the end.
// Occupancy decides the speed here (the loop is latency-bound): this variant keeps 128 registers
// for groups <= 4 (4 CTAs/SM). Variants that packed several small pages per CTA, loaded 8 tokens
// per pass, or staged K/V in shared memory with cp.async all measured slower on H200 (they cost
// registers or shared memory and so CTAs per SM): see benchmarks/NOTES-kernels.md.
template <typename T, int D, int GMAX, int UNROLL>
__global__ void __launch_bounds__(kAttnThreads)
sparse_attn_kernel(AttnArgs a) {
  constexpr int L = D / 8;                // lanes per token
  constexpr int NG = kAttnThreads / L;    // token groups per CTA (= tokens per pass)
  __shared__ float s_acc[NG][GMAX][D];
  __shared__ float s_m[NG][GMAX];
  __shared__ float s_l[NG][GMAX];
  extern __shared__ __align__(16) unsigned char s_tail[];  // fused merge only

  const int n = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int G = a.Hq / a.Hk;
  const int tid = threadIdx.x;
  const int64_t row0 = (int64_t)b * a.Hq + (int64_t)hk * G;  // first query head of the group
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, b) * a.Hk + hk;
  const int c = a.cnt[lrow];
  // Fused merge: only the listed entries take part (entry 0 alone for an empty list, so the
  // first source is still merged); the CTAs of padding entries exit at once, with no fence.
  const int parts = max(min(c, a.N), 1);
  if (a.sem && n >= parts) return;
  const int blk = a.idx[lrow * a.N + n];
  const bool repeat = repeats_earlier(a.idx + lrow * a.N, n, c, blk);
  int ntok = 0;
  int64_t page = 0;
  if (n < c && !repeat && blk >= 0 && blk < a.NB) {  // ids outside the table are padding
    page = ld_index(a.table, (int64_t)b * a.table_stride + blk, a.table64);
    const int64_t sl = ld_index(a.seq_lens, b, a.seq64);
    const int64_t rem = sl - (int64_t)blk * a.page_size;
    ntok = (int)(rem < 0 ? 0 : (rem > a.page_size ? a.page_size : rem));
  }
  if (ntok == 0) {  // padding entry or block past the request: the empty state (0, -inf)
    for (int e = tid; e < G * D; e += kAttnThreads) {
      const int g = e / D, d = e % D;
      a.o[((row0 + g) * a.N + n) * D + d] = 0.f;
    }
    if (tid < G) a.lse[(row0 + tid) * a.N + n] = -INFINITY;
    if (a.sem) attn_merge_tail(a, b, hk, s_tail, parts);
    return;
  }

  const int grp = tid / L, lane_t = tid % L, d0 = lane_t * 8;
  // q of the group, pre-scaled into the log2 domain.
  float qf[GMAX][8];
  const float qs = a.sm_scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
      load8_any(a.q, b * a.q_stride + ((int64_t)hk * G + g) * D + d0, a.q_dtype, qf[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[g][i] *= qs;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[g][i] = 0.f;
    }
  }
  float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY; l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }
  const T* kb = reinterpret_cast<const T*>(a.k) + hk * a.k_stride_head + d0;
  const T* vb = reinterpret_cast<const T*>(a.v) + hk * a.v_stride_head + d0;
  const int64_t slot0 = page * a.page_size;

  for (int t0 = 0; t0 < ntok; t0 += NG * UNROLL) {
    Raw8<T> kr[UNROLL], vr[UNROLL];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * NG + grp;
      ok[u] = t < ntok;
      if (ok[u]) {
        kr[u] = ld_raw8<T>(kb + (slot0 + t) * a.k_stride_slot);
        vr[u] = ld_raw8<T>(vb + (slot0 + t) * a.v_stride_slot);
      } else {
        kr[u] = zero_raw8<T>(); vr[u] = zero_raw8<T>();
      }
    }
    float s[UNROLL][GMAX];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[8];
      cvt8(kr[u], kf);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) x = fmaf(qf[g][i], kf[i], x);
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        s[u][g] = ok[u] ? x : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= G) continue;
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) mn = fmaxf(mn, s[u][g]);
      if (mn == -INFINITY) continue;  // nothing valid yet for this group
      const float scale = exp2f(m[g] - mn);  // m = -inf -> 0
      l[g] *= scale;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= scale;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const float p = exp2f(s[u][g] - mn);  // -inf -> 0
        l[g] += p;
        float vf[8];
        cvt8(vr[u], vf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
      m[g] = mn;
    }
  }
  // Combine the token groups.
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
#pragma unroll
      for (int i = 0; i < 8; ++i) s_acc[grp][g][d0 + i] = acc[g][i];
      if (lane_t == 0) { s_m[grp][g] = m[g]; s_l[grp][g] = l[g]; }
    }
  }
  __syncthreads();
  for (int e = tid; e < G * D; e += kAttnThreads) {
    const int g = e / D, d = e % D;
    float M = -INFINITY;
#pragma unroll 4
    for (int r = 0; r < NG; ++r) M = fmaxf(M, s_m[r][g]);
    float lsum = 0.f, o = 0.f;
    if (M != -INFINITY) {
#pragma unroll 4
      for (int r = 0; r < NG; ++r) {
        const float w = exp2f(s_m[r][g] - M);
        lsum = fmaf(s_l[r][g], w, lsum);
        o = fmaf(s_acc[r][g][d], w, o);
      }
    }
    const bool any = lsum > 0.f;
    a.o[((row0 + g) * a.N + n) * D + d] = any ? o / lsum : 0.f;
    if (d == 0) a.lse[(row0 + g) * a.N + n] = any ? (M + log2f(lsum)) * kLn2 : -INFINITY;
  }
  if (a.sem) attn_merge_tail(a, b, hk, s_tail, parts);
}

// ---------------------------------------------------------------------------- head-split variant
// Same contract, other mapping (16-bit KV, head dims 64/128, groups 1/2/4/8): every thread owns
// one query head and 8 dims (few registers, so many CTAs per SM), and the K/V rows of a chunk are
// copied into shared memory with cp.async by all threads at once (one round trip per chunk; two
// stages when a page is longer than a chunk), where the G head-threads of a row read them.
constexpr int kHdChunkBytes = 32 * 1024;  // K + V bytes of one stage
constexpr int kHdMaxPage = 32;            // largest page size dispatched to it by default

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(kAttnThreads)
sparse_attn_hd_kernel(AttnArgs a) {
  constexpr int L = D / 8;                       // lanes per (token, head)
  constexpr int TG = kAttnThreads / (L * G);     // token groups
  constexpr int ROW16 = D * (int)sizeof(T) / 16;  // 16-byte pieces per row
  constexpr int CT = kHdChunkBytes / (2 * D * (int)sizeof(T));  // tokens per chunk
  constexpr int U = 4;
  extern __shared__ __align__(16) unsigned char s_raw[];
  __shared__ float s_m[TG][G];
  __shared__ float s_l[TG][G];
  const int n = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const int64_t row0 = (int64_t)b * a.Hq + (int64_t)hk * G;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, b) * a.Hk + hk;
  const int c = a.cnt[lrow];
  // Fused merge: only the listed entries take part (entry 0 alone for an empty list, so the
  // first source is still merged); the CTAs of padding entries exit at once, with no fence.
  const int parts = max(min(c, a.N), 1);
  if (a.sem && n >= parts) return;
  const int blk = a.idx[lrow * a.N + n];
  const bool repeat = repeats_earlier(a.idx + lrow * a.N, n, c, blk);
  int ntok = 0;
  int64_t page = 0;
  if (n < c && !repeat && blk >= 0 && blk < a.NB) {  // ids outside the table are padding
    page = ld_index(a.table, (int64_t)b * a.table_stride + blk, a.table64);
    const int64_t sl = ld_index(a.seq_lens, b, a.seq64);
    const int64_t rem = sl - (int64_t)blk * a.page_size;
    ntok = (int)(rem < 0 ? 0 : (rem > a.page_size ? a.page_size : rem));
  }
  if (ntok == 0) {  // padding entry or block past the request: (0, -inf)
    for (int e = tid; e < G * D; e += kAttnThreads) a.o[((row0 + e / D) * a.N + n) * D + e % D] = 0.f;
    if (tid < G) a.lse[(row0 + tid) * a.N + n] = -INFINITY;
    if (a.sem) attn_merge_tail(a, b, hk, s_raw, parts);
    return;
  }
  const int CTe = a.page_size < CT ? a.page_size : CT;
  T* const sbase = reinterpret_cast<T*>(s_raw);
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * a.k_stride_head;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * a.v_stride_head;
  const int64_t slot0 = page * a.page_size;
  auto issue = [&](int ch, int st) {
    const int t0 = ch * CTe;
    const int nt = min(CTe, ntok - t0);
    const int pieces = nt * 2 * ROW16;
    for (int p = tid; p < pieces; p += kAttnThreads) {
      const int c16 = p % ROW16, r = p / ROW16;
      const int kv = r >= nt ? 1 : 0;
      const int t = r - kv * nt;
      const int64_t slot = slot0 + t0 + t;
      const T* src = kv ? vg + slot * a.v_stride_slot : kg + slot * a.k_stride_slot;
      T* dst = sbase + (2 * st + kv) * CT * D + t * D;
      cp_async16(dst + c16 * (16 / (int)sizeof(T)), src + c16 * (16 / (int)sizeof(T)));
    }
    cp_async_commit();
  };
  const int nch = (ntok + CTe - 1) / CTe;
  issue(0, 0);

  const int lane = tid % L, h = (tid / L) % G, tg = tid / (L * G);
  const int d0 = lane * 8;
  float qf[8];
  load8_any(a.q, b * a.q_stride + ((int64_t)hk * G + h) * D + d0, a.q_dtype, qf);
  const float qs = a.sm_scale * kLog2e;
#pragma unroll
  for (int i = 0; i < 8; ++i) qf[i] *= qs;
  float m = -INFINITY, l = 0.f, acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;

  for (int ch = 0; ch < nch; ++ch) {
    const int st = ch & 1;
    if (ch + 1 < nch) { issue(ch + 1, st ^ 1); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();
    const int nt = min(CTe, ntok - ch * CTe);
    const T* K = sbase + (2 * st) * CT * D + d0;
    const T* V = K + CT * D;
    for (int j = 0; j * TG < nt; j += U) {
      float sc[U];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = tg + (j + u) * TG;
        ok[u] = t < nt;
        float kf[8];
        if (ok[u]) {
          Raw8<T> r;
          r.r[0] = *reinterpret_cast<const uint4*>(K + t * D);
          cvt8(r, kf);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) kf[i] = 0.f;
        }
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) x = fmaf(qf[i], kf[i], x);
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        sc[u] = ok[u] ? x : -INFINITY;
      }
      float mn = m;
#pragma unroll
      for (int u = 0; u < U; ++u) mn = fmaxf(mn, sc[u]);
      if (mn != -INFINITY) {
        const float scale = exp2f(m - mn);
        l *= scale;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] *= scale;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (!ok[u]) continue;
          const int t = tg + (j + u) * TG;
          const float pr = exp2f(sc[u] - mn);
          l += pr;
          Raw8<T> r;
          r.r[0] = *reinterpret_cast<const uint4*>(V + t * D);
          float vf[8];
          cvt8(r, vf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = fmaf(pr, vf[i], acc[i]);
        }
        m = mn;
      }
    }
    __syncthreads();  // this stage is refilled two chunks later
  }
  float* s_acc = reinterpret_cast<float*>(s_raw);  // [TG][G][D], aliases the K/V stage
#pragma unroll
  for (int i = 0; i < 8; ++i) s_acc[(tg * G + h) * D + d0 + i] = acc[i];
  if (lane == 0) { s_m[tg][h] = m; s_l[tg][h] = l; }
  __syncthreads();
  for (int x = tid; x < G * D; x += kAttnThreads) {
    const int g = x / D, d = x % D;
    float M = -INFINITY;
#pragma unroll
    for (int r = 0; r < TG; ++r) M = fmaxf(M, s_m[r][g]);
    float lsum = 0.f, o = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int r = 0; r < TG; ++r) {
        const float w = exp2f(s_m[r][g] - M);
        lsum = fmaf(s_l[r][g], w, lsum);
        o = fmaf(s_acc[(r * G + g) * D + d], w, o);
      }
    }
    const bool any = lsum > 0.f;
    a.o[((row0 + g) * a.N + n) * D + d] = any ? o / lsum : 0.f;
    if (d == 0) a.lse[(row0 + g) * a.N + n] = any ? (M + log2f(lsum)) * kLn2 : -INFINITY;
  }
  if (a.sem) attn_merge_tail(a, b, hk, s_raw, parts);  // its first barrier orders s_acc reads
}

template <typename T, int D, int G>
cudaError_t attn_hd_launch(const AttnArgs& a, cudaStream_t s) {
  constexpr int CT = kHdChunkBytes / (2 * D * (int)sizeof(T));
  size_t smem = a.page_size > CT ? 2 * kHdChunkBytes : kHdChunkBytes;
  if (a.sem) smem = std::max(smem, attn_merge_smem(a.N, a.N1, a.Na));
  cudaError_t e = set_smem_limit(sparse_attn_hd_kernel<T, D, G>, smem);
  if (e != cudaSuccess) return e;
  sparse_attn_hd_kernel<T, D, G><<<dim3(a.N, a.Hk, a.B), kAttnThreads, smem, s>>>(a);
  return cudaGetLastError();
}

// SGLANG_PRR_ATTN_VARIANT=regs|hd overrides the choice (a tuning knob; read once per process).
inline int attn_variant_env() {
  static int v = [] {
    const char* e = getenv("SGLANG_PRR_ATTN_VARIANT");
    if (!e) return 0;
    if (!strcmp(e, "regs")) return 1;
    if (!strcmp(e, "hd")) return 2;
    return 0;
  }();
  return v;
}

template <typename T, int D>
cudaError_t attn_dispatch_g(const AttnArgs& a, cudaStream_t s) {
  const int G = a.Hq / a.Hk;
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128)) {
    // Measured on H200 (NOTES-kernels.md): the head-split variant wins on small pages (16-32
    // tokens: 1.4-1.7x), the register variant on pages >= 64 (the head-split one then streams
    // two-stage chunks per CTA and loses up to 1.7x).
    const int var = attn_variant_env();
    const bool hd = (G == 1 || G == 2 || G == 4 || G == 8) &&
                    (var == 2 || (var == 0 && a.page_size <= kHdMaxPage));
    if (hd) {
      switch (G) {
        case 1: return attn_hd_launch<T, D, 1>(a, s);
        case 2: return attn_hd_launch<T, D, 2>(a, s);
        case 4: return attn_hd_launch<T, D, 4>(a, s);
        default: return attn_hd_launch<T, D, 8>(a, s);
      }
    }
  }
  dim3 grid(a.N, a.Hk, a.B);
  // fp32 KV needs twice the registers per loaded row: fewer passes in flight.
  constexpr int U = sizeof(T) == 4 ? 2 : 4;
  const size_t smem = a.sem ? attn_merge_smem(a.N, a.N1, a.Na) : 0;
  if (G <= 4) {
    if (smem > 0) {
      cudaError_t e = set_smem_limit(sparse_attn_kernel<T, D, 4, U>, smem);
      if (e != cudaSuccess) return e;
    }
    sparse_attn_kernel<T, D, 4, U><<<grid, kAttnThreads, smem, s>>>(a);
  } else {
    if (smem > 0) {
      cudaError_t e = set_smem_limit(sparse_attn_kernel<T, D, 8, U>, smem);
      if (e != cudaSuccess) return e;
    }
    sparse_attn_kernel<T, D, 8, U><<<grid, kAttnThreads, smem, s>>>(a);
  }
  return cudaGetLastError();
}
template <typename T>
cudaError_t attn_dispatch_d(const AttnArgs& a, cudaStream_t s) {
  switch (a.D) {
    case 64: return attn_dispatch_g<T, 64>(a, s);
    case 128: return attn_dispatch_g<T, 128>(a, s);
    case 256: return attn_dispatch_g<T, 256>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

size_t attn_merge_smem(int N, int N1, int Na) {
  return (size_t)((Na + 3) / 4 * 4) * sizeof(int) +
         (size_t)(kAttnThreads / 32) * (N + N1) * (sizeof(float) + sizeof(int));
}

cudaError_t launch_sparse_attn_partials(const AttnArgs& a, cudaStream_t s) {
  if (a.Hq % a.Hk != 0 || a.Hq / a.Hk > kMaxGroup) return cudaErrorInvalidValue;
  if (a.B == 0 || a.N == 0 || a.Hk == 0) return cudaSuccess;
  switch (a.kv_dtype) {
    case kF32: return attn_dispatch_d<float>(a, s);
    case kF16: return attn_dispatch_d<__half>(a, s);
    case kBF16: return attn_dispatch_d<__nv_bfloat16>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace prr
