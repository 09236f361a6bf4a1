// Sparse attention over listed KV pages on SM90 (H100/H200), built on CuTe's SM80 MMA and copy
// atoms: per-block (o, lse) partials, and the merge of a (request, KV head) group by the last CTA
// of the group (serial DSA's attention over A; PRR's speculative pass over P and its repair over
// M merged into exactly A).
//
// Exactness by construction. Every block's partial is computed by the same code whichever pass
// reads it (serial, speculative or repair: the launch only changes where the partial is written),
// and the merge visits the kept partials in one fixed order, ascending block id. So PRR (exact)
// gives serial DSA's output bits, not only its value, for any prediction.
//
// Every kernel is graph-safe: static launch shapes, device-side counts, no host reads.
#include "attn_merge.cuh"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace prr {
namespace {

// Whether entry n of `list` repeats an earlier one (counted once). `first` is list[threadIdx.x],
// loaded by the caller beside the count (entries before a listed one are listed too).
__device__ __forceinline__ bool repeats_earlier(const int32_t* list, int n, int blk, int first) {
  int dup = (int)threadIdx.x < n && first == blk;
  for (int j = threadIdx.x + blockDim.x; j < n; j += blockDim.x) dup |= list[j] == blk;
  return __syncthreads_or(dup) != 0;
}


// List entry n's partial for the G query heads from row0 as the empty state (o = 0, lse = -inf):
// a padding entry, a repeat or a block past the request. Called by every thread of the CTA.
template <int D>
__device__ __forceinline__ void write_empty_partial(const AttnArgs& a, int64_t row0, int n,
                                                    int G) {
  const int tid = threadIdx.x;
  for (int e = tid; e < G * D; e += kAttnThreads)
    a.o[((row0 + e / D) * a.N + n) * D + e % D] = 0.f;
  if (tid < G) a.lse[(row0 + tid) * a.N + n] = -INFINITY;
}

// A (request, KV head) row's CTAs, or a group's: its N list entries, `pack` a CTA.
__host__ __device__ constexpr int row_ctas(int N, int pack) { return (N + pack - 1) / pack; }

// A CTA of packed entries (a.pack > 1: pages of 16 or 32 tokens), block_attn_kernel's form for
// entries [cta P, cta P + P): the same lists, repeat checks, empty states and merge tail as one
// entry's CTA, counted in CTAs (a group of G entries is ceil(G / P) CTAs). Called by every thread.
template <typename T, int D>
__device__ void block_attn_packed(const AttnArgs& a, int cta, int hk, int b, int nq,
                                  unsigned char* s_dyn) {
  const int P = a.pack, G = a.Hq / a.Hk, tid = threadIdx.x, n0 = cta * P;
  const int64_t row0 = (int64_t)b * a.Hq + (int64_t)hk * G;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, a.idx_rows_n, b) * a.Hk + hk;
  // The list's loads in one round trip, as block_attn_kernel's (the grid covers the list).
  const int32_t* list = a.idx + lrow * a.N;
  const int c = a.cnt[lrow];
  int blk[kMaxPack];
#pragma unroll
  for (int j = 0; j < kMaxPack; ++j) blk[j] = j < P && n0 + j < a.N ? list[n0 + j] : -1;
  const int64_t sl = ld_index(a.seq_lens, b, a.seq64);
  const int last = min(n0 + P, a.N) - 1;
  const int earlier = tid < last ? list[tid] : 0;
  const int parts = max(min(c, a.N), 1);
  const int group = row_ctas(a.spread == 2 ? a.N : parts, P);  // CTAs
  if (a.sem && cta >= group) return;
  // The entries' page ids go out before the repeat checks' barriers (every load in flight at
  // once, a repeat's discarded; an entry without a page reads its row's first), so that their
  // round trips overlap instead of following one another.
  bool has_page[kMaxPack];
  RawIndex raw[kMaxPack];
#pragma unroll
  for (int j = 0; j < kMaxPack; ++j) {
    has_page[j] = j < P && n0 + j < min(c, a.N) && blk[j] >= 0 && blk[j] < a.NB;
    raw[j] = ld_index_raw(a.table, (int64_t)b * a.table_stride + (has_page[j] ? blk[j] : 0),
                          a.table64);
  }
  int64_t slot0[kMaxPack];
  int ntok[kMaxPack];
  bool any = false;
#pragma unroll
  for (int j = 0; j < kMaxPack; ++j) {
    slot0[j] = 0;
    ntok[j] = 0;
    const int n = n0 + j;
    if (j >= P || n >= a.N) continue;  // uniform: the barrier below is reached by all or none
    const bool repeat = repeats_earlier(list, n, blk[j], earlier);
    if (has_page[j] && !repeat) {
      slot0[j] = in_pool(index_of(raw[j], a.table64), a.num_pages) * a.page_size;
      ntok[j] = clamp_count(sl - (int64_t)blk[j] * a.page_size, a.page_size);
    }
    any |= ntok[j] > 0;
    if (ntok[j] == 0 && !(a.sem && n >= parts)) write_empty_partial<D>(a, row0, n, G);
  }
  stamp(a, kTlLists);
  if (any) packed_partials<T, D>(a, b, hk, n0, P, row0, slot0, ntok, nq, s_dyn);
  if (a.sem) merge_tail(a, b, hk, cta, s_dyn, group, D, false);
}

