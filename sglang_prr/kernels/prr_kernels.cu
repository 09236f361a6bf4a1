// PRR decode kernels for SM90 (H100/H200): sparse attention partials over listed KV pages,
// Quest scores, top-K selection / prediction, set difference, Holt update, exact merge and the
// Quest summary update. Plain CUDA: these kernels are memory- and latency-bound, so they are
// written around wide loads and many independent requests in flight rather than tensor cores.
// Every kernel is graph-safe: static launch shapes, device-side counts, no host reads.
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

// Raw 8-element vector of KV type T, loaded with one (16-bit types) or two (fp32) 16-byte loads
// so that several tokens' loads can be issued before any is used.
template <typename T> struct Raw8 { uint4 r[sizeof(T) / 2]; };

template <typename T>
__device__ __forceinline__ Raw8<T> ld_raw8(const T* p) {
  Raw8<T> x;
  const uint4* u = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) x.r[i] = __ldg(u + i);
  return x;
}
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

// "Last CTA of a group finishes" (split reductions without a second launch): every CTA calls it
// once after writing its results; it returns true in exactly one CTA of the group, after all the
// others' writes are visible to it (read them with __ldcg: L1 is not coherent). The counter is
// reset by that CTA, so the next launch or graph replay starts from zero. Contains __syncthreads.
__device__ __forceinline__ bool last_of_group(int* counter, int group_size) {
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counter, 1);
    s_last = prev == group_size - 1;
    if (s_last) atomicExch(counter, 0);
  }
  __syncthreads();
  if (s_last) __threadfence();
  return s_last;
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

// ============================================================================ Quest scores
// One warp per (request, block): it reads the block's min/max rows of every KV head (float4 per
// lane) and sums max(q*kmax, q*kmin) over dims and the GQA group. q of the request is staged in
// shared memory once per CTA.
constexpr int kQuestWarps = 8;

