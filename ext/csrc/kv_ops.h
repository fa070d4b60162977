// Operator bodies shared by the CPU and CUDA registrations. A backend supplies only what
// differs per device: how a host slab is allocated (pinned for CUDA) and the row copy itself.
#pragma once

#include "kv_plan.h"

#include <ATen/core/List.h>

#include <tuple>

namespace anchorcache {

struct Backend {
  // A fresh host slab for results (pageable on CPU, pinned when the cache is on CUDA).
  at::Tensor (*alloc_host)(at::IntArrayRef shape, at::ScalarType dtype);
  // Copies the chunks of `rows` between the cache described by `plan` and `slab` (shape
  // already checked), in the direction given by `to_slab`. Returns when the data is in place.
  void (*copy_kv)(const KvPlan& plan, const RowSel& rows, const at::Tensor& slab, bool to_slab);
};

at::Tensor snapshot_kv(const Backend& be, at::TensorList k, at::TensorList v,
                       const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                       const std::string& layout, int64_t batch_index);
void snapshot_kv_out(const Backend& be, at::TensorList k, at::TensorList v,
                     const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                     const std::string& layout, int64_t batch_index, const at::Tensor& out);
at::Tensor snapshot_state(const Backend& be, at::TensorList states, int64_t index);
void snapshot_state_out(const Backend& be, at::TensorList states, int64_t index,
                        const at::Tensor& out);
void restore_chain(const Backend& be, at::TensorList slabs,
                   const c10::List<std::optional<at::Tensor>>& indices, at::IntArrayRef starts,
                   const std::string& layout, int64_t batch_index, at::TensorList k,
                   at::TensorList v, const std::optional<at::Tensor>& state_slab,
                   at::TensorList states, int64_t state_index);

}  // namespace anchorcache
