// Device helpers shared by the kernel sources: index loads of int32/int64 tensors, 8-wide loads
// and 4-wide stores of any float dtype, request-slot rows, the shared-memory limit and the
// selection grids' width.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "prr_kernels.h"

namespace prr {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Lets `kernel` launch with `bytes` of dynamic shared memory. Without the opt-in, static plus
// dynamic shared memory must fit 48 KB, so the attribute is set whenever there are dynamic bytes
// (a kernel's static arrays count against the same 48 KB: checking the dynamic bytes alone let a
// launch fail with "invalid argument"). Host-side; a cheap attribute call, made on every launch.
template <typename K>
cudaError_t set_smem_limit(K* kernel, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

// Programmatic dependent launch (PDL). With SGLANG_PRR_PDL=1 every kernel of the library is
// launched with programmatic stream serialization: it may be scheduled while the kernel before it
// in the stream (or graph) is still running, once that kernel has signalled (pdl_trigger) or
// exited in every CTA, so its launch latency hides under that kernel's tail.
// Correctness rests on one rule: every kernel calls pdl_begin() before its first global-memory
// access (read or write), and griddepcontrol.wait returns only once the previous grid has
// completed and its writes are visible. Without the launch attribute both instructions are no-ops.
// The signal is late, where a kernel places it: a kernel that signalled at its top had the next
// one's CTAs scheduled while its own were still running, onto the SMs freed first, where they
// waited; the attention then ended 6 us later than launched after the selection (run 27). The
// selection signals when only its rows' tails are left (a CTA per row), so the attention's CTAs
// spread over SMs that are free and start the moment the selection's writes are visible.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The signal that the next kernel (launched with the PDL attribute) may be scheduled: it is
// scheduled once every CTA of this grid has called this or exited (an exit counts as the signal).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The integer value of a timing-probe environment variable (0 when unset). Development only:
// callers read it once per process into a static.
inline int debug_stop_env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

// Whether launches carry the PDL attribute: SGLANG_PRR_PDL=1, read once per process.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SGLANG_PRR_PDL");
    return v != nullptr && v[0] == '1' && v[1] == '\0';
  }();
  return on;
}

// Which kernels ask for the SM's largest shared-memory carveout (SGLANG_PRR_SMEM_CARVEOUT, read
// once per process; a measuring knob): =max every kernel, =select PRR's one-pass selection only
// (the kernel whose CTAs fill the SMs first, so that the SMs it configures hold the speculative
// pass's CTAs beside it while every other kernel keeps its L1), else none. The driver sizes an
// SM's shared memory for the kernel that fills it (two 82 KB CTAs of PRR's one-pass selection,
// 55 KB since its tail is sized by its chunks), which left too little beside them for a CTA of
// the speculative pass on the other stream, so the pass started when the selection's CTAs left
// (6.5-8.3 us into the layer at 128K / batch 1; 6.7 with the 55 KB CTAs, run 30).
// With the whole 228 KB for every kernel it starts beside the selection, but every kernel of the
// layer gets slower and PRR's step 3% longer (run 25): off by default. The same bits either way.
enum class Carveout { kNone, kMax, kSelect };
inline Carveout carveout_mode() {
  static const Carveout mode = [] {
    const char* v = std::getenv("SGLANG_PRR_SMEM_CARVEOUT");
    if (v != nullptr && std::strcmp(v, "max") == 0) return Carveout::kMax;
    if (v != nullptr && std::strcmp(v, "select") == 0) return Carveout::kSelect;
    return Carveout::kNone;
  }();
  return mode;
}

// Asks the driver for the SM's largest shared-memory carveout for `kernel`.
template <typename... KArgs>
cudaError_t ask_carveout_max(void (*kernel)(KArgs...)) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              (int)cudaSharedmemCarveoutMaxShared);
}

// Launch `kernel` on `grid` x `block` with `smem` bytes of dynamic shared memory on stream `s`
// (with the PDL attribute when enabled; with the largest shared-memory carveout asked for where
// carveout_mode() is kMax). Returns the launch's error, which is also the runtime's last error,
// so launchers keep ending in cudaGetLastError().
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t s, Args&&... args) {
  if (carveout_mode() == Carveout::kMax) {
    const cudaError_t e = ask_carveout_max(kernel);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl_enabled()) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// The device's SMs and shared memory bytes an SM, read once per process (zeros when the
// query fails): the launchers' wave arithmetic.
struct DeviceShape { int sms, smem_per_sm; };
inline DeviceShape device_shape() {
  static const DeviceShape d = [] {
    int dev = 0, n = 0, bytes = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) !=
            cudaSuccess)
      return DeviceShape{0, 0};
    return DeviceShape{n, bytes};
  }();
  return d;
}