// HeadsX: the grid's x runs over KV heads and its y over list entries (launch_partials), else the
// other way round; a template argument, not a branch, so that D = 256 keeps its registers.
template <typename T, int D, bool HeadsX>
__global__ void __launch_bounds__(kAttnThreads)
block_attn_kernel(AttnArgs a, int nq) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(128) unsigned char s_dyn[];  // K/V stages; combine; merge tail

  const int n = HeadsX ? blockIdx.y : blockIdx.x, hk = HeadsX ? blockIdx.x : blockIdx.y;
  const int b = blockIdx.z;
  probe_entry(a, ((unsigned long long)b << 40) | ((unsigned long long)hk << 20) | n);
  const int G = a.Hq / a.Hk;
  const int tid = threadIdx.x;
  const int64_t row0 = (int64_t)b * a.Hq + (int64_t)hk * G;
  const int64_t lrow = slot_of(a.idx_rows, a.idx_rows64, a.idx_rows_n, b) * a.Hk + hk;
  // Every load that needs only the list's row goes out at once (one round trip, not three): the
  // count, this CTA's entry, the request's length and the first earlier entries (the repeat
  // check). The list is as wide as the grid, so entry n exists whatever the count.
  const int32_t* list = a.idx + lrow * a.N;
  const int c = a.cnt[lrow];
  const int blk = list[n];
  const int64_t sl = ld_index(a.seq_lens, b, a.seq64);
  const int earlier = tid < n ? list[tid] : 0;
  // A fused merge's row with an empty list (count <= 0: a repair where P covered A) merges at
  // once: no partial to compute or wait for, its CTAs merge their shares without a ticket
  // (merge_tail). (Its lists are not loaded here beside the count: the general path would then
  // hold them across the partial, 79 -> 95 registers at D = 128.)
  const bool alone = a.sem && c <= 0;
  // Fused merge: only the listed entries compute a partial. The CTAs of the other entries exit
  // at once or, where the merge is spread over the row (a.spread == 2, or a row merged alone),
  // take their share of it: a repair over one block would else merge its entries' rows in one
  // CTA (5.3 us against 2.4 for a share, run 27).
  const int parts = max(min(c, a.N), 1);
  const int group = (a.spread == 2 || alone) ? a.N : parts;
  if (a.sem && n >= group) return probe_exit(a);
  if (!alone) {  // uniform over the CTA (the repeat check's barrier)
    const bool repeat = repeats_earlier(list, n, blk, earlier);
    stamp(a, kTlLists);
    int ntok = 0;
    int64_t page = 0;
    if (n < c && !repeat && blk >= 0 && blk < a.NB) {  // ids outside the table are padding
      page =
          in_pool(ld_index(a.table, (int64_t)b * a.table_stride + blk, a.table64), a.num_pages);
      const int64_t rem = sl - (int64_t)blk * a.page_size;
      ntok = clamp_count(rem, a.page_size);
    }
    if (a.sem && n >= parts) {
      // a share of the merge only: no partial (the merge reads the entries below the count)
    } else if (ntok == 0) {  // padding entry or block past the request
      write_empty_partial<D>(a, row0, n, G);
    } else {
      block_partial<T, D>(a, b, hk, n, row0, page, ntok, nq, s_dyn);
    }
  }
  // One call site: the merge's code is in the kernel once (its instructions run cold). Its
  // first barrier orders the combine's s_o reads before the merge's arrays reuse s_dyn.
  if (a.sem) merge_tail(a, b, hk, n, s_dyn, group, D, alone);
  probe_exit(a);
}

