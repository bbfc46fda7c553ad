// The C ABI of the row kernel's library for torch (called through ctypes):
// - moe_grouped_rows: moe_shared's CPU row kernel (expert_rows.h) over a list of groups of one [E, N, K] bfloat16
//   weight tensor, each group `rows[g]` rows of x [*, K] from row x_row[g] times weights[expert[g]] transposed, into
//   float32 out [*, N] from row out_row[g]; with `transposed`, rows of x [*, N] times weights[expert[g]] into out
//   [*, K]. Returns 0, or 1 where AMX was asked for and the kernel refused it.
// - moe_weight_grads: weight_grads.h's per-expert bfloat16 weight gradients of rows grouped by expert; with
//   `zero_idle`, zeros for the experts without rows (else they are left as they are: a buffer known to be zeros).
// - moe_combine_slots: the weighted combine of slot_rows.h, reading rows in expert order where they lie.
// - moe_zero_bytes: zero_pages.h's zeros (a large range's pages not in memory released rather than written).
// Each call's chunks are taken by an OpenMP team of `threads` threads, the calling thread among them.
#include <algorithm>
#include <vector>

#include "expert_rows.h"
#include "slot_rows.h"
#include "weight_grads.h"
#include "zero_pages.h"

namespace {

// Job: chunks(), Run() (takes chunks until none is left; the team's end waits for every thread's). The threads are
// torch's own OpenMP team (this library links the libgomp that torch loaded): a pool of this library's own would
// compete for the cores with torch's workers, which spin a while after each op (on a 2-core EPYC, a quarter of a
// qwen3-cpu decode call went to libgomp's spinning).
template <class Job>
void RunOnThreads(Job& job, int threads) {
  if (threads > 1 && job.chunks() > 1) {
#pragma omp parallel num_threads(threads)
    job.Run();
  } else {
    job.Run();
  }
}

}  // namespace

extern "C" int moe_grouped_rows(const uint16_t* x, int64_t x_stride, const uint16_t* w, float* out, int64_t N,
                                int64_t K, int64_t groups, const int64_t* x_row, const int64_t* out_row,
                                const int64_t* rows, const int64_t* expert, int transposed, int amx, int threads) {
  const moe_rows::Shape shape{N, K, transposed != 0};
  std::vector<moe_rows::Group> list;
  list.reserve(groups);
  for (int64_t g = 0; g < groups; ++g)
    list.push_back({x + x_row[g] * x_stride, w + expert[g] * N * K, out + out_row[g] * shape.outputs(), rows[g],
                    x_stride});
  moe_rows::Job job;
  if (!job.Prepare(std::move(list), shape, amx != 0)) return 1;
  RunOnThreads(job, threads);
  return 0;
}

extern "C" void moe_weight_grads(const uint16_t* left, const uint16_t* right, const int32_t* right_row,
                                 const int32_t* start, const int32_t* end, uint16_t* out, int64_t E, int64_t N,
                                 int64_t K, int zero_idle, int threads) {
  moe_rows::WeightGradsJob job({left, right, right_row, start, end, out, E, N, K});
  if (zero_idle) job.ZeroIdle();
  RunOnThreads(job, threads);
}

extern "C" void moe_combine_slots(const uint16_t* y, int64_t y_stride, const int64_t* order, const bool* empty,
                                  const uint16_t* weights, void* out, int out_float32, int64_t T, int64_t k, int64_t H,
                                  int threads) {
  std::vector<int64_t> row(T * k);
  moe_rows::SlotRows(order, empty, T * k, row.data());
  const moe_rows::CombineArgs args{y, y_stride, row.data(), weights, out, out_float32 != 0, T, k, H};
  const int64_t per_chunk = moe_rows::RowsPerChunk(H * (out_float32 ? 4 : 2));
  moe_rows::ChunkJob job((T + per_chunk - 1) / per_chunk, [&args, per_chunk](int64_t c) {
    moe_rows::CombineChunk(args, c * per_chunk, std::min(args.T, (c + 1) * per_chunk));
  });
  RunOnThreads(job, threads);
}

extern "C" void moe_zero_bytes(void* data, int64_t bytes) { moe_rows::ZeroBytes(data, static_cast<size_t>(bytes)); }