// The x of a selection grid whose CTAs take `units` pieces of each of `rows` rows (table chunks
// or groups of blocks): `units` is the block table's width (SGLang's tables are as wide as the
// server's context length; the CTAs past a row's blocks exit after their first loads). Capped
// ("rows"): about two waves of `per_sm` CTAs an SM, at least one a row, the kernels' CTAs then
// looping over their row's pieces. `capped` says which a kernel takes by default (H200, cold L2,
// 128K-wide tables: the scores kernel at 16 x 32K 47.2 -> 42.2 us capped, level at 4 and 8 x 128K;
// the one-pass kernel, whose tail merges one candidate list a CTA, 49.9 -> 56.7 at 4 x 128K).
// SGLANG_PRR_SELECT_GRID=rows|table (a measuring knob, read at each launch; a captured graph
// keeps its grid) forces either; =N (a positive integer, a test knob) caps it at N.
inline int select_grid_x(int64_t rows, int units, int per_sm, bool capped) {
  const char* e = std::getenv("SGLANG_PRR_SELECT_GRID");
  if (rows <= 0 || (e && std::strcmp(e, "table") == 0) || (!e && !capped)) return units;
  int64_t cap = e ? std::atoi(e) : 0;
  if (!e || std::strcmp(e, "rows") == 0) {
    const int sms = device_shape().sms;
    if (sms <= 0) return units;
    cap = (2 * (int64_t)sms * per_sm + rows - 1) / rows;
  }
  if (cap < 1) return units;  // unset, unknown or not positive: the table's width
  return (int)(cap < units ? cap : units);
}

__device__ __forceinline__ int64_t ld_index(const void* p, int64_t i, bool is64) {
  return is64 ? __ldg(reinterpret_cast<const long long*>(p) + i)
              : (int64_t)__ldg(reinterpret_cast<const int*>(p) + i);
}

// ld_index in two steps, the load (ld_index_raw) and the value (index_of), so that a kernel's
// prologue can have every independent load in flight before it uses any: the compiler places
// ld_index's widening next to its load where the load sits in a branch (a bounds check, an
// optional tensor), and the widening waits for the data there, one round trip per load.
struct RawIndex { long long v64; int v32; };
__device__ __forceinline__ RawIndex ld_index_raw(const void* p, int64_t i, bool is64) {
  RawIndex r;
  r.v64 = is64 ? __ldg(reinterpret_cast<const long long*>(p) + i) : 0;
  r.v32 = is64 ? 0 : __ldg(reinterpret_cast<const int*>(p) + i);
  return r;
}
__device__ __forceinline__ int64_t index_of(const RawIndex& r, bool is64) {
  return is64 ? r.v64 : (int64_t)r.v32;
}

// load8_any / load4_any in two steps (as ld_index_raw / index_of): the elements as loaded, and
// later as floats, so that a kernel's loads of q all go out before any is used (a load in a
// dtype branch that is used at once is one round trip per load).
struct Raw8Any { uint4 a, b; };
__device__ __forceinline__ Raw8Any ld8_raw(const void* base, int64_t off, int dt) {
  const bool f32 = dt == kF32;
  const uint4* p =
      reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(base) + off * (f32 ? 4 : 2));
  Raw8Any r;
  r.a = __ldg(p);
  r.b = f32 ? __ldg(p + 1) : make_uint4(0u, 0u, 0u, 0u);
  return r;
}
// 4 elements: 16 bytes for float32, else 8 (in .x, .y).
__device__ __forceinline__ uint4 ld4_raw(const void* base, int64_t off, int dt) {
  const bool f32 = dt == kF32;
  const uint2* p =
      reinterpret_cast<const uint2*>(reinterpret_cast<const char*>(base) + off * (f32 ? 4 : 2));
  const uint2 lo = __ldg(p);
  const uint2 hi = f32 ? __ldg(p + 1) : make_uint2(0u, 0u);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}