// Sparse attention over pages of 16 or 32 tokens, 64 / page list entries a CTA
// (block_attn_packed; a.pack > 1): block_attn_kernel's launch, its grid's y counting CTAs of
// packed entries. A kernel of its own, so that its registers are not the one-entry kernel's.
template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads)
block_attn_packed_kernel(AttnArgs a, int nq) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(128) unsigned char s_dyn[];  // K/V stage; combine; merge tail
  const int cta = blockIdx.y, hk = blockIdx.x, b = blockIdx.z;
  probe_entry(a, ((unsigned long long)b << 40) | ((unsigned long long)hk << 20) | cta);
  block_attn_packed<T, D>(a, cta, hk, b, nq, s_dyn);
  probe_exit(a);
}

// The merge alone: the fused tail's code (merge_loads, merge_entries, merge_rows) on the partials
// a block_attn_kernel launch without counters wrote, so its output bits are the fused launch's.
// Launched after that kernel where the merge is split off (attn_launch). Grid (Hk, B, S): CTA z of
// a (request, KV head) group merges the z-th of S ranges of the group's G * D / 4 output items
// (each sorts the entries and weighs them itself; a range has the bits of the whole), so that a
// group's row copies are issued by S CTAs, not by one CTA's 128 threads.
__global__ void __launch_bounds__(kAttnThreads)
attn_merge_kernel(AttnArgs a) {
  pdl_begin();  // before any global-memory access (PDL)
  extern __shared__ __align__(128) unsigned char s_dyn[];  // merge arrays, then the row stage
  const int hk = blockIdx.x, b = blockIdx.y;
  const MergeShape m(a);
  const int items = m.G * (a.D / 4);
  const int lo = (int)((int64_t)items * blockIdx.z / gridDim.z);
  const int hi = (int)((int64_t)items * (blockIdx.z + 1) / gridDim.z);
  const MergeLoads l = merge_loads(a, b, hk);
  const int nk = merge_entries(a, b, hk, l, s_dyn);
  merge_rows(a, b, hk, s_dyn,
             reinterpret_cast<float4*>(s_dyn + merge_arrays_bytes(m.N, m.N1, m.Na, m.G)), nk,
             a.D, lo, hi);
}

// The merge kernel's CTAs a group (its grid's z): about two CTAs an SM over the launch, at most a
// CTA a warp's worth (32) of the group's items (the server's merge at 32K / 8 on an H100: 8.2 ->
// 6.4 us a layer, run 47). SGLANG_PRR_ATTN_MERGE_SPLITS=<n> asks for n within the same bound (1:
// one CTA a group); a measuring knob read at each launch (a captured graph keeps its value), and
// a value that is not a positive integer asks for nothing (the shape rule).
int merge_splits(int64_t groups, int items) {
  const int most = std::max(items / 32, 1);
  const char* k = getenv("SGLANG_PRR_ATTN_MERGE_SPLITS");
  if (k && *k) {
    char* end = nullptr;
    const long n = strtol(k, &end, 10);
    if (*end == '\0' && n > 0) return (int)std::min<long>(n, most);
  }
  const DeviceShape sm = device_shape();
  if (sm.sms <= 0 || groups <= 0) return 1;
  const int64_t want = (2 * (int64_t)sm.sms + groups - 1) / groups;
  return (int)std::min<int64_t>(std::max<int64_t>(want, 1), most);
}

