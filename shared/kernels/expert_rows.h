// The CPU row kernel, shared by both frameworks' bindings (moe_jax/expert_rows.cc, an XLA FFI handler on XLA's
// intra-op pool; moe_torch/expert_rows.cc, a C entry point on torch's OpenMP team).
//
// One job is a list of groups sharing N and K: group g computes out_g[b, n] = sum_k x_g[b, k] * w_g[n, k] in
// float32 for its `rows` rows b, with the expert's bfloat16 weights w_g [N, K] read where they lie (a slice of a
// stacked [E, N, K] tensor: nothing is copied). Two ways:
// - AMX: tiles of 16 weight rows by 32 k, loaded in place, times x's rows packed in pairs of k (the B operand's
//   layout), 32 weight rows by 32 x rows at a time (four accumulator tiles); a tail of under 16 weight rows and
//   a k width that is not a multiple of 32 take the AVX512 way.
// - AVX512-BF16 dot products, 4 x rows by 4 weight rows per step.
// A job's work is packing its groups' x tiles (AMX), then its groups' weight rows in chunks of 64; the threads that
// run it share both. Outputs are stored as float32 rows, or (Group::add_row) rounded to bfloat16, scaled and added
// into rows of a float32 array: the weighted combine of an MoE's down projection, in the same call.
//
// Transposed jobs (Shape::transposed) compute the other orientation, out_g[b, k] = sum_n x_g[b, n] * w_g[n, k]
// (x rows [rows, N], outputs [rows, K]: the VJP with respect to x), on the same weights in place, in chunks of up
// to 128 output columns (TransposedChunkColumns). A bfloat16 dot product takes pairs along n, so each pair of weight
// rows (n, n + 1) is interleaved (unpacklo/unpackhi: the sums come out with their columns permuted within 32, put
// back in order when stored):
// - AMX: a block of 128 weight rows by the chunk's columns is interleaved into B tiles (32 KB of the thread's own
//   scratch, each weight read once per chunk), then x's rows, packed as A tiles of 16 rows by 32 n (zeros past the
//   rows and past N), run against them, 32 x rows by 32 columns at a time; the accumulator tiles go through memory
//   from one block to the next (exact). Any N and K. A group of kTransposedTile rows or fewer takes the AVX512 way.
// - AVX512-BF16 dot products on pairs interleaved in registers, 2 x rows by 128 columns per step, the weight rows
//   ahead prefetched.
// Both ways sum exact bfloat16 products in float32 (a pair of n, then across n in order; AMX tiles 32 n at a time),
// as the first orientation does: the ways agree to rounding, not bit for bit.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include <immintrin.h>

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "expert_rows.h is built with -mavx512f -mavx512bw -mavx512bf16 -mamx-tile -mamx-bf16"
#endif

namespace moe_rows {

constexpr int64_t kTile = 4;         // x rows and weight rows per register block
constexpr int64_t kChunkRows = 64;   // weight rows per unit of work shared between the threads
constexpr int64_t kAmxRows = 16;     // weight rows per AMX tile (and x rows per accumulator tile)
constexpr int64_t kAmxK = 32;        // k per AMX tile
// Transposed jobs: the most output columns per unit of work (each weight row read up to 256 bytes at a time: a
// single thread streamed qwen3-cpu's gate/up weights at 20 GB/s so, 12 at 128 bytes), x rows per AVX512 register
// block, and 32-row steps of weights per packed panel block (32 KB)
constexpr int64_t kChunkColumns = 128;
constexpr int64_t kTransposedTile = 2;
constexpr int64_t kPanelSteps = 4;
constexpr int64_t kPrefetchRows = 32;  // transposed AVX512 way: weight rows read ahead

struct Group {
  const uint16_t* x;  // [rows, K], row stride x_stride
  const uint16_t* w;  // [N, K], the expert's
  float* out;         // [rows, N], row stride N; with add_row a [*, N] array
  int64_t rows;
  int64_t x_stride;
  // With add_row, row b's outputs are rounded to bfloat16, multiplied by add_scale[b] and added into out row
  // add_row[b] (float32 products, then float32 sums, in row order) instead of stored. One thread runs all rows of a
  // chunk of outputs, so a job may accumulate one group only.
  const int32_t* add_row = nullptr;
  const float* add_scale = nullptr;
  uint32_t* packed = nullptr;  // AMX: x's rows as B tiles, written by the job (PackTile)
};

// float32 values rounded to the nearest bfloat16 (ties to even), as float32
inline __m512 RoundToBfloat16(__m512 v) {
  const __m256i half = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// outputs n .. n + 16 of row b (the lanes set in `lanes`)
inline void EmitRow(const Group& g, int64_t N, int64_t b, int64_t n, __m512 v, __mmask16 lanes) {
  if (g.add_row == nullptr) {
    _mm512_mask_storeu_ps(g.out + b * N + n, lanes, v);
    return;
  }
  float* to = g.out + static_cast<int64_t>(g.add_row[b]) * N + n;
  const __m512 term = _mm512_mul_ps(RoundToBfloat16(v), _mm512_set1_ps(g.add_scale[b]));
  _mm512_mask_storeu_ps(to, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, to), term));
}