// The n = 4 or 8 elements of `w` (n words for float32, n / 2 words of two 16-bit values) as floats.
template <int N>
__device__ __forceinline__ void raw_words_floats(const uint32_t* w, int dt, float* f) {
  if (dt == kF32) {
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = __uint_as_float(w[i]);
    return;
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 x = dt == kF16
                         ? __half22float2(*reinterpret_cast<const __half2*>(&w[i]))
                         : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void raw8_floats(const Raw8Any& r, int dt, float* f) {
  raw_words_floats<8>(reinterpret_cast<const uint32_t*>(&r), dt, f);
}
__device__ __forceinline__ void raw4_floats(const uint4& r, int dt, float* f) {
  raw_words_floats<4>(&r.x, dt, f);
}

// Load 8 consecutive elements of a tensor of dtype `dt` as floats (16- or 32-byte aligned).
__device__ __forceinline__ void load8_any(const void* base, int64_t off, int dt, float* f) {
  if (dt == kF32) {
    const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(base) + off);
    float4 a = p[0], b = p[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else if (dt == kF16) {
    uint4 u = *reinterpret_cast<const uint4*>(reinterpret_cast<const __half*>(base) + off);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 x = __half22float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  } else {
    uint4 u = *reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(base) + off);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 x = __bfloat1622float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
}

// Load 4 consecutive elements of a tensor of dtype `dt` as floats (8- or 16-byte aligned).
__device__ __forceinline__ float4 load4_any(const void* base, int64_t off, int dt) {
  if (dt == kF32) return *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(base) + off);
  const uint2 u = *reinterpret_cast<const uint2*>(reinterpret_cast<const uint16_t*>(base) + off);
  float2 x, y;
  if (dt == kF16) {
    x = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    y = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  } else {
    x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  }
  return make_float4(x.x, x.y, y.x, y.y);
}

// A Quest summary bound of a key value as the summaries store it: float32 as is, bfloat16 rounded
// outward (the minimum down, the maximum up), returned as a float.
template <typename S> struct KeyBound;
template <> struct KeyBound<float> {
  __device__ __forceinline__ static float lo(float x) { return x; }
  __device__ __forceinline__ static float hi(float x) { return x; }
};
template <> struct KeyBound<__nv_bfloat16> {
  __device__ __forceinline__ static float lo(float x) { return __bfloat162float(__float2bfloat16_rd(x)); }
  __device__ __forceinline__ static float hi(float x) { return __bfloat162float(__float2bfloat16_ru(x)); }
};

// Fold a key value x into a summary's (lo, hi) as the decode update does (summaries.cu): the
// first token of a page replaces them, any other replaces only a smaller minimum / larger maximum.
// Idempotent: folding into an already-folded pair changes nothing.
template <typename S>
__device__ __forceinline__ void fold_key(float x, bool first, float& lo, float& hi) {
  const float l = KeyBound<S>::lo(x), h = KeyBound<S>::hi(x);
  if (first || l < lo) lo = l;
  if (first || h > hi) hi = h;
}

// x clamped to [0, hi]: a count or length read from a tensor (garbage-tolerant: a negative or
// oversized value cannot index past the arrays sized by hi).
__device__ __forceinline__ int clamp_count(int64_t x, int hi) {
  return (int)(x < 0 ? 0 : (x > hi ? hi : x));
}

// fold_key over the 4 values of a float4 (the selection kernels' 16-byte summary pieces).
template <typename S>
__device__ __forceinline__ void fold_key4(float4 x, bool first, float4& lo, float4& hi) {
  fold_key<S>(x.x, first, lo.x, hi.x);
  fold_key<S>(x.y, first, lo.y, hi.y);
  fold_key<S>(x.z, first, lo.z, hi.z);
  fold_key<S>(x.w, first, lo.w, hi.w);
}

// Where row b's new key enters its selection (SelectArgs::new_k): its block, or -1 (none), and
// whether it is the first token of its page.
__device__ __forceinline__ int new_key_block_at(int64_t pos, int page_size, bool& first) {
  first = false;
  if (pos < 0) return -1;
  first = pos % page_size == 0;
  return (int)min(pos / page_size, (int64_t)INT_MAX);
}
__device__ __forceinline__ int new_key_block(const void* new_k, const void* new_pos, bool pos64,
                                             int page_size, int b, bool& first) {
  first = false;
  return new_k ? new_key_block_at(ld_index(new_pos, b, pos64), page_size, first) : -1;
}

// Store 4 floats at element offset `off` of a tensor of dtype `dt` (rounded to nearest).
__device__ __forceinline__ void store4_any(void* base, int64_t off, int dt, float4 v) {
  if (dt == kF32) {
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(base) + off) = v;
  } else if (dt == kF16) {
    __half2* p = reinterpret_cast<__half2*>(reinterpret_cast<__half*>(base) + off);
    p[0] = __floats2half2_rn(v.x, v.y);
    p[1] = __floats2half2_rn(v.z, v.w);
  } else {
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(base) + off);
    p[0] = __floats2bfloat162_rn(v.x, v.y);
    p[1] = __floats2bfloat162_rn(v.z, v.w);
  }
}