__global__ void __launch_bounds__(kQuestWarps * 32)
quest_scores_kernel(QuestArgs a) {
  extern __shared__ float s_q[];  // [Hq, D]
  const int b = blockIdx.y;
  const int HqD = a.Hq * a.D;
  for (int e = threadIdx.x * 8; e < HqD; e += blockDim.x * 8) {
    float f[8];
    load8_any(a.q, (int64_t)b * HqD + e, a.q_dtype, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) s_q[e + i] = f[i];
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = blockIdx.x * kQuestWarps + warp;
  if (n >= a.NB) return;
  const int64_t nb_b = ld_index(a.nblk, b, a.nblk64);
  float* out = a.out + (int64_t)b * a.Hk * a.NB + n;
  if (n >= nb_b) {
    for (int h = lane; h < a.Hk; h += 32) out[(int64_t)h * a.NB] = -INFINITY;
    return;
  }
  const int64_t page = ld_index(a.table, (int64_t)b * a.table_stride + n, a.table64);
  const int G = a.Hq / a.Hk, D4 = a.D / 4;
  const float4* lo = reinterpret_cast<const float4*>(a.kmin + page * a.Hk * a.D);
  const float4* hi = reinterpret_cast<const float4*>(a.kmax + page * a.Hk * a.D);
  constexpr int HU = 4;  // KV heads loaded together
  for (int h0 = 0; h0 < a.Hk; h0 += HU) {
    float part[HU];
#pragma unroll
    for (int j = 0; j < HU; ++j) part[j] = 0.f;
    for (int c = lane; c < D4; c += 32) {
      float4 vl[HU], vh[HU];
#pragma unroll
      for (int j = 0; j < HU; ++j) {
        if (h0 + j < a.Hk) { vl[j] = __ldg(lo + (h0 + j) * D4 + c); vh[j] = __ldg(hi + (h0 + j) * D4 + c); }
      }
#pragma unroll
      for (int j = 0; j < HU; ++j) {
        if (h0 + j >= a.Hk) continue;
        for (int g = 0; g < G; ++g) {
          const float4 q = reinterpret_cast<const float4*>(s_q + ((h0 + j) * G + g) * a.D)[c];
          part[j] += fmaxf(q.x * vh[j].x, q.x * vl[j].x) + fmaxf(q.y * vh[j].y, q.y * vl[j].y) +
                     fmaxf(q.z * vh[j].z, q.z * vl[j].z) + fmaxf(q.w * vh[j].w, q.w * vl[j].w);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < HU; ++j) {
      float x = part[j];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
      if (lane == 0 && h0 + j < a.Hk) out[(int64_t)(h0 + j) * a.NB] = x;
    }
  }
}

// ============================================================================ top-K selection
// The top-K helpers (order keys, topk_mask, write_list) are in topk.cuh.

__global__ void __launch_bounds__(kTopkThreads)
select_topk_kernel(TopkArgs a) {
  extern __shared__ uint32_t s_key[];  // [NB]
  const int hk = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x;
  const int NB = a.NB;
  const int64_t row = (int64_t)b * a.Hk + hk;
  int64_t nb64 = ld_index(a.nblk, b, a.nblk64);
  const int nb = (int)(nb64 < NB ? (nb64 < 0 ? 0 : nb64) : NB);
  const int keep_lo = a.sink, keep_hi = nb - a.local;  // kept: id < keep_lo or id >= keep_hi
  int ninit = 0;
  float gam = 0.f;
  if (a.trend) {
    const int64_t x = ld_index(a.n_init, b, a.ninit64);
    ninit = (int)(x < NB ? x : NB);
    gam = a.gamma[b * a.gamma_stride];
  }
  const float* src = a.scores + row * NB;
  const float* trd = a.trend ? a.trend + row * NB : nullptr;
  for (int i = tid; i < NB; i += kTopkThreads) {
    uint32_t key = 0;
    if (is_middle(i, nb, keep_lo, keep_hi)) {
      float sc;
      // Unfused multiply-add, as the reference rounds it (ties decide the selection).
      if (trd) sc = i < ninit ? __fadd_rn(src[i], __fmul_rn(gam, trd[i])) : -INFINITY;
      else sc = src[i];
      key = order_key(sc);
    }
    s_key[i] = key;
  }
  const int kk = (a.dense_row && a.dense_row[b]) ? NB : a.k;
  topk_mask<kTopkThreads>(s_key, NB, nb, kk, keep_lo, keep_hi);
  write_list<kTopkThreads>(s_key, NB, 1u, a.idx + row * a.n_out, a.n_out, a.cnt + row);
}

// ============================================================================ fused selection
// Quest scores + top-K (A) + M = A \ P in one launch. Grid (Hk, chunks of kSelChunk blocks, B):
// every CTA scores its chunk of blocks for one KV head, a warp per block and kSelPerWarp blocks
// per warp loaded together (the heads of a chunk are neighbours in launch order, so the pieces of
// each page's [Hk, D] summary rows are read close in time). The last CTA of the row (b, hk) then
// reads the row's scores back from L2 and runs the top-K and both list writes, so selection costs
// one launch and one pass over the summaries.
constexpr int kSelThreads = 512;
constexpr int kSelWarps = kSelThreads / 32;
constexpr int kSelPerWarp = 4;
constexpr int kSelChunk = kSelWarps * kSelPerWarp;

__global__ void __launch_bounds__(kSelThreads)
quest_select_kernel(SelectArgs a) {
  extern __shared__ __align__(16) uint32_t s_sel[];  // q group [G, D] floats, then keys [NB]
  const int hk = blockIdx.x, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int G = a.Hq / a.Hk, D4 = a.D / 4;
  const int NB = a.NB;
  const int64_t row = (int64_t)b * a.Hk + hk;
  const int64_t nb64 = ld_index(a.nblk, b, a.nblk64);
  const int nb = (int)(nb64 < NB ? (nb64 < 0 ? 0 : nb64) : NB);
  // Only the chunks holding the row's blocks take part (the table is as wide as the longest
  // context the server accepts, most rows are shorter); the others exit at once, with no fence.
  const int nch = max((nb + kSelChunk - 1) / kSelChunk, 1);
  if ((int)blockIdx.y >= nch) return;
  float* s_q = reinterpret_cast<float*>(s_sel);
  for (int e = tid * 8; e < G * a.D; e += kSelThreads * 8) {
    float f[8];
    load8_any(a.q, b * a.q_stride + (int64_t)hk * G * a.D + e, a.q_dtype, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) s_q[e + i] = f[i];
  }
  __syncthreads();
  const int base = blockIdx.y * kSelChunk + warp;
  int64_t page[kSelPerWarp];
  bool valid[kSelPerWarp];
#pragma unroll
  for (int j = 0; j < kSelPerWarp; ++j) {
    const int n = base + j * kSelWarps;
    valid[j] = n < nb;
    page[j] = valid[j] ? ld_index(a.table, (int64_t)b * a.table_stride + n, a.table64) : 0;
  }
  float acc[kSelPerWarp];
#pragma unroll
  for (int j = 0; j < kSelPerWarp; ++j) acc[j] = 0.f;
  for (int c = lane; c < D4; c += 32) {
    float4 lo[kSelPerWarp], hi[kSelPerWarp];
#pragma unroll
    for (int j = 0; j < kSelPerWarp; ++j) {
      if (valid[j]) {
        const int64_t off = (page[j] * a.Hk + hk) * D4 + c;
        lo[j] = __ldg(reinterpret_cast<const float4*>(a.kmin) + off);
        hi[j] = __ldg(reinterpret_cast<const float4*>(a.kmax) + off);
      }
    }
    for (int g = 0; g < G; ++g) {
      const float4 q = reinterpret_cast<const float4*>(s_q + g * a.D)[c];
#pragma unroll
      for (int j = 0; j < kSelPerWarp; ++j) {
        if (!valid[j]) continue;
        acc[j] += fmaxf(q.x * hi[j].x, q.x * lo[j].x) + fmaxf(q.y * hi[j].y, q.y * lo[j].y) +
                  fmaxf(q.z * hi[j].z, q.z * lo[j].z) + fmaxf(q.w * hi[j].w, q.w * lo[j].w);
      }
    }
  }
  float* srow = a.scores + row * NB;
#pragma unroll
  for (int j = 0; j < kSelPerWarp; ++j) {
    float x = acc[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    const int n = base + j * kSelWarps;
    if (lane == 0 && n < NB) srow[n] = valid[j] ? x : -INFINITY;
  }
  if (!last_of_group(a.sem + row, nch)) return;

  for (int i = nch * kSelChunk + tid; i < NB; i += kSelThreads) srow[i] = -INFINITY;
  uint32_t* s_key = s_sel;  // the q group is no longer needed; only blocks < nb can be chosen
  const int keep_lo = a.sink, keep_hi = nb - a.local;
  for (int i = tid; i < nb; i += kSelThreads)
    s_key[i] = is_middle(i, nb, keep_lo, keep_hi) ? order_key(__ldcg(srow + i)) : 0u;
  const bool dense = a.dense_row && a.dense_row[b];
  topk_mask<kSelThreads>(s_key, nb, nb, dense ? NB : a.k, keep_lo, keep_hi);
  // Mark the selected blocks that P holds (bit 1): M = selected without that bit.
  int pc = 0;
  if (a.p_idx) {
    const int64_t prow = slot_of(a.p_rows, a.p_rows64, b) * a.Hk + hk;
    pc = min(max(a.p_cnt[prow], 0), a.Np);
    for (int i = tid; i < pc; i += kSelThreads) {
      const int x = a.p_idx[prow * a.Np + i];
      if (x >= 0 && x < nb && s_key[x]) s_key[x] = 3u;
    }
    __syncthreads();
  }
  write_list<kSelThreads>(s_key, nb, 1u, a.a_idx + row * a.n_out, a.n_out, a.a_cnt + row);
  // M: selected (bit 0) and not in P (bit 1 clear).
  for (int i = tid; i < nb; i += kSelThreads) s_key[i] = s_key[i] == 1u ? 1u : 0u;
  __syncthreads();
  write_list<kSelThreads>(s_key, nb, 1u, a.m_idx + row * a.n_out, a.n_out, a.m_cnt + row);
  // write_list's last barrier makes both counts visible to thread 0, which wrote them.
  if (a.stats && !dense && tid == 0) {
    atomicAdd(a.stats + 0, (unsigned long long)a.a_cnt[row]);
    atomicAdd(a.stats + 1, (unsigned long long)a.m_cnt[row]);
    atomicAdd(a.stats + 2, (unsigned long long)pc);
    atomicAdd(a.stats + 3, 1ull);
  }
}

// ============================================================================ fused predictor
// Holt update (eq 3) + next-step prediction (eq 2) + top-K of P(t+1) in one launch, one CTA per
// row (b, hk). n_init[b] is read by all Hk rows of the request and raised by the last of them.
__global__ void __launch_bounds__(kTopkThreads)
predict_update_kernel(PredictArgs a) {
  extern __shared__ uint32_t s_key[];  // [NB]
  const int hk = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x;
  const int NB = a.NB;
  const int64_t srow = slot_of(a.rows, a.rows64, b);  // the request's state row
  const int64_t row = srow * a.Hk + hk;
  const int64_t brow = (int64_t)b * a.Hk + hk;        // this step's scores
  const int64_t nb64 = ld_index(a.nblk, b, a.nblk64);
  const int nb = (int)(nb64 < NB ? (nb64 < 0 ? 0 : nb64) : NB);
  const int64_t nn64 = ld_index(a.nblk_next, b, a.nblk_next64);
  const int nbn = (int)(nn64 < NB ? (nn64 < 0 ? 0 : nn64) : NB);
  const int64_t ni64 = ld_index(a.n_init, srow, a.ninit64);
  const int ninit = (int)(ni64 < NB ? ni64 : NB);
  const int ninit_new = max(ninit, nb);
  const float al = a.theta[srow * a.theta_stride], be = a.theta[srow * a.theta_stride + 1];
  const float gam = a.theta[srow * a.theta_stride + 2];
  float* lv = a.level + row * NB;
  float* tr = a.trend + row * NB;
  const float* sc = a.scores + brow * NB;
  const int keep_lo = a.sink, keep_hi = nbn - a.local;
  // Blocks past both counts are neither updated nor predictable: the loops stop before them.
  const int L = max(nb, nbn);
  for (int i = tid; i < L; i += kTopkThreads) {
    float l = 0.f, v = 0.f;
    if (i < nb) {  // eq 3, rounded op by op like the reference
      const float s = sc[i];
      const float l0 = lv[i];
      // A level that is not finite (InfLLM-v2 scores -inf before a complete compressed key)
      // restarts like a new block, as in the reference.
      if (i < ninit && isfinite(l0)) {
        v = __fadd_rn(__fmul_rn(be, __fsub_rn(s, l0)), __fmul_rn(__fsub_rn(1.f, be), tr[i]));
        l = __fadd_rn(__fmul_rn(al, s), __fmul_rn(__fsub_rn(1.f, al), l0));
      } else {
        l = s;
      }
      lv[i] = l;
      tr[i] = v;
    } else if (i < ninit_new) {
      l = lv[i];
      v = tr[i];
    }
    uint32_t key = 0;
    if (is_middle(i, nbn, keep_lo, keep_hi))
      key = order_key(i < ninit_new ? __fadd_rn(l, __fmul_rn(gam, v)) : -INFINITY);
    s_key[i] = key;
  }
  topk_mask<kTopkThreads>(s_key, L, nbn, a.k, keep_lo, keep_hi);
  write_list<kTopkThreads>(s_key, L, 1u, a.idx + row * a.n_out, a.n_out, a.cnt + row);
  if (last_of_group(a.sem + b, gridDim.x) && tid == 0) {
    if (a.ninit64) reinterpret_cast<long long*>(a.n_init)[srow] = ninit_new;
    else reinterpret_cast<int*>(a.n_init)[srow] = ninit_new;
  }
}

// ============================================================================ set difference
// One CTA per row: bitmask A \ P in shared memory (robust to any list order), then an ascending
// compaction by a block scan over the mask words.
constexpr int kSetThreads = 256;

__global__ void __launch_bounds__(kSetThreads)
set_difference_kernel(SetDiffArgs a) {
  extern __shared__ uint32_t s_bits[];
  using Scan = cub::BlockScan<int, kSetThreads>;
  __shared__ typename Scan::TempStorage s_scan;
  __shared__ int s_total;
  const int row = blockIdx.x, tid = threadIdx.x;
  const int W = (a.nb + 31) / 32;
  for (int w = tid; w < W; w += kSetThreads) s_bits[w] = 0;
  __syncthreads();
  const int ca = a.a_cnt[row], cp = a.p_cnt[row];
  for (int i = tid; i < a.Na && i < ca; i += kSetThreads) {
    const int x = a.a_idx[(int64_t)row * a.Na + i];
    if (x >= 0 && x < a.nb) atomicOr(&s_bits[x >> 5], 1u << (x & 31));
  }
  __syncthreads();
  for (int i = tid; i < a.Np && i < cp; i += kSetThreads) {
    const int x = a.p_idx[(int64_t)row * a.Np + i];
    if (x >= 0 && x < a.nb) atomicAnd(&s_bits[x >> 5], ~(1u << (x & 31)));
  }
  __syncthreads();
  const int C = (W + kSetThreads - 1) / kSetThreads;
  const int w0 = tid * C, w1 = min(W, w0 + C);
  int c = 0;
  for (int w = w0; w < w1; ++w) c += __popc(s_bits[w]);
  int pos;
  Scan(s_scan).ExclusiveSum(c, pos);
  if (tid == kSetThreads - 1) s_total = pos + c;
  __syncthreads();
  int32_t* out = a.m_idx + (int64_t)row * a.n_out;
  for (int w = w0; w < w1 && pos < a.n_out; ++w) {
    uint32_t bits = s_bits[w];
    while (bits && pos < a.n_out) {
      const int j = __ffs(bits) - 1;
      bits &= bits - 1;
      out[pos++] = w * 32 + j;
    }
  }
  const int total = s_total;
  for (int j = total + tid; j < a.n_out; j += kSetThreads) out[j] = -1;
  if (tid == 0) a.m_cnt[row] = total < a.n_out ? total : a.n_out;
}

// ============================================================================ Holt update
__global__ void holt_update_kernel(HoltArgs a) {
  const int64_t total = (int64_t)a.B * a.Hk * a.NB;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int i = (int)(e % a.NB);
    const int b = (int)(e / ((int64_t)a.Hk * a.NB));
    const int64_t nb = ld_index(a.nblk, b, a.nblk64);
    if (i >= nb) continue;
    const int64_t ni = ld_index(a.n_init, b, a.ninit64);
    const float s = a.scores[e];
    const float lv = a.level[e];
    if (i < ni && isfinite(lv)) {  // a non-finite level restarts like a new block
      const float al = a.alpha[b * a.alpha_stride], be = a.beta[b * a.beta_stride];
      // Rounded op by op like the reference (no fused multiply-add): the state feeds top-K ties.
      a.trend[e] = __fadd_rn(__fmul_rn(be, __fsub_rn(s, lv)), __fmul_rn(__fsub_rn(1.f, be), a.trend[e]));
      a.level[e] = __fadd_rn(__fmul_rn(al, s), __fmul_rn(__fsub_rn(1.f, al), lv));
    } else {
      a.trend[e] = 0.f;
      a.level[e] = s;
    }
  }
}
// A separate launch: the element kernel must see the old n_init everywhere.
__global__ void holt_ninit_kernel(HoltArgs a) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= a.B) return;
  const int64_t nb = ld_index(a.nblk, b, a.nblk64);
  if (a.ninit64) {
    long long* p = reinterpret_cast<long long*>(a.n_init) + b;
    if (nb > *p) *p = nb;
  } else {
    int* p = reinterpret_cast<int*>(a.n_init) + b;
    if (nb > *p) *p = (int)nb;
  }
}

// ============================================================================ merge
// One CTA per output row (request, query head): weights exp(lse - max) of the kept entries in
// shared memory, then float4 columns x entry slices accumulated and reduced across slices.
// Entries of weight 0 (dropped by the exact filter, padding) are never read.
constexpr int kMergeThreads = 128;

__global__ void __launch_bounds__(kMergeThreads)
merge_kernel(MergeArgs a) {
  extern __shared__ float s_dyn[];
  const int Nt = a.N1 + a.N2;
  const int nt4 = (Nt + 3) / 4 * 4;   // keeps s_part 16-byte aligned
  float* s_w = s_dyn;                  // [Nt]
  float* s_part = s_dyn + nt4;         // [kMergeThreads * 4]
  uint32_t* s_amask = reinterpret_cast<uint32_t*>(s_part + kMergeThreads * 4);  // [nb/32 + 1]
  __shared__ float s_red[32];
  const int r = blockIdx.x, tid = threadIdx.x;
  int pc = 0;
  const int32_t* prow = nullptr;
  if (a.p_idx) {
    const int b = r / a.Hq, hk = (r % a.Hq) / (a.Hq / a.Hk);
    if (a.exact) {
      const int W = a.nb / 32 + 1;
      for (int w = tid; w < W; w += kMergeThreads) s_amask[w] = 0;
      __syncthreads();
      const int ca = a.a_cnt[b * a.Hk + hk];
      const int32_t* arow = a.a_idx + ((int64_t)b * a.Hk + hk) * a.Na;
      for (int i = tid; i < a.Na && i < ca; i += kMergeThreads) {
        const int x = arow[i];
        if (x >= 0 && x <= a.nb) atomicOr(&s_amask[x >> 5], 1u << (x & 31));
      }
    }
    pc = a.p_cnt[b * a.Hk + hk];
    prow = a.p_idx + ((int64_t)b * a.Hk + hk) * a.N1;
    __syncthreads();
  }
  float mx = -INFINITY;
  for (int i = tid; i < Nt; i += kMergeThreads) {
    float v;
    if (i < a.N1) {
      v = a.lse1[(int64_t)r * a.N1 + i];
      if (prow) {
        // A repeated id of P counts once (lists are ascending: a repeat is the entry before);
        // exact also keeps only P n A.
        const int x = prow[i];
        const bool valid = i < pc && x >= 0;
        bool keep = !(valid && i > 0 && prow[i - 1] == x);
        if (a.exact) {
          const int xs = x > a.nb ? a.nb : x;
          keep = keep && valid && ((s_amask[xs >> 5] >> (xs & 31)) & 1u);
        }
        if (!keep) v = -INFINITY;
      }
    } else {
      v = a.lse2[(int64_t)r * a.N2 + (i - a.N1)];
    }
    s_w[i] = v;
    mx = fmaxf(mx, v);
  }
  // block max
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((tid & 31) == 0) s_red[tid >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int j = 0; j < kMergeThreads / 32; ++j) mx = fmaxf(mx, s_red[j]);
  const float m_safe = (mx == -INFINITY || mx == INFINITY || mx != mx) ? 0.f : mx;
  __syncthreads();
  float ls = 0.f;
  for (int i = tid; i < Nt; i += kMergeThreads) {
    const float w = expf(s_w[i] - m_safe);
    s_w[i] = w;
    ls += w;
  }
  for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
  if ((tid & 31) == 0) s_red[tid >> 5] = ls;
  __syncthreads();
  ls = 0.f;
  for (int j = 0; j < kMergeThreads / 32; ++j) ls += s_red[j];
  // Weighted sum: thread (float4 column c, entry slice p); slices reduced through shared memory.
  const int D4 = a.D / 4;
  const int P = kMergeThreads / D4;
  const int c = tid % D4, p = tid / D4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p < P) {
    for (int i = p; i < Nt; i += P) {
      const float w = s_w[i];
      if (w == 0.f) continue;
      const float4* src = i < a.N1
          ? reinterpret_cast<const float4*>(a.o1 + ((int64_t)r * a.N1 + i) * a.D)
          : reinterpret_cast<const float4*>(a.o2 + ((int64_t)r * a.N2 + (i - a.N1)) * a.D);
      float4 x = __ldg(src + c);
      x.x = x.x != x.x ? 0.f : x.x; x.y = x.y != x.y ? 0.f : x.y;
      x.z = x.z != x.z ? 0.f : x.z; x.w = x.w != x.w ? 0.f : x.w;
      acc.x = fmaf(w, x.x, acc.x); acc.y = fmaf(w, x.y, acc.y);
      acc.z = fmaf(w, x.z, acc.z); acc.w = fmaf(w, x.w, acc.w);
    }
    reinterpret_cast<float4*>(s_part)[tid] = acc;
  }
  __syncthreads();
  if (p == 0) {
    float4 t = acc;
    for (int j = 1; j < P; ++j) {
      const float4 y = reinterpret_cast<float4*>(s_part)[j * D4 + c];
      t.x += y.x; t.y += y.y; t.z += y.z; t.w += y.w;
    }
    const float inv = 1.f / fmaxf(ls, 1e-30f);
    t.x *= inv; t.y *= inv; t.z *= inv; t.w *= inv;
    reinterpret_cast<float4*>(a.o + (int64_t)r * a.D)[c] = t;
  }
  if (tid == 0) a.lse[r] = m_safe + logf(ls);
}