// Dynamic shared memory a fused-merge launch may take for the merge tail's row stage: 4 CTAs of
// 128 threads (the attention's register-bound occupancy) still fit an SM's 228 KiB.
constexpr size_t kMergeSmemBudget = 52 * 1024;

// Shared memory a fused-merge CTA may take for the merge tail: kMergeSmemBudget, or, when the
// grid is one wave of at most 3 CTAs an SM (batch 1), a third of an SM's shared memory, so that
// the row stage holds every entry of a K = 32-block merge in one round trip instead of two.
size_t merge_smem_budget(int64_t ctas) {
  const DeviceShape sm = device_shape();
  constexpr int kPerSm = 3;
  constexpr size_t kReserve = 2 * 1024;  // the runtime's CTA reserve and the static arrays
  if (sm.sms <= 0 || ctas > (int64_t)kPerSm * sm.sms) return kMergeSmemBudget;
  return std::max(kMergeSmemBudget, (size_t)sm.smem_per_sm / kPerSm - kReserve);
}

// Whether every CTA of a launch of `kernel` (`ctas` CTAs of kAttnThreads threads, `smem` bytes
// of dynamic shared memory) can be resident at once on this device: the spread merge's barrier
// needs it (a waiting CTA holds its SM until its whole group has arrived).
template <typename K>
bool fits_one_wave(K* kernel, int64_t ctas, size_t smem) {
  const DeviceShape sm = device_shape();
  int per_sm = 0;
  if (sm.sms <= 0 || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kAttnThreads,
                                                                   smem) != cudaSuccess) {
    cudaGetLastError();  // a failed query is not the launch's error: take the ticket
    return false;
  }
  return ctas <= (int64_t)per_sm * sm.sms;
}

// block_attn_kernel's launch, the KV heads of one list entry in consecutive CTAs: they run
// together and read a page's slots, whose K (V) rows of all heads are adjacent, together (cold
// L2 at 2048 tokens, run 16: 15.7 -> 14.9 us at batch 1, level at batch 8 / 32). The entries of
// one head in consecutive CTAs (each CTA reads a 256-byte row of every 2 KB slot) where
// SGLANG_PRR_ATTN_GRID=entries asks (a measuring knob, read at each launch; a captured graph
// keeps its order) or the list is wider than a grid's y (65535).
// `spread`: a fused merge may be spread over the group's CTAs, which the launch does where its
// grid is one wave (merge_tail's two forms), counted by attn_spread_launches; over every CTA of
// the row, those of entries past the count included, where SGLANG_PRR_ATTN_SPREAD=row asks (a
// measuring knob, read at each launch; a captured graph keeps its setting).
std::atomic<int64_t> g_spread_launches{0};

template <typename T, int D>
cudaError_t launch_partials(AttnArgs c, int nq, size_t smem, bool spread, cudaStream_t s) {
  const int ctas = row_ctas(c.N, c.pack);
  auto launch = [&](auto* kernel, dim3 grid) {
    cudaError_t e = set_smem_limit(kernel, smem);
    if (e != cudaSuccess) return e;
    e = probe_setup("SGLANG_PRR_ATTN_TIMELINE", (int64_t)grid.x * grid.y * grid.z, s,
                    &c.timeline, &c.timeline_ctas);
    if (e != cudaSuccess) return e;
    c.spread = c.sem && spread && c.N <= kGroupArrivals &&
               fits_one_wave(kernel, (int64_t)c.B * c.Hk * ctas, smem);
    g_spread_launches += c.spread;
    const char* row = getenv("SGLANG_PRR_ATTN_SPREAD");
    if (c.spread && row && !strcmp(row, "row")) c.spread = 2;
    launch_kernel(kernel, grid, kAttnThreads, smem, s, c, nq);
    return cudaGetLastError();
  };
  if (c.pack > 1) return launch(block_attn_packed_kernel<T, D>, dim3(c.Hk, ctas, c.B));
  const char* order = getenv("SGLANG_PRR_ATTN_GRID");
  if (ctas <= 65535 && !(order && !strcmp(order, "entries")))
    return launch(block_attn_kernel<T, D, true>, dim3(c.Hk, ctas, c.B));
  return launch(block_attn_kernel<T, D, false>, dim3(ctas, c.Hk, c.B));
}

