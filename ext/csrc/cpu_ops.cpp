// CPU implementation: one pass over the chunks with at::parallel_for, memcpy of every run
// that is contiguous on both sides (a whole [start, end) range of a contiguous 'thd' layer is
// one memcpy). Memory-bound by construction: no temporaries, no per-layer dispatch.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "kv_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>

namespace anchorcache {
namespace {

constexpr int64_t kPrefetchChunks = 12;

at::Tensor alloc_host_cpu(at::IntArrayRef shape, at::ScalarType dtype) {
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

void copy_kv_cpu(const KvPlan& plan, const RowSel& rows, const at::Tensor& slab, bool to_slab) {
  TORCH_CHECK(plan.device.is_cpu(), "anchorcache: CPU kernel called with a cache on ",
              plan.device);
  TORCH_CHECK(slab.is_cpu(), "anchorcache: a slab must be on the CPU for a CPU cache, got ",
              slab.device());
  TORCH_CHECK(!rows.index.has_value() || rows.index->is_cpu(),
              "anchorcache: the row index must be on the CPU for a CPU cache");
  const int64_t n = rows.n;
  const int64_t hpr = plan.heads_per_row;
  const int64_t chunk = plan.chunk_bytes;
  const int64_t per_side = n * hpr;
  const int64_t total = static_cast<int64_t>(plan.sides.size()) * per_side;
  if (total == 0 || chunk == 0) return;
  const int64_t* idx = rows.index.has_value() ? rows.index->data_ptr<int64_t>() : nullptr;
  const int64_t start = rows.start;
  char* slab_base = static_cast<char*>(slab.data_ptr());
  auto token = [&](int64_t r) { return idx ? idx[r] : start + r; };
  // ~256 KiB per task: large enough to amortise scheduling, small enough to balance.
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / chunk);
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    int64_t q = begin;
    while (q < end) {
      const int64_t side_i = q / per_side;
      const int64_t rem = q % per_side;
      const int64_t r = rem / hpr;
      const int64_t h = rem % hpr;
      const KvSide& side = plan.sides[side_i];
      const int64_t t = token(r);
      int64_t run = 1;
      if (hpr == 1 && side.stride_t_bytes == chunk) {
        // Extend over rows whose tokens are consecutive: contiguous on both sides.
        const int64_t limit = std::min(end - q, n - r);
        while (run < limit && token(r + run) == t + run) ++run;
      }
      char* cache = side.base + t * side.stride_t_bytes + h * side.stride_h_bytes;
      if (run == 1 && q + kPrefetchChunks < end) {
        // Scattered rows defeat the hardware prefetcher: fetch a later chunk's cache lines now.
        const int64_t qf = q + kPrefetchChunks;
        const int64_t rem_f = qf % per_side;
        const KvSide& side_f = plan.sides[qf / per_side];
        const char* f = side_f.base + token(rem_f / hpr) * side_f.stride_t_bytes +
                        (rem_f % hpr) * side_f.stride_h_bytes;
        for (int64_t off = 0; off < chunk; off += 64) {
          if (to_slab) {
            __builtin_prefetch(f + off, 0);
          } else {
            __builtin_prefetch(f + off, 1);
          }
        }
      }
      char* s = slab_base + q * chunk;
      if (to_slab) {
        std::memcpy(s, cache, static_cast<size_t>(run * chunk));
      } else {
        std::memcpy(cache, s, static_cast<size_t>(run * chunk));
      }
      q += run;
    }
  });
}

const Backend kCpu{&alloc_host_cpu, &copy_kv_cpu};

at::Tensor snapshot_kv_cpu(at::TensorList k, at::TensorList v,
                           const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                           const std::string& layout, int64_t batch_index) {
  return snapshot_kv(kCpu, k, v, index, start, end, layout, batch_index);
}

void snapshot_kv_out_cpu(at::TensorList k, at::TensorList v,
                         const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                         const std::string& layout, int64_t batch_index, const at::Tensor& out) {
  snapshot_kv_out(kCpu, k, v, index, start, end, layout, batch_index, out);
}

at::Tensor snapshot_state_cpu(at::TensorList states, int64_t index) {
  return snapshot_state(kCpu, states, index);
}

void snapshot_state_out_cpu(at::TensorList states, int64_t index, const at::Tensor& out) {
  snapshot_state_out(kCpu, states, index, out);
}

void restore_chain_cpu(at::TensorList slabs, const c10::List<std::optional<at::Tensor>>& indices,
                       at::IntArrayRef starts, const std::string& layout, int64_t batch_index,
                       at::TensorList k, at::TensorList v,
                       const std::optional<at::Tensor>& state_slab, at::TensorList states,
                       int64_t state_index) {
  restore_chain(kCpu, slabs, indices, starts, layout, batch_index, k, v, state_slab, states,
                state_index);
}

}  // namespace

TORCH_LIBRARY_IMPL(anchorcache, CPU, m) {
  m.impl("snapshot_kv", &snapshot_kv_cpu);
  m.impl("snapshot_kv_out", &snapshot_kv_out_cpu);
  m.impl("snapshot_state", &snapshot_state_cpu);
  m.impl("snapshot_state_out", &snapshot_state_out_cpu);
  m.impl("restore_chain", &restore_chain_cpu);
}

}  // namespace anchorcache