// ============================================================================ Quest update
__global__ void quest_reset_kernel(QuestUpdateArgs a) {
  const int n = blockIdx.x;
  const int64_t loc = ld_index(a.out_loc, n, a.loc64), pos = ld_index(a.positions, n, a.pos64);
  const int64_t page = (pos % a.page_size == 0) ? loc / a.page_size : 0;
  const int HD = a.Hk * a.D;
  for (int e = threadIdx.x; e < HD; e += blockDim.x) {
    a.kmin[page * HD + e] = INFINITY;
    a.kmax[page * HD + e] = -INFINITY;
  }
}
__device__ __forceinline__ void atomic_min_f(float* p, float v) {
  if (v >= 0.f) atomicMin(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMax(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
__device__ __forceinline__ void atomic_max_f(float* p, float v) {
  if (v >= 0.f) atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMin(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
// Decode (one token per page): the first token of a page writes the page's summary, any other
// token folds into it, so no reset pass is needed. Padding rows all write page 0, whose summary
// no request reads.
__global__ void quest_decode_update_kernel(QuestUpdateArgs a) {
  const int n = blockIdx.x;
  const int64_t loc = ld_index(a.out_loc, n, a.loc64), pos = ld_index(a.positions, n, a.pos64);
  const int64_t page = loc / a.page_size;
  const bool first = pos % a.page_size == 0;
  const int HD = a.Hk * a.D;
  for (int e = threadIdx.x * 8; e < HD; e += blockDim.x * 8) {
    float f[8];
    load8_any(a.k, (int64_t)n * HD + e, a.k_dtype, f);
    float* lo = a.kmin + page * HD + e;
    float* hi = a.kmax + page * HD + e;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo[i] = first ? f[i] : fminf(lo[i], f[i]);
      hi[i] = first ? f[i] : fmaxf(hi[i], f[i]);
    }
  }
}

// Prefill: each CTA folds kFoldTokens consecutive tokens of the batch. Consecutive tokens of a
// request mostly share a page, so every thread keeps the running min/max of its 8 elements over
// a run of tokens of one page and flushes it with one atomic per element when the page changes:
// kFoldTokens times fewer atomics than one per token and element (an 8K-token chunk hit each
// page's summary 64 times per element). Min and max do not depend on the order, so the result
// is the reference's bit for bit.
constexpr int kFoldTokens = 16;
__global__ void quest_fold_kernel(QuestUpdateArgs a) {
  const int n0 = blockIdx.x * kFoldTokens;
  const int n1 = min(a.N, n0 + kFoldTokens);
  const int HD = a.Hk * a.D;
  for (int e = threadIdx.x * 8; e < HD; e += blockDim.x * 8) {
    float lo[8], hi[8];
    int64_t cur = -1;
    for (int n = n0; n < n1; ++n) {
      const int64_t page = ld_index(a.out_loc, n, a.loc64) / a.page_size;
      float f[8];
      load8_any(a.k, (int64_t)n * HD + e, a.k_dtype, f);
      if (page != cur) {
        if (cur >= 0) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            atomic_min_f(a.kmin + cur * HD + e + i, lo[i]);
            atomic_max_f(a.kmax + cur * HD + e + i, hi[i]);
          }
        }
        cur = page;
#pragma unroll
        for (int i = 0; i < 8; ++i) { lo[i] = f[i]; hi[i] = f[i]; }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) { lo[i] = fminf(lo[i], f[i]); hi[i] = fmaxf(hi[i], f[i]); }
      }
    }
    if (cur >= 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        atomic_min_f(a.kmin + cur * HD + e + i, lo[i]);
        atomic_max_f(a.kmax + cur * HD + e + i, hi[i]);
      }
    }
  }
}

}  // namespace

