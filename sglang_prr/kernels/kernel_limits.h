// The kernels' size limits that the Python dispatch checks too: each is defined here once, and
// sglang_prr/kernels/limits.py reads this file (a shape past a limit runs the reference instead
// of a launch that would fail). Keep each as `constexpr int kName = <integer expression>;`.
// Not named limits.h: the build puts this folder on the include path, where <climits>'s own
// #include <limits.h> would find it instead of the C library's.
#pragma once

namespace prr {

// Largest GQA group (query heads per KV head) of the attention and Quest selection kernels:
// the n = 8 of the attention's MMAs.
constexpr int kMaxGroup = 8;
// Largest GQA group of infllm_scores.
constexpr int kInfllmMaxGroup = 8;
// Blocks per row that the top-K, the predictor and the fused selection hold in shared memory
// (4-byte keys: 192 KiB, 786K tokens at block 16).
constexpr int kTopkMaxBlocks = 48 * 1024;
// Blocks per row of calib_grid_terms: a candidate's level, trend and key (12 bytes per block)
// in 200 KiB of shared memory.
constexpr int kCalibMaxBlocks = 200 * 1024 / 12;

}  // namespace prr