// The split merge's shape rule: a partials grid of at least kSplitMergeMinCtas CTAs (about two
// waves of 4 CTAs an SM on 132 SMs; batch 1 at 2048 tokens is 272).
constexpr int64_t kSplitMergeMinCtas = 1024;
bool attn_takes_split_merge(int64_t ctas) { return ctas >= kSplitMergeMinCtas; }

// List entries a CTA computes: one, or 64 / page (block_attn_packed: the same bits). A 16-token
// page alone in a CTA leaves three of its four warps on zero rows, and the grid four times as many
// CTAs as the tokens need. The shape rule packs 16-token pages where the one-entry grid (rows * N
// CTAs) is several waves, by the split merge's rule; cold L2 at 128K, K = 2048 tokens, partials +
// merge (an H100): 26.1 -> 24.6 us at batch 1, 86.8 -> 72.7 at batch 8, 333.9 -> 265.6 at batch 32,
// while a one-wave grid loses (batch 1, K = 1024: 14.9 -> 19.8) and 32-token pages gain nothing
// (16.4 -> 18.5, 52.4 -> 53.7, 175.5 -> 172.2). SGLANG_PRR_ATTN_PACK=1 packs pages of 16 or 32
// tokens on every grid, =0 never (measuring knobs read at each launch; a captured graph keeps its
// value).
int attn_pack(int page_size, int64_t rows, int N) {
  const char* k = getenv("SGLANG_PRR_ATTN_PACK");
  const bool force = k && !strcmp(k, "1"), never = k && !strcmp(k, "0");
  if (never || page_size >= kChunk || page_size % kSlice != 0 || kChunk % page_size != 0)
    return 1;
  const int P = kChunk / page_size;  // pages of 16 or 32 tokens (powers of two below the chunk)
  if (!force && (page_size != kSlice || !attn_takes_split_merge(rows * N))) return 1;
  return row_ctas(N, P) <= 65535 ? P : 1;  // the packed grid's y
}

// The merge kernel's shared memory for its row stage (one CTA per group and few groups, so it
// may take most of an SM: every entry of a K = 2048-token list in one round trip).
constexpr size_t kMergeKernelSmem = 160 * 1024;