// Weights [N, K] per group. A plain job's rows have K values and N outputs; a transposed job's N values and K
// outputs.
struct Shape {
  int64_t N, K;
  bool transposed = false;
  int64_t outputs() const { return transposed ? K : N; }
};

// lanes 0 .. 3: the sums of a, b, c and d's lanes, each added in _mm512_reduce_add_ps's order (the 256-bit halves,
// then the 128-bit ones, then lanes two apart, then adjacent ones: the same bits), in registers (sums stored one by
// one and loaded as a vector stall the load: qwen3-cpu forward at T=256 on the 2-core EPYC, 15% of the kernel's time)
inline __m512 Sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  const __m512 halves = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  const __m512 pairs = _mm512_add_ps(halves, _mm512_permute_ps(halves, 0x4e));
  const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xb1));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), sums);
}

static_assert(kTile == 4, "RowBlock sums four weight rows' accumulators at a time (Sum4)");

// x rows b .. b + kRows times the kWeights weight rows at wr (outputs n .. n + nn; rows past nn repeat row n and are
// not emitted). Each row's sums are the same whichever block takes it: kRows below kTile only for a group's last
// rows, kWeights 2 * kTile for a one-row group (twice the weight rows in flight).
template <int64_t kRows, int64_t kWeights = kTile>
__attribute__((always_inline)) inline void RowBlock(const Group& g, const Shape& s, const uint16_t* const* wr,
                                                   int64_t b, int64_t n, int64_t nn) {
  static_assert(kWeights % kTile == 0, "weight rows are emitted kTile at a time (Sum4)");
  const int64_t K = s.K, full = K / 32 * 32;
  const __mmask32 tail = K == full ? 0 : static_cast<__mmask32>((1ull << (K - full)) - 1);
  const uint16_t* xr[kRows];
  for (int64_t i = 0; i < kRows; ++i) xr[i] = g.x + (b + i) * g.x_stride;
  __m512 acc[kRows][kWeights];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  auto step = [&](auto load) {
    __m512bh wv[kWeights];
    for (int64_t j = 0; j < kWeights; ++j) wv[j] = load(wr[j]);
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512bh xv = load(xr[i]);
      for (int64_t j = 0; j < kWeights; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  };
  for (int64_t k = 0; k < full; k += 32)
    step([k](const uint16_t* r) { return (__m512bh)_mm512_loadu_si512(r + k); });
  if (tail) step([&](const uint16_t* r) { return (__m512bh)_mm512_maskz_loadu_epi16(tail, r + full); });
  for (int64_t i = 0; i < kRows; ++i)  // constant bounds: the sums stay in registers
    for (int64_t j = 0; j < kWeights && j < nn; j += kTile) {
      const int64_t lanes = nn - j < kTile ? nn - j : kTile;
      EmitRow(g, s.N, b + i, n + j, Sum4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]),
              static_cast<__mmask16>((1u << lanes) - 1));
    }
}

constexpr int64_t kSingleRowWeights = 2 * kTile;  // weight rows per block of a one-row group (a decode slot)

