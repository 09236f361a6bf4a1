// The kernels' timing probe (development only), host side: one device buffer of records, shared
// by the probed kernels (probe.cuh), holding the last probed launch's.
#include "probe.cuh"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace prr {
namespace {

constexpr int64_t kTimelineMaxCtas = 1 << 16;
unsigned long long* g_timeline = nullptr;  // allocated on first use
int64_t g_timeline_ctas = 0;

}  // namespace

cudaError_t probe_setup(const char* env, int64_t ctas, cudaStream_t s,
                        unsigned long long** timeline, int64_t* timeline_ctas) {
  *timeline = nullptr;
  *timeline_ctas = 0;
  if (!kProbes) return cudaSuccess;
  const char* v = getenv(env);
  if (!(v && !strcmp(v, "1"))) return cudaSuccess;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(s, &cap);
  if (e != cudaSuccess || cap != cudaStreamCaptureStatusNone) return e;
  constexpr size_t kRecord = kTimelineSlots * sizeof(unsigned long long);
  if (g_timeline == nullptr &&
      (e = cudaMalloc(&g_timeline, kTimelineMaxCtas * kRecord)) != cudaSuccess)
    return e;
  g_timeline_ctas = std::min(ctas, kTimelineMaxCtas);
  *timeline = g_timeline;
  *timeline_ctas = g_timeline_ctas;
  return cudaMemsetAsync(g_timeline, 0, g_timeline_ctas * kRecord, s);  // this launch's records
}

int64_t probe_timeline_ctas() { return g_timeline_ctas; }

int64_t probe_timeline_read(unsigned long long* host, int64_t max_ctas) {
  const int64_t n = std::min(g_timeline_ctas, max_ctas);
  if (g_timeline == nullptr || n <= 0) return 0;
  if (cudaMemcpy(host, g_timeline, (size_t)n * kTimelineSlots * sizeof(unsigned long long),
                 cudaMemcpyDeviceToHost) != cudaSuccess)
    return -1;
  return g_timeline_ctas;
}

}  // namespace prr