// An index into a pool of n rows: a request slot, a page id (a table's, or a KV slot's page) or a
// KV slot. One outside [0, n) (a caller's error: SGLang's never are) is 0, SGLang's padding row,
// page or slot, which no request reads: a bad index reads and writes there, never memory past the
// pool (the reference's rule, reference.paging.in_pool).
__device__ __forceinline__ int64_t in_pool(int64_t r, int64_t n) {
  return (r >= 0 && r < n) ? r : 0;
}

// The page of KV slot `loc` in a pool of n_pages pages: the slot's page, or page 0 (the padding
// sink no request reads) for a slot outside the pool (in_pool; a negative one would else name a
// page before the pool's start).
__device__ __forceinline__ int64_t slot_page(int64_t loc, int page_size, int64_t n_pages) {
  return loc < 0 ? 0 : in_pool(loc / page_size, n_pages);
}

// The page row b's new key is written to (SelectArgs::new_loc: the page of its slot), or -1 where
// the launch does not write the summaries. Callers load it beside new_pos (one round trip).
__device__ __forceinline__ int64_t new_key_page(const void* new_loc, bool loc64, int page_size,
                                                int64_t n_pages, int b) {
  if (!new_loc) return -1;
  return slot_page(ld_index(new_loc, b, loc64), page_size, n_pages);
}

// 4 dims of a head's folded bounds stored as the summaries of type S hold them (float32, or
// bfloat16: the values are representable, as loaded from the summaries or rounded outward by
// fold_key, so the store's rounding to nearest keeps them), at element offset `off`.
template <typename S>
__device__ __forceinline__ void store_bounds4(void* kmin, void* kmax, int64_t off, float4 lo,
                                              float4 hi) {
  constexpr int dt = sizeof(S) == 4 ? kF32 : kBF16;
  store4_any(kmin, off, dt, lo);
  store4_any(kmax, off, dt, hi);
}

// Quest's bound with the GQA group folded first. A lane's q is fixed for a launch, so
//   sum_g fmax(q_g hi, q_g lo) = max(hi, lo) * Qp + min(hi, lo) * Qn   (per dim)
// with Qp the sum of the group's q_g >= 0 (NaN counted there) and Qn that of its q_g < 0: two
// compares and two FMAs a value for any G, where the per-head form takes 4 G instructions. It
// equals the reference's sum of fmax up to rounding (the kernels' sums were never the reference's
// order; the tests bound the scores and check the selection on the kernel's own scores). Where a
// piece's sum is not finite (an infinite or NaN bound or q: 0 * inf is NaN where fmax takes the
// other bound) the caller sums that piece again the reference's way, per head.
template <int V>
__device__ __forceinline__ void quest_fold_q(const float* qv, float* qp, float* qn) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (qv[v] < 0.f) qn[v] += qv[v];
    else qp[v] += qv[v];
  }
}
template <int V>
__device__ __forceinline__ float quest_piece_sum(const float* lo, const float* hi, const float* qp,
                                                 const float* qn, float part) {
#pragma unroll
  for (int v = 0; v < V; ++v)
    part = fmaf(fminf(hi[v], lo[v]), qn[v], fmaf(fmaxf(hi[v], lo[v]), qp[v], part));
  return part;
}

// Whether x is one of list[0, n) (shared memory): independent compares, several loads in flight.
__device__ __forceinline__ bool occurs_in(const int* list, int n, int x) {
  // Eight compares in flight a step; the loops themselves not unrolled further (the merge and
  // selection tails run once per group, from code that is cold in the instruction caches).
  int hit = 0, j = 0;
#pragma unroll 1
  for (; j + 8 <= n; j += 8) {
#pragma unroll
    for (int u = 0; u < 8; ++u) hit |= list[j + u] == x;
  }
#pragma unroll 1
  for (; j < n; ++j) hit |= list[j] == x;
  return hit != 0;
}