// A group's last rows take a block of their own count: a block of kTile x rows for one or two (a decode row, an
// expert's last rows) made the dot products of rows that were not emitted, four or two times the work (qwen3-cpu on
// the 2-core EPYC, torch batched_mm, a row per group: 0.84-0.87 against 0.98-1.05 ms at T=1, 41-43 against 48-52 at
// T=64). A one-row group takes blocks of kSingleRowWeights weight rows while a chunk has that many left.
inline void RowsOfChunk(const Group& g, const Shape& s, int64_t n0, int64_t n1) {
  const int64_t K = s.K;
  int64_t n = n0;
  if (g.rows == 1) {
    for (; n + kSingleRowWeights <= n1; n += kSingleRowWeights) {
      const uint16_t* wr[kSingleRowWeights];
      for (int64_t j = 0; j < kSingleRowWeights; ++j) wr[j] = g.w + (n + j) * K;
      RowBlock<1, kSingleRowWeights>(g, s, wr, 0, n, kSingleRowWeights);
    }
  }
  for (; n < n1; n += kTile) {
    const int64_t nn = n1 - n < kTile ? n1 - n : kTile;
    const uint16_t* wr[kTile];
    for (int64_t j = 0; j < kTile; ++j) wr[j] = g.w + (n + (j < nn ? j : 0)) * K;
    int64_t b = 0;
    for (; b + kTile <= g.rows; b += kTile) RowBlock<kTile>(g, s, wr, b, n, nn);
    switch (g.rows - b) {
      case 3: RowBlock<3>(g, s, wr, b, n, nn); break;
      case 2: RowBlock<2>(g, s, wr, b, n, nn); break;
      case 1: RowBlock<1>(g, s, wr, b, n, nn); break;
      default: break;
    }
  }
}

// tmm0, tmm1: weight tiles; tmm2, tmm3: packed x tiles; tmm4..7: accumulators, [weight tile][x tile], each 16
// weight rows by 16 x rows in float32
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) inline void LoadTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// r[i] (16 lanes of 32 bits each) -> r[j] holding lane j of every r[i]: interleave 32-bit then 64-bit pairs
// within 128-bit lanes, then gather the 128-bit lanes of the four row quads
inline void Transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // b[4q + j], lane L: rows 4q .. 4q + 3 at column 4L + j
  for (int q = 0; q < 16; q += 4) {
    b[q] = _mm512_unpacklo_epi64(a[q], a[q + 2]);
    b[q + 1] = _mm512_unpackhi_epi64(a[q], a[q + 2]);
    b[q + 2] = _mm512_unpacklo_epi64(a[q + 1], a[q + 3]);
    b[q + 3] = _mm512_unpackhi_epi64(a[q + 1], a[q + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xdd);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(c0, c2, 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(c1, c3, 0xdd);
  }
}

// x tile t of a group as B tiles: for each k chunk c, 16 k pairs by 16 rows, each pair two bfloat16 (one uint32);
// rows past the group's are zeros
inline void PackTile(const Group& g, int64_t K, int64_t t) {
  const int64_t chunks = K / kAmxK;
  uint32_t* tile = g.packed + t * chunks * 256;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t b = t * kAmxRows + i;
      r[i] = b < g.rows ? _mm512_loadu_si512(g.x + b * g.x_stride + c * kAmxK) : _mm512_setzero_si512();
    }
    Transpose16(r);
    for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(tile + c * 256 + p * 16, r[p]);
  }
}

