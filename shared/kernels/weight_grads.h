// Weight gradients of rows grouped by expert, for the bindings of the row kernel's library: for each expert e,
//   out[e][n, k] = sum over its rows r in [start[e], end[e]) of left[r, n] * right[right_row[r], k]
// ([N] by [K] outer products), in float32 and rounded to bfloat16 once, written straight into the [E, N, K]
// gradient; the experts without rows are zeros (ZeroIdle, a run of consecutive ones at a time: pages not in memory
// released, the others written; zero_pages.h). No float32 [N, K] per expert in memory, no second pass to round it,
// and no zeros written under an expert's products. The thread that takes an expert's first unit maps its whole
// gradient's pages for writing first (PopulateForWriting: XLA's large buffers are fresh pages unless the allocator
// keeps freed ones). A jitted qwen3-cpu training step on the 2-core EPYC, JAX grouped_mm, four processes each,
// alternating, medians of 15 steps: T=8 45.0-49.3 against 47.6-53.7 ms, T=16 68.9-85.3 against 73.1-81.1 (about 4%
// by the middle medians, 10% by the fastest steps: a small gain within this host's spread).
// Rows go in pairs through AVX512-BF16 dot products (each pair's right rows interleaved once per unit of work, a
// missing second row as zeros), so the sums are of exact bfloat16 products, a pair at a time, in row order: the
// same bits on every run. A unit of work is one expert's kGradRows output rows; the threads that run a job share
// its units.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "zero_pages.h"

namespace moe_rows {

constexpr int64_t kGradRows = 16;     // output rows (n) per unit of work
constexpr int64_t kGradVectors = 16;  // 16-column vectors per pass over an output row (256 columns)

struct WeightGradShape {
  const uint16_t* left;       // [*, N] bfloat16, row stride N
  const uint16_t* right;      // [*, K] bfloat16, row stride K
  const int32_t* right_row;   // the right row of each left row
  const int32_t* start;       // [E]
  const int32_t* end;         // [E]
  uint16_t* out;              // [E, N, K] bfloat16
  int64_t E, N, K;
};

class WeightGradsJob {
 public:
  explicit WeightGradsJob(const WeightGradShape& s)
      : s_(s), units_per_expert_((s.N + kGradRows - 1) / kGradRows), units_(s.E * units_per_expert_) {}

  int64_t units() const { return units_; }

  void Run() {
    std::vector<uint32_t> packed;  // this thread's interleaved right rows
    for (int64_t u; (u = next_.fetch_add(1)) < units_;) {
      Unit(u / units_per_expert_, u % units_per_expert_ * kGradRows, packed);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // zeros for out[e] of every expert e without rows
  void ZeroIdle() const {
    const size_t expert_bytes = static_cast<size_t>(s_.N * s_.K) * sizeof(uint16_t);
    int hit = 0;
    for (int64_t e = 0; e < s_.E; ++e) hit += s_.end[e] > s_.start[e];
    if (hit == s_.E) return;
    const bool releasable = Releasable(s_.out, static_cast<size_t>(s_.E) * expert_bytes);
    for (int64_t e = 0; e < s_.E;) {
      int64_t idle_end = e;
      while (idle_end < s_.E && s_.end[idle_end] <= s_.start[idle_end]) ++idle_end;
      if (idle_end > e)
        ZeroBytes(s_.out + e * s_.N * s_.K, static_cast<size_t>(idle_end - e) * expert_bytes, releasable);
      e = idle_end + 1;
    }
  }

  void Wait() const {
    while (done_.load(std::memory_order_acquire) < units_) _mm_pause();
  }

 private:
  // out[e] rows [n0, n0 + kGradRows)
  void Unit(int64_t e, int64_t n0, std::vector<uint32_t>& packed) const {
    const int64_t N = s_.N, K = s_.K, n1 = n0 + kGradRows < N ? n0 + kGradRows : N;
    uint16_t* out = s_.out + e * N * K;
    const int64_t first = s_.start[e], rows = s_.end[e] - first;
    if (rows <= 0) return;
    if (n0 == 0) PopulateForWriting(out, static_cast<size_t>(N * K) * sizeof(uint16_t));
    const int64_t pairs = (rows + 1) / 2, width = (K + 15) / 16 * 16;  // columns per packed pair, padded
    packed.resize(static_cast<size_t>(pairs * width));
    for (int64_t p = 0; p < pairs; ++p) Interleave(first + 2 * p, 2 * p + 1 < rows, packed.data() + p * width);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t c0 = 0; c0 < width; c0 += kGradVectors * 16) {
        const int64_t vectors = (width - c0) / 16 < kGradVectors ? (width - c0) / 16 : kGradVectors;
        __m512 acc[kGradVectors];
        for (int64_t v = 0; v < vectors; ++v) acc[v] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
          const int64_t r = first + 2 * p;
          const uint32_t lo = s_.left[r * N + n], hi = 2 * p + 1 < rows ? s_.left[(r + 1) * N + n] : 0;
          const __m512bh pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(lo | hi << 16)));
          const uint32_t* from = packed.data() + p * width + c0;
          for (int64_t v = 0; v < vectors; ++v)
            acc[v] = _mm512_dpbf16_ps(acc[v], reinterpret_cast<__m512bh>(_mm512_loadu_si512(from + v * 16)), pair);
        }
        for (int64_t v = 0; v < vectors; ++v) {
          const int64_t k = c0 + v * 16;
          const __mmask32 lanes = static_cast<__mmask32>(K - k >= 16 ? 0xffff : (1u << (K - k)) - 1);
          const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[v]));
          _mm512_mask_storeu_epi16(out + n * K + k, lanes, _mm512_castsi256_si512(rounded));
        }
      }
    }
  }

  // the right rows of left rows r and r + 1 (zeros for the second without `second`), k by k: (row r, row r + 1)
  // pairs as uint32, `width` of them (zeros past K)
  void Interleave(int64_t r, bool second, uint32_t* to) const {
    const int64_t K = s_.K, width = (K + 15) / 16 * 16;
    const uint16_t* a = s_.right + static_cast<int64_t>(s_.right_row[r]) * K;
    const uint16_t* b = second ? s_.right + static_cast<int64_t>(s_.right_row[r + 1]) * K : nullptr;
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                          22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t k = 0; k < width; k += 32) {
      const __mmask32 lanes = K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1ull << (K - k)) - 1);
      const __m512i x = _mm512_maskz_loadu_epi16(lanes, a + k);
      const __m512i y = b != nullptr ? _mm512_maskz_loadu_epi16(lanes, b + k) : _mm512_setzero_si512();
      _mm512_storeu_si512(to + k, _mm512_permutex2var_epi16(x, low, y));
      if (k + 16 < width) _mm512_storeu_si512(to + k + 16, _mm512_permutex2var_epi16(x, high, y));
    }
  }

  WeightGradShape s_;
  int64_t units_per_expert_, units_;
  std::atomic<int64_t> next_{0}, done_{0};
};

}  // namespace moe_rows
