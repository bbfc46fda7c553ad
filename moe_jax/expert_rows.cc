// moe_expert_rows (XLA FFI, CPU): out[b, n] = sum_k x[b, k] * w[e, n, k] for the first `count` rows b of x, in
// float32, with expert e's bfloat16 weights read where they lie in w [E, N, K] (XLA:CPU copies a dynamic slice
// before a dot). Rows from `count` on are written as zeros. moe_expert_rows_add: the same products for the first
// `count` rows, each rounded to bfloat16, times scale[b] and added into row token[b] of a float32 [T, N] array
// updated in place (its operand aliases its result). moe_expert_rows_transposed: the other orientation, out[b, k] =
// sum_n x[b, n] * w[e, n, k] for x [B, N] and w [E, N, K] (rows from `count` on zeros), on the same weights in
// place. moe_grouped_rows (and _transposed): the same products for every expert's rows of x sorted by expert, in
// one call (row counts per expert given; zeros past them). The kernel is moe_shared's expert_rows.h (attribute
// `amx`: its AMX way, else AVX512-BF16); its chunks are taken by the calling thread and one task on XLA's intra-op
// pool. moe_weight_grads: weight_grads.h's per-expert bfloat16 weight gradients from rows grouped by expert (zeros
// for the experts without rows), on the same threads. moe_zeros: a zero-filled result (zero_pages.h: a large one's
// pages not in memory released rather than written). Both mark a result's whole 2 MB pages for transparent huge
// pages (from `from_bytes` on, none where it is negative; XLA's allocator cannot be advised, and a fresh large buffer
// otherwise faults once per 4 KB page as it is first written).
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "expert_rows.h"
#include "weight_grads.h"
#include "zero_pages.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The operands every target shares: x [B, K] (transposed: [B, N]) and w [E, N, K] in bfloat16, the expert e and
// the row count (clamped to [0, B]); `error` is set where they are not that.
struct Rows {
  int64_t B = 0, e = 0, count = 0;
  moe_rows::Shape shape{};
  moe_rows::Group group{};
  const char* error = nullptr;
};

Rows ReadRows(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> expert, ffi::Buffer<ffi::S32> count,
              float* out, bool transposed) {
  Rows r;
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (x.element_type() != ffi::BF16 || w.element_type() != ffi::BF16 || xd.size() != 2 || wd.size() != 3 ||
      xd[1] != wd[transposed ? 1 : 2]) {
    r.error = transposed ? "expected x [B, N] and w [E, N, K] in bfloat16"
                         : "expected x [B, K] and w [E, N, K] in bfloat16";
    return r;
  }
  r.B = xd[0], r.e = *expert.typed_data();
  r.shape = {wd[1], wd[2], transposed};
  const int64_t asked = *count.typed_data();
  r.count = asked < 0 ? 0 : (asked > r.B ? r.B : asked);
  if (r.e < 0 || r.e >= wd[0]) r.error = "expert index out of range";
  r.group = {static_cast<const uint16_t*>(x.untyped_data()),
             static_cast<const uint16_t*>(w.untyped_data()) + r.e * wd[1] * wd[2], out, r.count, xd[1]};
  return r;
}

