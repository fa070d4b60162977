#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "kv_ops.h"

namespace anchorcache {

void snapshot_kv_out(const Backend& be, at::TensorList k, at::TensorList v,
                     const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                     const std::string& layout, int64_t batch_index, const at::Tensor& out) {
  const KvPlan plan = plan_kv(k, v, layout, batch_index);
  const RowSel rows = make_rows(index, start, end, plan.num_tokens);
  const int64_t n_rows = check_slab(plan, out, "out");
  TORCH_CHECK(n_rows == rows.n, "anchorcache: out has ", n_rows, " rows but ", rows.n,
              " rows were selected");
  be.copy_kv(plan, rows, out, /*to_slab=*/true);
}

at::Tensor snapshot_kv(const Backend& be, at::TensorList k, at::TensorList v,
                       const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                       const std::string& layout, int64_t batch_index) {
  const KvPlan plan = plan_kv(k, v, layout, batch_index);
  const RowSel rows = make_rows(index, start, end, plan.num_tokens);
  at::Tensor out = be.alloc_host(slab_shape(plan, rows.n), plan.dtype);
  be.copy_kv(plan, rows, out, /*to_slab=*/true);
  return out;
}

void snapshot_state_out(const Backend& be, at::TensorList states, int64_t index,
                        const at::Tensor& out) {
  (void)be;
  copy_states_to_slab(states, index, out);
}

at::Tensor snapshot_state(const Backend& be, at::TensorList states, int64_t index) {
  const std::vector<int64_t> offsets = state_offsets(states, index);
  at::Tensor out = be.alloc_host({offsets.back()}, at::kByte);
  copy_states_to_slab(states, index, out);
  return out;
}

void restore_chain(const Backend& be, at::TensorList slabs,
                   const c10::List<std::optional<at::Tensor>>& indices, at::IntArrayRef starts,
                   const std::string& layout, int64_t batch_index, at::TensorList k,
                   at::TensorList v, const std::optional<at::Tensor>& state_slab,
                   at::TensorList states, int64_t state_index) {
  TORCH_CHECK(indices.size() == slabs.size() && starts.size() == slabs.size(),
              "anchorcache: restore_chain got ", slabs.size(), " slabs, ", indices.size(),
              " indices and ", starts.size(), " starts; they must match");
  // A state-only restore (no links) may pass no cache tensors at all.
  std::optional<KvPlan> plan;
  if (!slabs.empty() || !k.empty() || !v.empty()) plan = plan_kv(k, v, layout, batch_index);
  // Validate every link (and the state) before writing anything: a bad chain leaves the cache
  // untouched.
  std::vector<RowSel> rows;
  rows.reserve(slabs.size());
  for (size_t j = 0; j < slabs.size(); ++j) {
    const std::string what = "slabs[" + std::to_string(j) + "]";
    const int64_t n_rows = check_slab(*plan, slabs[j], what.c_str());
    const std::optional<at::Tensor> idx = indices.get(j);
    RowSel sel = make_rows(idx, starts[j], starts[j] + n_rows, plan->num_tokens);
    TORCH_CHECK(sel.n == n_rows, "anchorcache: ", what, " has ", n_rows, " rows but its index "
                "selects ", sel.n);
    rows.push_back(std::move(sel));
  }
  if (state_slab.has_value()) {
    const std::vector<int64_t> offsets = state_offsets(states, state_index);
    TORCH_CHECK(state_slab->numel() == offsets.back(), "anchorcache: state slab has ",
                state_slab->numel(), " bytes but the states need ", offsets.back());
  } else {
    TORCH_CHECK(states.empty(), "anchorcache: states given without a state slab");
  }
  for (size_t j = 0; j < slabs.size(); ++j) {
    be.copy_kv(*plan, rows[j], slabs[j], /*to_slab=*/false);
  }
  if (state_slab.has_value()) copy_slab_to_states(*state_slab, states, state_index);
}

}  // namespace anchorcache
