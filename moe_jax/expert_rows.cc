// moe_expert_rows: out[b, n] = sum_k x[b, k] * w[e, n, k] for the first `count` rows b of x, in float32, with
// expert e's bfloat16 weights read where they lie in w [E, N, K] (XLA:CPU copies a dynamic slice before a dot).
// Rows from `count` on are written as zeros. Two ways, chosen by the attribute `amx`:
// - AMX: tiles of 16 weight rows by 32 k, loaded in place, times x's rows packed in pairs of k (the B operand's
//   layout), 32 weight rows by 32 x rows at a time (four accumulator tiles); a tail of under 16 weight rows and
//   a k width that is not a multiple of 32 take the AVX512 way.
// - AVX512-BF16 dot products, 4 x rows by 4 weight rows per step.
// The weight rows are split into chunks taken by the calling thread and one task on XLA's intra-op pool.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "expert_rows.cc is built with -mavx512f -mavx512bw -mavx512bf16 -mamx-tile -mamx-bf16"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 4;         // x rows and weight rows per register block
constexpr int64_t kChunkRows = 64;   // weight rows per unit of work shared between the threads
constexpr int64_t kAmxRows = 16;     // weight rows per AMX tile (and x rows per accumulator tile)
constexpr int64_t kAmxK = 32;        // k per AMX tile

struct Problem {
  const uint16_t* x;  // [B, K]
  const uint16_t* w;  // [N, K], the expert's
  float* out;         // [B, N]
  int64_t rows, N, K;
  const uint32_t* packed = nullptr;  // AMX: x's rows as B tiles (PackRows)
};