ffi::Error Invalid(const char* target, const char* what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

// the groups' chunks, taken by the calling thread and one task on XLA's intra-op pool
ffi::Error RunGroups(ffi::ThreadPool& pool, std::vector<moe_rows::Group> groups, moe_rows::Shape shape, bool amx,
                     const char* target) {
  if (groups.empty() || shape.outputs() == 0) return ffi::Error::Success();
  auto job = std::make_shared<moe_rows::Job>();
  if (!job->Prepare(std::move(groups), shape, amx))
    return ffi::Error::Internal(std::string(target) + ": the kernel refused AMX tile data");
  if (job->chunks() > 1) pool.Schedule([job] { job->Run(); });  // a task that starts late finds no chunk left
  job->Run();
  job->Wait();
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool& pool, const Rows& r, bool amx, const char* target) {
  if (r.count == 0) return ffi::Error::Success();
  return RunGroups(pool, {r.group}, r.shape, amx, target);
}

// rows stored as float32, zeros from `count` on (both orientations)
template <bool kTransposed>
ffi::Error StoredRows(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> expert,
                      ffi::Buffer<ffi::S32> count, ffi::Result<ffi::Buffer<ffi::F32>> out, bool amx) {
  const char* target = kTransposed ? "moe_expert_rows_transposed" : "moe_expert_rows";
  const Rows r = ReadRows(x, w, expert, count, out->typed_data(), kTransposed);
  if (r.error) return Invalid(target, r.error);
  float* o = out->typed_data();
  const int64_t width = r.shape.outputs();
  for (int64_t i = r.count * width; i < r.B * width; ++i) o[i] = 0.f;
  return Run(pool, r, amx, target);
}

ffi::Error ExpertRows(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> expert,
                      ffi::Buffer<ffi::S32> count, ffi::Result<ffi::Buffer<ffi::F32>> out, bool amx) {
  return StoredRows<false>(pool, x, w, expert, count, out, amx);
}

ffi::Error ExpertRowsTransposed(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::Buffer<ffi::S32> expert, ffi::Buffer<ffi::S32> count,
                                ffi::Result<ffi::Buffer<ffi::F32>> out, bool amx) {
  return StoredRows<true>(pool, x, w, expert, count, out, amx);
}

// every expert's rows in one job: x [S, K] (transposed: [S, N]) holds group_sizes[0] rows of expert 0, then
// group_sizes[1] of expert 1, and so on; out [S, N] (transposed: [S, K]) float32, zeros past the groups' rows
template <bool kTransposed>
ffi::Error GroupedRows(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::F32>> out, bool amx) {
  const char* target = kTransposed ? "moe_grouped_rows_transposed" : "moe_grouped_rows";
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (x.element_type() != ffi::BF16 || w.element_type() != ffi::BF16 || xd.size() != 2 || wd.size() != 3 ||
      xd[1] != wd[kTransposed ? 1 : 2])
    return Invalid(target, kTransposed ? "expected x [S, N] and w [E, N, K] in bfloat16"
                                       : "expected x [S, K] and w [E, N, K] in bfloat16");
  if (group_sizes.element_count() != wd[0]) return Invalid(target, "expected group_sizes [E]");
  const moe_rows::Shape shape{wd[1], wd[2], kTransposed};
  const int64_t S = xd[0], width = shape.outputs(), expert_size = wd[1] * wd[2];
  const auto* rows = static_cast<const uint16_t*>(x.untyped_data());
  const auto* weights = static_cast<const uint16_t*>(w.untyped_data());
  const int32_t* sizes = group_sizes.typed_data();
  float* o = out->typed_data();
  std::vector<moe_rows::Group> groups;
  int64_t row = 0;
  for (int64_t e = 0; e < wd[0]; ++e) {
    if (sizes[e] < 0 || sizes[e] > S - row) return Invalid(target, "group_sizes: negative, or more rows than x has");
    if (sizes[e] > 0)
      groups.push_back({rows + row * xd[1], weights + e * expert_size, o + row * width, sizes[e], xd[1]});
    row += sizes[e];
  }
  std::fill(o + row * width, o + S * width, 0.f);
  return RunGroups(pool, std::move(groups), shape, amx, target);
}

ffi::Error ExpertRowsAdd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> expert,
                         ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> into, ffi::Result<ffi::Buffer<ffi::F32>> out, bool amx) {
  constexpr const char* kTarget = "moe_expert_rows_add";
  Rows r = ReadRows(x, w, expert, count, out->typed_data(), false);
  if (r.error) return Invalid(kTarget, r.error);
  const auto od = into.dimensions();
  if (od.size() != 2 || od[1] != r.shape.N || token.element_count() != r.B || scale.element_count() != r.B)
    return Invalid(kTarget, "expected token [B], scale [B] and out [T, N]");
  if (out->untyped_data() != into.untyped_data()) return Invalid(kTarget, "out must alias its operand");
  const int32_t* rows_to = token.typed_data();
  for (int64_t b = 0; b < r.count; ++b)
    if (rows_to[b] < 0 || rows_to[b] >= od[0]) return Invalid(kTarget, "token index out of range");
  r.group.add_row = rows_to;
  r.group.add_scale = scale.typed_data();
  return Run(pool, r, amx, kTarget);
}