// 16 * kWeightTiles weight rows from n by 16 * kXTiles x rows from x tile t0
template <int kWeightTiles, int kXTiles>
__attribute__((target("amx-tile,amx-bf16"))) void AmxPass(const Group& g, const Shape& s, int64_t n, int64_t t0) {
  const int64_t chunks = s.K / kAmxK, stride = s.K * 2;
  const uint32_t* b = g.packed + t0 * chunks * 256;
  _tile_zero(4);
  if (kXTiles > 1) _tile_zero(5);
  if (kWeightTiles > 1) _tile_zero(6);
  if (kWeightTiles > 1 && kXTiles > 1) _tile_zero(7);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* w = g.w + n * s.K + c * kAmxK;
    _tile_loadd(0, w, stride);
    _tile_loadd(2, b + c * 256, 64);
    if (kWeightTiles > 1) _tile_loadd(1, w + kAmxRows * s.K, stride);
    if (kXTiles > 1) _tile_loadd(3, b + (chunks + c) * 256, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (kXTiles > 1) _tile_dpbf16ps(5, 0, 3);
    if (kWeightTiles > 1) _tile_dpbf16ps(6, 1, 2);
    if (kWeightTiles > 1 && kXTiles > 1) _tile_dpbf16ps(7, 1, 3);
  }
  alignas(64) float acc[4][kAmxRows * 16];
  _tile_stored(4, acc[0], 64);
  if (kXTiles > 1) _tile_stored(5, acc[1], 64);
  if (kWeightTiles > 1) _tile_stored(6, acc[2], 64);
  if (kWeightTiles > 1 && kXTiles > 1) _tile_stored(7, acc[3], 64);
  // acc[tile] is 16 weight rows by 16 x rows: transposed, each x row's 16 outputs are one store
  for (int64_t wt = 0; wt < kWeightTiles; ++wt)
    for (int64_t xt = 0; xt < kXTiles; ++xt) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_load_si512(acc[wt * 2 + xt] + i * 16);
      Transpose16(r);
      for (int64_t i = 0; i < 16 && (t0 + xt) * 16 + i < g.rows; ++i)
        EmitRow(g, s.N, (t0 + xt) * 16 + i, n + wt * kAmxRows, _mm512_castsi512_ps(r[i]), 0xffff);
    }
}

