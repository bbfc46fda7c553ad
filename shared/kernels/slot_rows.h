// The weighted combine of an MoE's down projection on the CPU, for the bindings of the row kernel's library:
// out[t] = sum_j w[t, j] * y[row[t * k + j]] over a token's k slots, reading the rows where they lie in expert
// order (no copy back to slot order first; SlotRows inverts the sort's order into `row`). bfloat16 y and weights:
// each product is exact in float32, and the sum runs in float32 in slot order from the first slot's product, then
// is rounded once to the output (bfloat16 ties to even, or float32), as a torch multiply-add loop over j does. A
// slot whose row is negative is empty: its term is +0 whatever y and its weight hold. Tokens are split into chunks
// that any number of threads take from an atomic counter (ChunkJob).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>

#include <immintrin.h>

namespace moe_rows {

// Units of work 0 .. chunks - 1, each run once by whichever thread takes it; Wait() returns when all are done.
class ChunkJob {
 public:
  ChunkJob(int64_t chunks, std::function<void(int64_t)> body) : chunks_(chunks), body_(std::move(body)) {}

  int64_t chunks() const { return chunks_; }

  void Run() {
    for (int64_t c; (c = next_.fetch_add(1)) < chunks_;) {
      body_(c);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void Wait() const {
    while (done_.load(std::memory_order_acquire) < chunks_) _mm_pause();
  }

 private:
  const int64_t chunks_;
  const std::function<void(int64_t)> body_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
};

constexpr int64_t kCombineChunkBytes = 64 << 10;  // bytes of output per unit of work

inline int64_t RowsPerChunk(int64_t row_bytes) {
  const int64_t rows = kCombineChunkBytes / (row_bytes > 0 ? row_bytes : 1);
  return rows > 0 ? rows : 1;
}

// row[s]: the row of y that holds slot s, from order[r] (the slot of row r, a permutation of 0 .. slots - 1); -1 for
// a slot whose empty[s] is set (empty may be null)
inline void SlotRows(const int64_t* order, const bool* empty, int64_t slots, int64_t* row) {
  for (int64_t r = 0; r < slots; ++r) row[order[r]] = r;
  if (empty != nullptr)
    for (int64_t s = 0; s < slots; ++s)
      if (empty[s]) row[s] = -1;
}

struct CombineArgs {
  const uint16_t* y;        // bfloat16 [*, H], row stride y_stride
  int64_t y_stride;
  const int64_t* row;       // [T * k]: each slot's row of y, negative for an empty slot
  const uint16_t* weights;  // bfloat16 [T, k]
  void* out;                // [T, H], bfloat16 or float32
  bool out_float32;
  int64_t T, k, H;
};

inline __m512 Bfloat16Lanes(const uint16_t* p, __mmask16 lanes) {
  const __m256i half = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(lanes, p));  // AVX512BW: no VL needed
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// float32 to bfloat16 bits, ties to even, NaN as 0x7fc0 (torch's conversion; subnormals kept)
inline __m256i ToBfloat16Bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

inline float Bfloat16Value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

inline void CombineToken(const CombineArgs& a, int64_t t) {
  const int64_t H = a.H;
  for (int64_t h = 0; h < H; h += 16) {
    const __mmask16 lanes = H - h >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (H - h)) - 1);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.k; ++j) {
      const int64_t r = a.row[t * a.k + j];
      __m512 term = _mm512_setzero_ps();
      if (r >= 0)
        term = _mm512_mul_ps(Bfloat16Lanes(a.y + r * a.y_stride + h, lanes),
                             _mm512_set1_ps(Bfloat16Value(a.weights[t * a.k + j])));
      sum = j == 0 ? term : _mm512_add_ps(sum, term);
    }
    if (a.out_float32)
      _mm512_mask_storeu_ps(static_cast<float*>(a.out) + t * H + h, lanes, sum);
    else
      _mm512_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + t * H + h, lanes,
                               _mm512_castsi256_si512(ToBfloat16Bits(sum)));
  }
}

inline void CombineChunk(const CombineArgs& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) CombineToken(a, t);
}

}  // namespace moe_rows
