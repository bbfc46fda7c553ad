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
// Rows go in pairs through AVX512-BF16 dot products (a missing second row as zeros), so the sums are of exact
// bfloat16 products, a pair at a time, in row order: the same bits on every run. A unit of work is one expert's
// kGradRows output rows; the threads that run a job share its units. Within one, kGradTileRows rows by
// kGradTileColumns columns are summed in registers (each pair's right rows interleaved in registers, the sums'
// columns put back in order when stored) and stored non-temporally where aligned: the gradient is written once and
// read later, so its lines are not read for ownership first. On the 2-core EPYC (a C++ harness, 2 threads,
// qwen3-cpu's gate/up gradient [64, 768, 1024]), against one output row at a time from rows interleaved in memory:
// 8 rows per expert 6.6-7.6 against 9.9-12.0 ms, 32 rows 13.4-15.5 against 27.6-28.3, 64 rows 21-23 against 48-53;
// the same bits.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "expert_rows.h"
#include "zero_pages.h"

namespace moe_rows {

constexpr int64_t kGradRows = 16;         // output rows (n) per unit of work
constexpr int64_t kGradTileRows = 4;      // output rows per register block
constexpr int64_t kGradTileColumns = 64;  // output columns per register block

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

  int64_t chunks() const { return units_; }  // units of work, as the other jobs call them

  void Run() {
    std::vector<uint32_t> left_pairs;  // this thread's
    for (int64_t u; (u = next_.fetch_add(1)) < units_;) {
      Unit(u / units_per_expert_, u % units_per_expert_ * kGradRows, left_pairs);
      _mm_sfence();  // the unit's non-temporal stores seen before it counts as done
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
  // out[e] rows [n0, n0 + kGradRows): kGradTileRows rows by kGradTileColumns columns at a time, the sums in
  // registers; each row pair's right rows are interleaved in registers (PairLanes order, put back when stored)
  void Unit(int64_t e, int64_t n0, std::vector<uint32_t>& left_pairs) const {
    const int64_t N = s_.N, K = s_.K, n1 = n0 + kGradRows < N ? n0 + kGradRows : N;
    uint16_t* out = s_.out + e * N * K;
    const int64_t first = s_.start[e], rows = s_.end[e] - first;
    if (rows <= 0) return;
    if (n0 == 0) PopulateForWriting(out, static_cast<size_t>(N * K) * sizeof(uint16_t));
    const int64_t pairs = (rows + 1) / 2;
    left_pairs.assign(static_cast<size_t>(pairs * kGradRows), 0);
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* lo = s_.left + (first + 2 * p) * N;
      const uint16_t* hi = 2 * p + 1 < rows ? lo + N : nullptr;
      for (int64_t n = n0; n < n1; ++n)
        left_pairs[p * kGradRows + n - n0] = lo[n] | (hi != nullptr ? static_cast<uint32_t>(hi[n]) << 16 : 0u);
    }
    const __m512i order[2] = {PairLanes(0), PairLanes(16)};
    for (int64_t k0 = 0; k0 < K; k0 += kGradTileColumns) {
      const __mmask32 lanes0 = FirstLanes32(K - k0), lanes1 = FirstLanes32(K - k0 - 32);
      for (int64_t nb = n0; nb < n1; nb += kGradTileRows) {
        __m512 acc[kGradTileRows][4];  // [row][lo, hi of columns k0 ..; lo, hi of k0 + 32 ..]
        for (auto& row : acc)
          for (auto& a : row) a = _mm512_setzero_ps();
        const uint32_t* pair_of = left_pairs.data() + (nb - n0);
        auto step = [&](int64_t p, bool second) __attribute__((always_inline)) {
          const int64_t r = first + 2 * p;
          const uint16_t* a = s_.right + static_cast<int64_t>(s_.right_row[r]) * K + k0;
          const __m512i a0 = _mm512_maskz_loadu_epi16(lanes0, a), a1 = _mm512_maskz_loadu_epi16(lanes1, a + 32);
          __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
          if (second) {
            const uint16_t* b = s_.right + static_cast<int64_t>(s_.right_row[r + 1]) * K + k0;
            b0 = _mm512_maskz_loadu_epi16(lanes0, b), b1 = _mm512_maskz_loadu_epi16(lanes1, b + 32);
          }
          const __m512bh v0 = (__m512bh)_mm512_unpacklo_epi16(a0, b0), v1 = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
          const __m512bh v2 = (__m512bh)_mm512_unpacklo_epi16(a1, b1), v3 = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
          for (int64_t i = 0; i < kGradTileRows; ++i) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of[p * kGradRows + i]));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], v0, pair);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], v1, pair);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], v2, pair);
            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], v3, pair);
          }
        };
        for (int64_t p = 0; p < rows / 2; ++p) step(p, true);
        if (rows % 2) step(rows / 2, false);
        alignas(64) float sums[kGradTileRows][4][16];  // the registers' sums, in PairLanes order
#pragma GCC unroll 16
        for (int64_t i = 0; i < kGradTileRows; ++i)
#pragma GCC unroll 4
          for (int64_t j = 0; j < 4; ++j) _mm512_store_ps(sums[i][j], acc[i][j]);
        for (int64_t i = 0; i < kGradTileRows && nb + i < n1; ++i)
          for (int64_t k = k0; k < k0 + kGradTileColumns && k < K; k += 16) {
            const int64_t h = (k - k0) / 32;
            const __m512 ordered = _mm512_permutex2var_ps(_mm512_load_ps(sums[i][2 * h]), order[k % 32 / 16],
                                                          _mm512_load_ps(sums[i][2 * h + 1]));
            const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(ordered));
            uint16_t* to = out + (nb + i) * K + k;
            if (K - k >= 16 && reinterpret_cast<uintptr_t>(to) % 32 == 0)
              _mm256_stream_si256(reinterpret_cast<__m256i*>(to), rounded);
            else if (K - k >= 16)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), rounded);
            else
              _mm512_mask_storeu_epi16(to, FirstLanes16(K - k), _mm512_castsi256_si512(rounded));
          }
      }
    }
  }

  WeightGradShape s_;
  int64_t units_per_expert_, units_;
  std::atomic<int64_t> next_{0}, done_{0};
};

}  // namespace moe_rows
