// The kernels' timing probe (development only), device side: compiled in only by a build with
// SGLANG_PRR_PROBES=1 (kernels/build.py), so the kernels of other builds hold none of its code.
// Where a launch asks for it (probe_setup in probe.cu: SGLANG_PRR_ATTN_TIMELINE=1 for the
// attention, SGLANG_PRR_SELECT_TIMELINE=1 for the one-pass selection), thread 0 of every CTA
// records, per slot, the SM's clock64 at each link of its chain (phase lengths within a CTA),
// %globaltimer (ns, one clock for every SM) at entry and exit, its SM and its id. A slot the CTA
// never reaches stays 0. `Args` is any kernel argument struct with `timeline` (the records, null
// when off) and `timeline_ctas`.
#pragma once
#include "prr_kernels.h"

namespace prr {
namespace {

#ifdef SGLANG_PRR_PROBES
constexpr bool kProbes = true;
#else
constexpr bool kProbes = false;
#endif

// The slots every probed kernel fills the same way (the readers' dispatch and span); a kernel's
// own links take the other slots of its kTimelineSlots (attn_block.cuh, select_predict.cu).
enum ProbeSlot { kTlEntryNs = 0, kTlSm = 1, kTlEntry = 2, kTlExit = 9, kTlExitNs = 10, kTlId = 11 };

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// This CTA's record (thread 0's copy of the pointer, set by probe_entry; null past the buffer),
// kept in shared memory so that each stamp is a few instructions.
__device__ __forceinline__ unsigned long long*& timeline_record() {
  __shared__ unsigned long long* rec;
  return rec;
}

// Slot `slot` of this CTA's record: `v`, or the clock when v is ~0ull.
template <typename Args>
__device__ __forceinline__ void stamp(const Args& a, int slot, unsigned long long v = ~0ull) {
  if (!kProbes || a.timeline == nullptr || threadIdx.x != 0) return;
  unsigned long long* rec = timeline_record();
  if (rec) rec[slot] = v == ~0ull ? (unsigned long long)clock64() : v;
}

// The entry stamps: the CTA's record, the global time, the SM, `id` (the kernel's packing of the
// CTA's coordinates) and the clock.
template <typename Args>
__device__ __forceinline__ void probe_entry(const Args& a, unsigned long long id) {
  if (!kProbes || a.timeline == nullptr) return;
  if (threadIdx.x == 0) {
    const int64_t cta =
        blockIdx.x + (int64_t)gridDim.x * (blockIdx.y + (int64_t)gridDim.y * blockIdx.z);
    timeline_record() = cta < a.timeline_ctas ? a.timeline + cta * kTimelineSlots : nullptr;
  }
  unsigned sm;
  asm("mov.u32 %0, %%smid;" : "=r"(sm));
  stamp(a, kTlEntryNs, global_ns());
  stamp(a, kTlSm, sm);
  stamp(a, kTlId, id);
  stamp(a, kTlEntry);
}

// The exit stamps (every return of a probed kernel after probe_entry).
template <typename Args>
__device__ __forceinline__ void probe_exit(const Args& a) {
  if (!kProbes || a.timeline == nullptr) return;
  stamp(a, kTlExit);
  stamp(a, kTlExitNs, global_ns());
}

}  // namespace
}  // namespace prr