template <int kWeightTiles>
void AmxWeightRows(const Group& g, const Shape& s, int64_t n, int64_t tiles) {
  for (int64_t t0 = 0; t0 < tiles; t0 += 2)
    if (tiles - t0 > 1)
      AmxPass<kWeightTiles, 2>(g, s, n, t0);
    else
      AmxPass<kWeightTiles, 1>(g, s, n, t0);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void AmxRowsOfChunk(const Group& g, const Shape& s, int64_t n0,
                                                                        int64_t n1) {
  const int64_t tiles = (g.rows + kAmxRows - 1) / kAmxRows;
  LoadTiles();
  int64_t n = n0;
  for (; n + 2 * kAmxRows <= n1; n += 2 * kAmxRows) AmxWeightRows<2>(g, s, n, tiles);
  for (; n + kAmxRows <= n1; n += kAmxRows) AmxWeightRows<1>(g, s, n, tiles);
  _tile_release();
  if (n < n1) RowsOfChunk(g, s, n, n1);
}

// --- transposed jobs: out[b, k] = sum_n x[b, n] * w[n, k] ---

// the first `count` of 32 (or 16) lanes
inline __mmask32 FirstLanes32(int64_t count) {
  return count >= 32 ? ~__mmask32{0} : count <= 0 ? 0 : static_cast<__mmask32>((1ull << count) - 1);
}
inline __mmask16 FirstLanes16(int64_t count) {
  return count >= 16 ? __mmask16{0xffff} : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// Weight rows n and n + 1, 32 columns each, interleaved by _mm512_unpacklo_epi16 ("lo") and _mm512_unpackhi_epi16
// ("hi") hold the column pairs 8L .. 8L + 3 (lo) and 8L + 4 .. 8L + 7 (hi) in dwords 4L .. 4L + 3 of 128-bit lane
// L. Sums over such pairs come out in the same order; for a two-source permute of (lo, hi), the dwords holding
// columns first .. first + 15 (first 0 or 16), in order.
struct PairLaneTable {
  alignas(64) int32_t lanes[2][16];
};

constexpr PairLaneTable MakePairLanes() {
  PairLaneTable table{};
  for (int half = 0; half < 2; ++half)
    for (int j = 0; j < 16; ++j) {
      const int column = 16 * half + j, lane = column / 8, within = column % 8;
      table.lanes[half][j] = within < 4 ? 4 * lane + within : 16 + 4 * lane + within - 4;
    }
  return table;
}

// made once, at compile time (lanes written one by one and loaded as a vector stall the load)
inline constexpr PairLaneTable kPairLanes = MakePairLanes();

inline __m512i PairLanes(int first) { return _mm512_load_si512(kPairLanes.lanes[first / 16]); }

// x[n] and x[n + 1] as one dword (the pair a bfloat16 dot product takes); x[n] alone where n + 1 is N
inline uint32_t PairAt(const uint16_t* x, int64_t n, int64_t N) {
  if (n + 1 == N) return x[n];
  uint32_t pair;
  __builtin_memcpy(&pair, x + n, sizeof pair);
  return pair;
}

// row b's outputs k .. k + 31 (up to k1) from its lo and hi sums
inline void EmitPairs(const Group& g, int64_t K, int64_t b, int64_t k, int64_t k1, __m512 lo, __m512 hi) {
  EmitRow(g, K, b, k, _mm512_permutex2var_ps(lo, PairLanes(0), hi), FirstLanes16(k1 - k));
  if (k1 - k > 16) EmitRow(g, K, b, k + 16, _mm512_permutex2var_ps(lo, PairLanes(16), hi), FirstLanes16(k1 - k - 16));
}

static_assert(kChunkColumns <= 128, "a transposed chunk's columns are at most 128 (8 vectors per x row)");

// outputs k0 .. k1 (at most kChunkColumns) of every row, kTransposedTile x rows at a time, each weight row pair
// interleaved in registers; the rows kPrefetchRows ahead are asked for as they go (each row is read 256 bytes at a
// time, too little for the hardware's prefetchers: qwen3-cpu gate/up weights, one row, 310 against 125 us)
inline void TransposedRowsOfChunk(const Group& g, const Shape& s, int64_t k0, int64_t k1) {
  constexpr int64_t kGroups = kChunkColumns / 32;
  const int64_t N = s.N, K = s.K, groups = (k1 - k0 + 31) / 32, bytes = (k1 - k0) * 2;
  __mmask32 lanes[kGroups];
  for (int64_t h = 0; h < kGroups; ++h) lanes[h] = FirstLanes32(k1 - k0 - 32 * h);
  for (int64_t b = 0; b < g.rows; b += kTransposedTile) {
    const int64_t bb = g.rows - b < kTransposedTile ? g.rows - b : kTransposedTile;
    const uint16_t* xr[kTransposedTile];
    for (int64_t i = 0; i < kTransposedTile; ++i) xr[i] = g.x + (b + (i < bb ? i : 0)) * g.x_stride;
    __m512 acc[kTransposedTile][2 * kGroups];  // [row][lo, hi of each 32 columns]
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t n = 0; n < N; n += 2) {
      const uint16_t* w0 = g.w + n * K + k0;
      const bool pair = n + 1 < N;
      if (n + kPrefetchRows + 1 < N) {
        const char* ahead = reinterpret_cast<const char*>(w0 + kPrefetchRows * K);
        for (int64_t line = 0; line < bytes; line += 64) {
          _mm_prefetch(ahead + line, _MM_HINT_T0);
          _mm_prefetch(ahead + 2 * K + line, _MM_HINT_T0);
        }
      }
      __m512bh xv[kTransposedTile];
      for (int64_t i = 0; i < kTransposedTile; ++i)
        xv[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(PairAt(xr[i], n, N)));
      for (int64_t h = 0; h < kGroups; ++h) {  // all of them (zeros past k1): the sums stay in registers
        const __m512i r0 = _mm512_maskz_loadu_epi16(lanes[h], w0 + 32 * h);
        const __m512i r1 = pair ? _mm512_maskz_loadu_epi16(lanes[h], w0 + K + 32 * h) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1), hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        for (int64_t i = 0; i < kTransposedTile; ++i) {
          acc[i][2 * h] = _mm512_dpbf16_ps(acc[i][2 * h], lo, xv[i]);
          acc[i][2 * h + 1] = _mm512_dpbf16_ps(acc[i][2 * h + 1], hi, xv[i]);
        }
      }
    }
    for (int64_t i = 0; i < kTransposedTile; ++i)  // constant bounds, as above
      for (int64_t h = 0; h < kGroups; ++h)
        if (i < bb && h < groups) EmitPairs(g, K, b + i, k0 + 32 * h, k1, acc[i][2 * h], acc[i][2 * h + 1]);
  }
}

