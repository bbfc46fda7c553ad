// moe_expert_rows (XLA FFI, CPU): out[b, n] = sum_k x[b, k] * w[e, n, k] for the first `count` rows b of x, in
// float32, with expert e's bfloat16 weights read where they lie in w [E, N, K] (XLA:CPU copies a dynamic slice
// before a dot). Rows from `count` on are written as zeros. moe_expert_rows_add: the same products for the first
// `count` rows, each rounded to bfloat16, times scale[b] and added into row token[b] of a float32 [T, N] array
// updated in place (its operand aliases its result). The kernel is moe_shared's expert_rows.h (attribute `amx`: its
// AMX way, else AVX512-BF16); its chunks are taken by the calling thread and one task on XLA's intra-op pool.
#include <memory>

#include "expert_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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
  auto job = std::make_shared<moe_rows::Job>();
  const moe_rows::Group group{static_cast<const uint16_t*>(x.untyped_data()),
                              static_cast<const uint16_t*>(w.untyped_data()) + e * N * K, o, rows, K};
  if (!job->Prepare({group}, {N, K}, amx))
    return ffi::Error::Internal("moe_expert_rows: the kernel refused AMX tile data");
  if (job->chunks() > 1) pool.Schedule([job] { job->Run(); });  // a task that starts late finds no chunk left
  job->Run();
  job->Wait();
  return ffi::Error::Success();
}

ffi::Error ExpertRowsAdd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> expert,
                         ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> into, ffi::Result<ffi::Buffer<ffi::F32>> out, bool amx) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = into.dimensions();
  if (x.element_type() != ffi::BF16 || w.element_type() != ffi::BF16 || xd.size() != 2 || wd.size() != 3 ||
      xd[1] != wd[2] || od.size() != 2 || od[1] != wd[1] || token.element_count() != xd[0] ||
      scale.element_count() != xd[0])
    return ffi::Error::InvalidArgument(
        "moe_expert_rows_add: expected x [B, K] and w [E, N, K] in bfloat16, token [B], scale [B], out [T, N]");
  if (out->untyped_data() != into.untyped_data())
    return ffi::Error::InvalidArgument("moe_expert_rows_add: out must alias its operand");
  const int64_t B = xd[0], K = xd[1], E = wd[0], N = wd[1], T = od[0];
  const int64_t e = *expert.typed_data();
  const int64_t rows = *count.typed_data() < 0 ? 0 : (*count.typed_data() > B ? B : *count.typed_data());
  if (e < 0 || e >= E) return ffi::Error::InvalidArgument("moe_expert_rows_add: expert index out of range");
  const int32_t* rows_to = token.typed_data();
  for (int64_t b = 0; b < rows; ++b)
    if (rows_to[b] < 0 || rows_to[b] >= T)
      return ffi::Error::InvalidArgument("moe_expert_rows_add: token index out of range");
  if (rows == 0 || N == 0) return ffi::Error::Success();
  auto job = std::make_shared<moe_rows::Job>();
  moe_rows::Group group{static_cast<const uint16_t*>(x.untyped_data()),
                        static_cast<const uint16_t*>(w.untyped_data()) + e * N * K, out->typed_data(), rows, K};
  group.add_row = rows_to;
  group.add_scale = scale.typed_data();
  if (!job->Prepare({group}, {N, K}, amx))
    return ffi::Error::Internal("moe_expert_rows_add: the kernel refused AMX tile data");
  if (job->chunks() > 1) pool.Schedule([job] { job->Run(); });
  job->Run();
  job->Wait();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_expert_rows_add, ExpertRowsAdd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("amx"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_expert_rows, ExpertRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("amx"));