void RowsOfChunk(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t K = p.K, full = K / 32 * 32;
  const __mmask32 tail = K == full ? 0 : static_cast<__mmask32>((1ull << (K - full)) - 1);
  for (int64_t n = n0; n < n1; n += kTile) {
    const int64_t nn = n1 - n < kTile ? n1 - n : kTile;
    const uint16_t* wr[kTile];
    for (int64_t j = 0; j < kTile; ++j) wr[j] = p.w + (n + (j < nn ? j : 0)) * K;
    for (int64_t b = 0; b < p.rows; b += kTile) {
      const int64_t bb = p.rows - b < kTile ? p.rows - b : kTile;
      const uint16_t* xr[kTile];
      for (int64_t i = 0; i < kTile; ++i) xr[i] = p.x + (b + (i < bb ? i : 0)) * K;
      __m512 acc[kTile][kTile];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      auto step = [&](auto load) {
        __m512bh wv[kTile];
        for (int64_t j = 0; j < kTile; ++j) wv[j] = load(wr[j]);
        for (int64_t i = 0; i < kTile; ++i) {
          const __m512bh xv = load(xr[i]);
          for (int64_t j = 0; j < kTile; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
      };
      for (int64_t k = 0; k < full; k += 32)
        step([k](const uint16_t* r) { return (__m512bh)_mm512_loadu_si512(r + k); });
      if (tail) step([&](const uint16_t* r) { return (__m512bh)_mm512_maskz_loadu_epi16(tail, r + full); });
      for (int64_t i = 0; i < bb; ++i)
        for (int64_t j = 0; j < nn; ++j) p.out[(b + i) * p.N + n + j] = _mm512_reduce_add_ps(acc[i][j]);
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

__attribute__((target("amx-tile,amx-bf16"))) void LoadTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// x's rows as B tiles: for x tile t and k chunk c, 16 k pairs by 16 rows, each pair two bfloat16 (one uint32)
std::vector<uint32_t> PackRows(const uint16_t* x, int64_t rows, int64_t K) {
  const int64_t tiles = (rows + kAmxRows - 1) / kAmxRows, chunks = K / kAmxK, pairs = K / 2;
  std::vector<uint32_t> packed(tiles * chunks * 256, 0);
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  for (int64_t b = 0; b < rows; ++b) {
    uint32_t* tile = packed.data() + (b / kAmxRows) * chunks * 256 + b % kAmxRows;
    for (int64_t p = 0; p < pairs; ++p) tile[(p / 16) * 256 + (p % 16) * 16] = x32[b * pairs + p];
  }
  return packed;
}

// 16 * kWeightTiles weight rows from n by 16 * kXTiles x rows from x tile t0
template <int kWeightTiles, int kXTiles>
__attribute__((target("amx-tile,amx-bf16"))) void AmxPass(const Problem& p, int64_t n, int64_t t0) {
  const int64_t chunks = p.K / kAmxK, stride = p.K * 2;
  const uint32_t* b = p.packed + t0 * chunks * 256;
  _tile_zero(4);
  if (kXTiles > 1) _tile_zero(5);
  if (kWeightTiles > 1) _tile_zero(6);
  if (kWeightTiles > 1 && kXTiles > 1) _tile_zero(7);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* w = p.w + n * p.K + c * kAmxK;
    _tile_loadd(0, w, stride);
    _tile_loadd(2, b + c * 256, 64);
    if (kWeightTiles > 1) _tile_loadd(1, w + kAmxRows * p.K, stride);
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
  for (int64_t wt = 0; wt < kWeightTiles; ++wt)
    for (int64_t xt = 0; xt < kXTiles; ++xt)
      for (int64_t i = 0; i < 16 && (t0 + xt) * 16 + i < p.rows; ++i) {
        float* out = p.out + ((t0 + xt) * 16 + i) * p.N + n + wt * kAmxRows;
        for (int64_t r = 0; r < kAmxRows; ++r) out[r] = acc[wt * 2 + xt][r * 16 + i];
      }
}

template <int kWeightTiles>
void AmxWeightRows(const Problem& p, int64_t n, int64_t tiles) {
  for (int64_t t0 = 0; t0 < tiles; t0 += 2)
    if (tiles - t0 > 1)
      AmxPass<kWeightTiles, 2>(p, n, t0);
    else
      AmxPass<kWeightTiles, 1>(p, n, t0);
}

__attribute__((target("amx-tile,amx-bf16"))) void AmxRowsOfChunk(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t tiles = (p.rows + kAmxRows - 1) / kAmxRows;
  LoadTiles();
  int64_t n = n0;
  for (; n + 2 * kAmxRows <= n1; n += 2 * kAmxRows) AmxWeightRows<2>(p, n, tiles);
  for (; n + kAmxRows <= n1; n += kAmxRows) AmxWeightRows<1>(p, n, tiles);
  _tile_release();
  if (n < n1) RowsOfChunk(p, n, n1);
}

bool AmxPermitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct Work {
  Problem problem;
  int64_t chunks;
  std::vector<uint32_t> packed;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      const int64_t n0 = c * kChunkRows, n1 = n0 + kChunkRows < problem.N ? n0 + kChunkRows : problem.N;
      if (problem.packed)
        AmxRowsOfChunk(problem, n0, n1);
      else
        RowsOfChunk(problem, n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error ExpertRows(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> expert,
                      ffi::Buffer<ffi::S32> count, ffi::Result<ffi::Buffer<ffi::F32>> out, bool amx) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (x.element_type() != ffi::BF16 || w.element_type() != ffi::BF16 || xd.size() != 2 || wd.size() != 3 ||
      xd[1] != wd[2])
    return ffi::Error::InvalidArgument("moe_expert_rows: expected x [B, K] and w [E, N, K] in bfloat16");
  const int64_t B = xd[0], K = xd[1], E = wd[0], N = wd[1];
  const int64_t e = *expert.typed_data();
  const int64_t rows = *count.typed_data() < 0 ? 0 : (*count.typed_data() > B ? B : *count.typed_data());
  if (e < 0 || e >= E) return ffi::Error::InvalidArgument("moe_expert_rows: expert index out of range");
  float* o = out->typed_data();
  for (int64_t i = rows * N; i < B * N; ++i) o[i] = 0.f;
  if (rows == 0 || N == 0) return ffi::Error::Success();
  auto work = std::make_shared<Work>();
  work->problem = {static_cast<const uint16_t*>(x.untyped_data()),
                   static_cast<const uint16_t*>(w.untyped_data()) + e * N * K, o, rows, N, K};
  work->chunks = (N + kChunkRows - 1) / kChunkRows;
  if (amx && K % kAmxK == 0) {
    if (!AmxPermitted()) return ffi::Error::Internal("moe_expert_rows: the kernel refused AMX tile data");
    work->packed = PackRows(work->problem.x, rows, K);
    work->problem.packed = work->packed.data();
  }
  if (work->chunks > 1) pool.Schedule([work] { work->Run(); });  // a task that starts late finds no chunk left
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_expert_rows, ExpertRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("amx"));