// ============================================================================ launchers
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

cudaError_t launch_quest_scores(const QuestArgs& a, cudaStream_t s) {
  if (a.D % 8 != 0 || a.Hq % a.Hk != 0) return cudaErrorInvalidValue;
  if (a.B == 0 || a.NB == 0) return cudaSuccess;
  const size_t smem = (size_t)a.Hq * a.D * sizeof(float);
  cudaError_t e = set_smem_limit(quest_scores_kernel, smem);
  if (e != cudaSuccess) return e;
  dim3 grid((a.NB + kQuestWarps - 1) / kQuestWarps, a.B);
  quest_scores_kernel<<<grid, kQuestWarps * 32, smem, s>>>(a);
  return cudaGetLastError();
}

int max_topk_blocks() { return kTopkMaxBlocks; }

cudaError_t launch_select_topk(const TopkArgs& a, cudaStream_t s) {
  if (a.NB > kTopkMaxBlocks) return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0) return cudaSuccess;
  const size_t smem = (size_t)(a.NB > 0 ? a.NB : 1) * sizeof(uint32_t);
  cudaError_t e = set_smem_limit(select_topk_kernel, smem);
  if (e != cudaSuccess) return e;
  select_topk_kernel<<<dim3(a.Hk, a.B), kTopkThreads, smem, s>>>(a);
  return cudaGetLastError();
}