// Row of a per-request list: b, or the request slot rows[b] when the list lives in a pool of n
// rows (in_pool).
__device__ __forceinline__ int64_t slot_of(const void* rows, bool rows64, int64_t n, int b) {
  return rows ? in_pool(ld_index(rows, b, rows64), n) : (int64_t)b;
}


// "Last CTA of a group finishes" (split reductions without a second launch). A CTA's arrival at
// its group's counter, once after writing its results (every thread calls it; thread 0 adds
// one): returns to every thread the counter's value before the arrival. The arrival whose value
// masked by `mask` is group_size - 1 is the last, and every other CTA's writes are visible to it
// (read them with __ldcg: L1 is not coherent); it resets the counter to zero, so the next launch
// or graph replay starts from zero (and group_wait is released). A group of one CTA (a repair
// over |M| <= 1 block, a selection row of one chunk) is its own last without touching the
// counter. The barrier orders every thread's writes before thread 0's fence, which publishes
// them at device scope before its ticket (the pattern of cooperative groups' grid sync: one fence
// per CTA, not one per thread; release/acquire, not __threadfence's heavier sequentially
// consistent MEMBAR). The last CTA's fence (acquire) comes before its reset: a fence waits for
// the thread's outstanding memory operations, so after the reset it would add that atomic's
// round trip to the caller's critical path; the reset completes by the end of the kernel, before
// the next launch in the stream reads the counter. Contains __syncthreads.
__device__ __forceinline__ int group_ticket(int* counter, int group_size, int mask) {
  __shared__ int s_prev;
  __syncthreads();
  if (group_size == 1) return 0;
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    const int prev = atomicAdd(counter, 1);
    s_prev = prev;
    if ((prev & mask) == group_size - 1) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      atomicExch(counter, 0);
    }
  }
  __syncthreads();
  return s_prev;
}

// Whether this CTA is the last of its group to arrive (group_ticket on the whole counter).
__device__ __forceinline__ bool last_of_group(int* counter, int group_size) {
  return group_ticket(counter, group_size, -1) == group_size - 1;
}

// A barrier over the CTAs of a group whose counter counts arrivals in its low 16 bits and
// withdrawals above them (kGroupWithdrawal each), in two halves so that a CTA can work between
// them: every CTA arrives once after writing its results (group_ticket with kGroupArrivals: the
// last arrival's reset to zero releases the group), then the others wait here for the release
// and, where it came, may read every CTA's results (with __ldcg). A waiting CTA holds its SM, so
// a group member that cannot be scheduled (its SMs held by other kernels' CTAs or by waiting
// ones) would never arrive: after `limit` clocks a waiter withdraws instead, by one atomic on the
// counter while the group is still short of its last arrival (after it, no withdrawal can be
// counted, so the last arrival's ticket sees every one). Returns true where released, false
// where withdrawn: the last CTA then has the whole group's work to do. Contains __syncthreads.
constexpr int kGroupArrivals = 0xFFFF;
constexpr int kGroupWithdrawal = 0x10000;
__device__ __forceinline__ bool group_wait(int* counter, int group_size, long long limit) {
  __shared__ int s_released;
  if (threadIdx.x == 0) {
    // This CTA's own arrival keeps the counter above zero until the release, and the next
    // launch's arrivals cannot begin before this grid ends.
    const long long t0 = clock64();
    int v, released = 1;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      if (v == 0) break;
      // A failed exchange means the counter moved (an arrival, a withdrawal, the release): the
      // loop reads it again.
      if ((v & kGroupArrivals) < group_size && clock64() - t0 >= limit &&
          atomicCAS(counter, v, v + kGroupWithdrawal) == v) {
        released = 0;
        break;
      }
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // as cooperative groups' grid sync
    s_released = released;
  }
  __syncthreads();
  return s_released != 0;
}


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

// ---- bulk copies (cp.async.bulk) into shared memory, completing on an mbarrier (SM90)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders memory ("memory" clobber): a load issued after it in program order is not moved
// ahead of it, so a loop that looks an address up and then copies from it waits for each lookup.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

}  // namespace
}  // namespace prr