template <typename T, int D>
cudaError_t attn_launch(const AttnArgs& a, int nq, cudaStream_t s) {
  const int stages = a.page_size > kChunk ? 2 : 1;
  size_t smem = (size_t)stages * AttnSmem<T, D>::kStageBytes +
                (size_t)nq * kHeadsN * AttnSmem<T, D>::kQRow * sizeof(T);
  AttnArgs c = a;
  c.spread = 0;
  c.pack = attn_pack(a.page_size, (int64_t)a.B * a.Hk, a.N);
  const int64_t ctas = (int64_t)a.B * a.Hk * row_ctas(a.N, c.pack);
  // Where the grid is several waves, the partials in one launch without counters, tickets or
  // merge tail (the attention's own shared memory, so 5 CTAs an SM instead of 4), then
  // attn_merge_kernel; else the group's last CTA merges (the fused tail, a launch fewer). Cold L2
  // at 2048 tokens (run 16): 45.6 -> 38.0 us at batch 8 and 138.8 -> 110.9 at batch 32, while a
  // repair over |M| = 1 at batch 1 costs 11.9 fused against 13.1 split.
  // A fused merge is spread over the group's CTAs where the grid is one wave (launch_partials),
  // else the group's last CTA merges after its ticket.
  // SGLANG_PRR_ATTN_MERGE=split|fused forces one (a measuring knob, read at each launch), and
  // =ticket keeps a fused merge in the group's last CTA on one-wave grids too.
  const char* mk = getenv("SGLANG_PRR_ATTN_MERGE");
  const bool ticket = mk && !strcmp(mk, "ticket");
  const bool force_split = mk && !strcmp(mk, "split"), force_fused = mk && !strcmp(mk, "fused");
  const bool split_merge =
      a.sem && (force_split || (!force_fused && attn_takes_split_merge(ctas)));
  if (split_merge) c.sem = nullptr;
  if (a.sem) {
    // The merge tail's row stage: as many entries a round as fit beside its arrays in the larger
    // of the attention's shared memory and merge_smem_budget, at least one, at most every entry
    // (split off: as many as the merge kernel's shared memory takes, at most every entry of a
    // CTA's share of the items).
    const int N1 = a.o1 ? a.N1 : 0, G = a.Hq / a.Hk, E = a.N + N1;
    const size_t arrays = merge_arrays_bytes(a.N, N1, a.Na, G);
    const size_t per = (size_t)G * D * sizeof(float);  // one entry's rows of the group
    const size_t budget =
        split_merge ? kMergeKernelSmem
                    : std::max(smem, merge_smem_budget(ctas));
    const size_t fit = budget > arrays ? (budget - arrays) / per : 0;
    // The merge kernel's CTAs each take 1 / S of the items: the entries of a round are counted
    // in whole rows, so ceil(E / S) of them hold every entry of a CTA's range.
    const int splits = split_merge ? merge_splits((int64_t)a.B * a.Hk, G * (D / 4)) : 1;
    const int want = (std::max(E, 1) + splits - 1) / splits;
    c.merge_rows = (int)std::min<size_t>(std::max<size_t>(fit, 1), (size_t)want);
    const size_t merge_bytes = arrays + (size_t)c.merge_rows * per;
    if (split_merge) {
      cudaError_t e = set_smem_limit(attn_merge_kernel, merge_bytes);
      if (e != cudaSuccess) return e;
      e = launch_partials<T, D>(c, nq, smem, false, s);
      if (e != cudaSuccess) return e;
      launch_kernel(attn_merge_kernel, dim3(a.Hk, a.B, splits), kAttnThreads, merge_bytes, s, c);
      return cudaGetLastError();
    }
    smem = std::max(smem, merge_bytes);
    // A spread merge's waiting CTA withdraws after this many clocks (about 66 us at 2 GHz, far
    // beyond a wave's partials; SGLANG_PRR_ATTN_SPREAD_WAIT=<clocks> sets it, 0 withdraws at
    // once: a testing knob read at each launch, a captured graph keeps its value).
    const char* sw = getenv("SGLANG_PRR_ATTN_SPREAD_WAIT");
    c.spread_wait = sw ? std::max(0, atoi(sw)) : (1 << 17);
  }
  return launch_partials<T, D>(c, nq, smem, !ticket, s);
}

template <typename T>
cudaError_t attn_dispatch_d(const AttnArgs& args, cudaStream_t s) {
  // q in the KV dtype is exact in one part; another 16-bit dtype needs two, float32 three.
  const int nq = args.q_dtype == args.kv_dtype ? 1 : (args.q_dtype == kF32 ? 3 : 2);
  // Timing probes of the merge tail's stages (development only).
  static const int stop = debug_stop_env("SGLANG_PRR_ATTN_DEBUG_STOP");
  AttnArgs a = args;
  a.debug_stop = stop;
  switch (a.D) {
    case 64: return attn_launch<T, 64>(a, nq, s);
    case 128: return attn_launch<T, 128>(a, nq, s);
    case 256: return attn_launch<T, 256>(a, nq, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool launches_with_pdl() { return pdl_enabled(); }

int64_t attn_spread_launches() { return g_spread_launches.load(); }

cudaError_t launch_sparse_attn_partials(const AttnArgs& a, cudaStream_t s) {
  if (a.Hq % a.Hk != 0 || a.Hq / a.Hk > kMaxGroup) return cudaErrorInvalidValue;
  if (a.B == 0 || a.N == 0 || a.Hk == 0) return cudaSuccess;
  switch (a.kv_dtype) {
    case kF16: return attn_dispatch_d<__half>(a, s);
    case kBF16: return attn_dispatch_d<__nv_bfloat16>(a, s);
    default: return cudaErrorInvalidValue;  // float32 KV: the reference (see kernels/dispatch.py)
  }
}

}  // namespace prr