size_t attn_merge_smem(int N, int N1, int Na) {
  return (size_t)((Na + 3) / 4 * 4) * sizeof(int) +
         (size_t)(kAttnThreads / 32) * (N + N1) * (sizeof(float) + sizeof(int));
}

int max_select_group_dim() { return 48 * 1024 / 4; }

cudaError_t launch_quest_select(const SelectArgs& a, cudaStream_t s) {
  if (a.D % 8 != 0 || a.Hq % a.Hk != 0 || a.NB > kTopkMaxBlocks ||
      (a.Hq / a.Hk) * a.D > max_select_group_dim())
    return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0 || a.NB == 0) return cudaSuccess;
  const size_t smem = std::max((size_t)a.NB, (size_t)(a.Hq / a.Hk) * a.D) * 4;
  cudaError_t e = set_smem_limit(quest_select_kernel, smem);
  if (e != cudaSuccess) return e;
  dim3 grid(a.Hk, (a.NB + kSelChunk - 1) / kSelChunk, a.B);
  quest_select_kernel<<<grid, kSelThreads, smem, s>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_predict_update(const PredictArgs& a, cudaStream_t s) {
  if (a.NB > kTopkMaxBlocks) return cudaErrorInvalidValue;
  if (a.B == 0 || a.Hk == 0) return cudaSuccess;
  const size_t smem = (size_t)(a.NB > 0 ? a.NB : 1) * sizeof(uint32_t);
  cudaError_t e = set_smem_limit(predict_update_kernel, smem);
  if (e != cudaSuccess) return e;
  predict_update_kernel<<<dim3(a.Hk, a.B), kTopkThreads, smem, s>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_set_difference(const SetDiffArgs& a, cudaStream_t s) {
  if (a.rows == 0) return cudaSuccess;
  const size_t smem = (size_t)((a.nb + 31) / 32 + 1) * sizeof(uint32_t);
  cudaError_t e = set_smem_limit(set_difference_kernel, smem);
  if (e != cudaSuccess) return e;
  set_difference_kernel<<<a.rows, kSetThreads, smem, s>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_holt_update(const HoltArgs& a, cudaStream_t s) {
  const int64_t total = (int64_t)a.B * a.Hk * a.NB;
  if (total > 0) {
    const int threads = 256;
    int64_t blocks = (total + threads - 1) / threads;
    if (blocks > 4096) blocks = 4096;
    holt_update_kernel<<<(int)blocks, threads, 0, s>>>(a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (a.B > 0) holt_ninit_kernel<<<(a.B + 127) / 128, 128, 0, s>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_merge(const MergeArgs& a, cudaStream_t s) {
  if (a.D % 4 != 0 || a.D / 4 > kMergeThreads) return cudaErrorInvalidValue;
  if (a.R == 0) return cudaSuccess;
  const int Nt = a.N1 + a.N2;
  const size_t smem = ((size_t)(Nt + 3) / 4 * 4 + kMergeThreads * 4 + (a.p_idx ? a.nb / 32 + 1 : 0)) * 4;
  cudaError_t e = set_smem_limit(merge_kernel, smem);
  if (e != cudaSuccess) return e;
  merge_kernel<<<a.R, kMergeThreads, smem, s>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_quest_update(const QuestUpdateArgs& a, cudaStream_t s) {
  if ((a.Hk * a.D) % 8 != 0) return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  if (a.one_per_page) {
    quest_decode_update_kernel<<<a.N, 128, 0, s>>>(a);
    return cudaGetLastError();
  }
  quest_reset_kernel<<<a.N, 256, 0, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  quest_fold_kernel<<<(a.N + kFoldTokens - 1) / kFoldTokens, 128, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace prr