// x tile t of a transposed job's group as A tiles: for each n chunk c, 16 rows by 32 n at packed + (t * chunks +
// c) * 256; zeros past the group's rows and past N
inline void PackRowsTile(const Group& g, int64_t N, int64_t t) {
  const int64_t chunks = (N + kAmxK - 1) / kAmxK;
  uint32_t* tile = g.packed + t * chunks * 256;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask32 lanes = FirstLanes32(N - c * kAmxK);
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t b = t * kAmxRows + i;
      const __m512i r = b < g.rows ? _mm512_maskz_loadu_epi16(lanes, g.x + b * g.x_stride + c * kAmxK)
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(tile + c * 256 + i * 16, r);
    }
  }
}

// A thread's scratch for transposed AMX chunks, kept for its later chunks: the panel (a block of weight rows as B
// tiles) and the accumulator tiles carried from one block to the next.
struct TransposedScratch {
  std::unique_ptr<uint32_t[]> panel;
  std::unique_ptr<float[]> acc;
  int64_t acc_size = 0;
};

inline TransposedScratch& ScratchFor(int64_t acc_size) {
  thread_local TransposedScratch scratch;
  if (!scratch.panel) scratch.panel.reset(new uint32_t[kChunkColumns / 16 * kPanelSteps * 256]);
  if (scratch.acc_size < acc_size) scratch.acc.reset(new float[acc_size]), scratch.acc_size = acc_size;
  return scratch;
}

// columns k0 .. k1 (at most kChunkColumns) of weight rows 32 c0 .. 32 c1 as B tiles, two per 32 columns h: the lo
// and hi pairs (PairLanes) of n chunk c at panel + ((2h + hi) * steps + c - c0) * 256, row p holding those of weight
// rows 32c + 2p and 32c + 2p + 1; zeros past N and past k1
inline void PackPanel(const Group& g, const Shape& s, int64_t k0, int64_t k1, int64_t c0, int64_t c1,
                      uint32_t* panel) {
  constexpr int64_t kGroups = kChunkColumns / 32;
  const int64_t N = s.N, K = s.K, steps = c1 - c0, groups = (k1 - k0 + 31) / 32;
  __mmask32 lanes[kGroups];
  for (int64_t h = 0; h < kGroups; ++h) lanes[h] = FirstLanes32(k1 - k0 - 32 * h);
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t n = c * kAmxK + 2 * p;
      const uint16_t* w0 = g.w + n * K + k0;
      for (int64_t h = 0; h < groups; ++h) {
        const __m512i r0 = n < N ? _mm512_maskz_loadu_epi16(lanes[h], w0 + 32 * h) : _mm512_setzero_si512();
        const __m512i r1 = n + 1 < N ? _mm512_maskz_loadu_epi16(lanes[h], w0 + K + 32 * h) : _mm512_setzero_si512();
        uint32_t* tile = panel + (2 * h * steps + c - c0) * 256 + p * 16;
        _mm512_storeu_si512(tile, _mm512_unpacklo_epi16(r0, r1));
        _mm512_storeu_si512(tile + steps * 256, _mm512_unpackhi_epi16(r0, r1));
      }
    }
}