// marks the whole 2 MB pages of a result of `from_bytes` bytes or more for transparent huge pages (none where
// `from_bytes` is negative): a hint, the contents stay as they are
void AdviseHugePages(ffi::Result<ffi::AnyBuffer>& out, int64_t from_bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(out->untyped_data());
  const size_t bytes = out->size_bytes();
  const uintptr_t start = (begin + kHugePage - 1) / kHugePage * kHugePage;
  const uintptr_t end = (begin + bytes) / kHugePage * kHugePage;
  if (from_bytes >= 0 && static_cast<int64_t>(bytes) >= from_bytes && end > start)
    madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#endif
}

ffi::Error Zeros(ffi::Result<ffi::AnyBuffer> out, int64_t from_bytes) {
  moe_rows::ZeroBytes(out->untyped_data(), out->size_bytes());
  AdviseHugePages(out, from_bytes);
  return ffi::Error::Success();
}

// out [E, N, K] = per expert e, the sum over left rows r in [start[e], end[e]) of left[r] [N] times right row
// right_row[r] [K] (weight_grads.h); zeros for an expert without rows. On the calling thread (which zeros the idle
// experts first) and one pool task.
ffi::Error WeightGrads(ffi::ThreadPool pool, ffi::AnyBuffer left, ffi::AnyBuffer right,
                       ffi::Buffer<ffi::S32> right_row, ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> end,
                       ffi::Result<ffi::AnyBuffer> out, int64_t from_bytes) {
  constexpr const char* kTarget = "moe_weight_grads";
  const auto ld = left.dimensions(), rd = right.dimensions(), od = out->dimensions();
  if (left.element_type() != ffi::BF16 || right.element_type() != ffi::BF16 || out->element_type() != ffi::BF16 ||
      ld.size() != 2 || rd.size() != 2 || od.size() != 3 || od[1] != ld[1] || od[2] != rd[1])
    return Invalid(kTarget, "expected left [S, N], right [R, K] and out [E, N, K] in bfloat16");
  if (right_row.element_count() != ld[0] || start.element_count() != od[0] || end.element_count() != od[0])
    return Invalid(kTarget, "expected right_row [S], start [E] and end [E]");
  const int32_t *rows = right_row.typed_data(), *first = start.typed_data(), *last = end.typed_data();
  for (int64_t e = 0; e < od[0]; ++e) {
    if (first[e] < last[e] && (first[e] < 0 || last[e] > ld[0]))
      return Invalid(kTarget, "an expert's rows lie outside left");
    for (int64_t r = first[e]; r < last[e]; ++r)
      if (rows[r] < 0 || rows[r] >= rd[0]) return Invalid(kTarget, "right_row index out of range");
  }
  AdviseHugePages(out, from_bytes);
  auto job = std::make_shared<moe_rows::WeightGradsJob>(moe_rows::WeightGradShape{
      static_cast<const uint16_t*>(left.untyped_data()), static_cast<const uint16_t*>(right.untyped_data()), rows,
      first, last, static_cast<uint16_t*>(out->untyped_data()), od[0], od[1], od[2]});
  if (job->chunks() > 1) pool.Schedule([job] { job->Run(); });  // a task that starts late finds no unit left
  job->ZeroIdle();
  job->Run();
  job->Wait();
  return ffi::Error::Success();
}

// the operands every target starts with: x, w and an int32 array (the expert, or the group sizes)
auto RowsOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

// x, w, the expert and the row count
auto RowsBinding() { return RowsOperands().Arg<ffi::Buffer<ffi::S32>>(); }

// x, w and group_sizes
auto GroupedBinding() { return RowsOperands().Ret<ffi::Buffer<ffi::F32>>().Attr<bool>("amx"); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_expert_rows, ExpertRows,
                              RowsBinding().Ret<ffi::Buffer<ffi::F32>>().Attr<bool>("amx"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_expert_rows_transposed, ExpertRowsTransposed,
                              RowsBinding().Ret<ffi::Buffer<ffi::F32>>().Attr<bool>("amx"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_grouped_rows, GroupedRows<false>, GroupedBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_grouped_rows_transposed, GroupedRows<true>, GroupedBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_expert_rows_add, ExpertRowsAdd,
                              RowsBinding()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("amx"));

// left, right, right_row, start and end
XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_weight_grads, WeightGrads,
                              RowsBinding().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>().Attr<int64_t>(
                                  "from_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_zeros, Zeros,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Attr<int64_t>("from_bytes"));