// Over one panel block (n chunks c0 .. c0 + steps): x tiles t0 .. t0 + kXTiles - 1 by the lo and hi tiles of the
// panel's 32 columns h (k0 + 32h ..). The accumulators start from zero in the first block, else from `acc` (16 x
// 16 float32 per x tile and column tile); after the last block the rows are emitted, else stored back there.
// tmm0, tmm1: x tiles; tmm2, tmm3: lo, hi tiles; tmm4..7: accumulators, [x tile][lo, hi].
template <int kXTiles>
__attribute__((target("amx-tile,amx-bf16"))) void AmxTransposedPass(const Group& g, const Shape& s,
                                                                    const uint32_t* panel, int64_t c0, int64_t steps,
                                                                    int64_t k0, int64_t k1, int64_t h, int64_t t0,
                                                                    float* acc, bool first, bool last) {
  const int64_t chunks = (s.N + kAmxK - 1) / kAmxK;
  const uint32_t* a = g.packed + (t0 * chunks + c0) * 256;
  const uint32_t* b = panel + 2 * h * steps * 256;
  auto saved = [&](int64_t xt, int64_t hi) { return acc + ((t0 + xt) * kChunkColumns / 16 + 2 * h + hi) * 256; };
  if (first) {
    _tile_zero(4);
    _tile_zero(5);
    if (kXTiles > 1) {
      _tile_zero(6);
      _tile_zero(7);
    }
  } else {
    _tile_loadd(4, saved(0, 0), 64);
    _tile_loadd(5, saved(0, 1), 64);
    if (kXTiles > 1) {
      _tile_loadd(6, saved(1, 0), 64);
      _tile_loadd(7, saved(1, 1), 64);
    }
  }
  for (int64_t c = 0; c < steps; ++c) {
    _tile_loadd(0, a + c * 256, 64);
    _tile_loadd(2, b + c * 256, 64);
    _tile_loadd(3, b + (steps + c) * 256, 64);
    if (kXTiles > 1) _tile_loadd(1, a + (chunks + c) * 256, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (kXTiles > 1) {
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  if (!last) {
    _tile_stored(4, saved(0, 0), 64);
    _tile_stored(5, saved(0, 1), 64);
    if (kXTiles > 1) {
      _tile_stored(6, saved(1, 0), 64);
      _tile_stored(7, saved(1, 1), 64);
    }
    return;
  }
  alignas(64) float out[4][kAmxRows * 16];
  _tile_stored(4, out[0], 64);
  _tile_stored(5, out[1], 64);
  if (kXTiles > 1) {
    _tile_stored(6, out[2], 64);
    _tile_stored(7, out[3], 64);
  }
  for (int64_t xt = 0; xt < kXTiles; ++xt)
    for (int64_t i = 0; i < 16 && (t0 + xt) * 16 + i < g.rows; ++i)
      EmitPairs(g, s.K, (t0 + xt) * 16 + i, k0 + 32 * h, k1, _mm512_load_ps(out[2 * xt] + i * 16),
                _mm512_load_ps(out[2 * xt + 1] + i * 16));
}

// Blocks of weight rows in turn: each packed into the panel (in L1), then run against every x tile, the
// accumulators carried between blocks in memory (exact float32: the same sums as in one block)
__attribute__((target("amx-tile,amx-bf16"))) inline void AmxTransposedRowsOfChunk(const Group& g, const Shape& s,
                                                                                  int64_t k0, int64_t k1) {
  const int64_t chunks = (s.N + kAmxK - 1) / kAmxK, tiles = (g.rows + kAmxRows - 1) / kAmxRows;
  const int64_t groups = (k1 - k0 + 31) / 32;
  TransposedScratch& scratch = ScratchFor(chunks > kPanelSteps ? tiles * kChunkColumns * 16 : 0);
  LoadTiles();
  for (int64_t c0 = 0; c0 < chunks || c0 == 0; c0 += kPanelSteps) {
    const int64_t steps = chunks - c0 < kPanelSteps ? chunks - c0 : kPanelSteps;
    const bool first = c0 == 0, last = c0 + kPanelSteps >= chunks;
    PackPanel(g, s, k0, k1, c0, c0 + steps, scratch.panel.get());
    for (int64_t t0 = 0; t0 < tiles; t0 += 2)
      for (int64_t h = 0; h < groups; ++h)
        if (tiles - t0 > 1)
          AmxTransposedPass<2>(g, s, scratch.panel.get(), c0, steps, k0, k1, h, t0, scratch.acc.get(), first, last);
        else
          AmxTransposedPass<1>(g, s, scratch.panel.get(), c0, steps, k0, k1, h, t0, scratch.acc.get(), first, last);
  }
  _tile_release();
}

// A transposed job's columns per chunk: at most kChunkColumns, a multiple of 32, in an even number of chunks where
// there are several, so that two threads finish together (qwen3-cpu's down weights, K = 384: 4 chunks of 96
// columns, not 3 of 128; 16 rows per expert, 55 against 60 us; 64 rows, 105-115 against 135-140)
inline int64_t TransposedChunkColumns(int64_t K) {
  const int64_t chunks = 2 * ((K + 2 * kChunkColumns - 1) / (2 * kChunkColumns));
  const int64_t width = (K + chunks - 1) / chunks;
  return (width + 31) / 32 * 32;
}

// whether Linux grants this thread's process the AMX tile state (asked once; every thread then has it)
inline bool AmxPermitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// A job: its groups' x tiles to pack (AMX), then their chunks, both taken by every thread that calls Run until none
// is left. A thread that starts after the last chunk was taken does nothing, so a job may be handed to threads that
// wake late; a thread that finds no tile left to pack waits for the tiles taken to be packed, by threads that run.
class Job {
 public:
  // false where AMX was asked for and the kernel refused it (Prepare must run before any thread runs the job)
  bool Prepare(std::vector<Group> groups, Shape shape, bool amx) {
    groups_ = std::move(groups);
    shape_ = shape;
    chunk_ = shape.transposed ? TransposedChunkColumns(shape.K) : kChunkRows;
    chunks_per_group_ = (shape.outputs() + chunk_ - 1) / chunk_;
    chunks_ = chunks_per_group_ * static_cast<int64_t>(groups_.size());
    amx_ = amx && (shape.transposed || shape.K % kAmxK == 0);
    if (amx_) {
      if (!AmxPermitted()) return false;
      const int64_t depth = shape.transposed ? shape.N : shape.K;  // x's values per row
      const int64_t tile_size = (depth + kAmxK - 1) / kAmxK * 256;  // uint32 per packed x tile
      std::vector<int64_t> first(groups_.size());
      for (size_t i = 0; i < groups_.size(); ++i) {
        first[i] = static_cast<int64_t>(tiles_.size()) * tile_size;
        for (int64_t t = 0; OnAmx(groups_[i]) && t * kAmxRows < groups_[i].rows; ++t)
          tiles_.push_back({static_cast<int64_t>(i), t});
      }
      packed_.reset(new uint32_t[tiles_.size() * tile_size]);  // every element is written by PackTile
      for (size_t i = 0; i < groups_.size(); ++i) groups_[i].packed = packed_.get() + first[i];
    }
    return true;
  }

  int64_t chunks() const { return chunks_; }

  void Run() {
    const int64_t tiles = static_cast<int64_t>(tiles_.size());
    if (tiles > 0) {
      for (int64_t t; (t = next_tile_.fetch_add(1)) < tiles;) {
        if (shape_.transposed)
          PackRowsTile(groups_[tiles_[t].group], shape_.N, tiles_[t].tile);
        else
          PackTile(groups_[tiles_[t].group], shape_.K, tiles_[t].tile);
        packed_tiles_.fetch_add(1, std::memory_order_release);
      }
      while (packed_tiles_.load(std::memory_order_acquire) < tiles) _mm_pause();
    }
    for (int64_t c; (c = next_.fetch_add(1)) < chunks_;) {
      const Group& g = groups_[c / chunks_per_group_];
      const int64_t n0 = c % chunks_per_group_ * chunk_;
      const int64_t outputs = shape_.outputs(), n1 = n0 + chunk_ < outputs ? n0 + chunk_ : outputs;
      if (g.rows > 0) {
        if (shape_.transposed && OnAmx(g))
          AmxTransposedRowsOfChunk(g, shape_, n0, n1);
        else if (shape_.transposed)
          TransposedRowsOfChunk(g, shape_, n0, n1);
        else if (amx_)
          AmxRowsOfChunk(g, shape_, n0, n1);
        else
          RowsOfChunk(g, shape_, n0, n1);
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void Wait() const {
    while (done_.load(std::memory_order_acquire) < chunks_) _mm_pause();
  }

 private:
  // Whether a group runs on AMX tiles: in a transposed job, not at kTransposedTile rows or fewer (one pass of the
  // AVX512 way, with no packing: qwen3-cpu gate/up weights, one row, 125 against 195 us).
  bool OnAmx(const Group& g) const { return amx_ && !(shape_.transposed && g.rows <= kTransposedTile); }

  std::vector<Group> groups_;
  struct Tile {
    int64_t group, tile;
  };
  std::vector<Tile> tiles_;  // AMX: the x tiles to pack (A tiles in a transposed job, else B tiles)
  std::unique_ptr<uint32_t[]> packed_;
  Shape shape_{};
  int64_t chunk_ = 0, chunks_per_group_ = 0, chunks_ = 0;  // outputs per chunk, chunks
  bool amx_ = false;
  std::atomic<int64_t> next_tile_{0}, packed_tiles_{0}, next_{0}, done_{0};
};

}  // namespace moe_rows
