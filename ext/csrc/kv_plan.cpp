#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "kv_plan.h"

#include <ATen/ops/aminmax.h>
#include <ATen/ops/stack.h>

namespace anchorcache {

Layout parse_layout(const std::string& layout) {
  if (layout == "thd") return Layout::kTHD;
  if (layout == "bhtd") return Layout::kBHTD;
  TORCH_CHECK(false, "anchorcache: layout must be 'thd' ([tokens, kv_heads, head_dim]) or "
              "'bhtd' ([batch, kv_heads, tokens, head_dim]), got '", layout, "'");
}

static void check_same(const at::Tensor& ref, const at::Tensor& t, const char* name, size_t i) {
  TORCH_CHECK(t.defined(), "anchorcache: ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "anchorcache: ", name, "[", i,
              "] has dtype ", t.scalar_type(), " but k[0] has ", ref.scalar_type(),
              "; all layers must share one dtype");
  TORCH_CHECK(t.device() == ref.device(), "anchorcache: ", name, "[", i, "] is on ", t.device(),
              " but k[0] is on ", ref.device(), "; all layers must share one device");
  TORCH_CHECK(t.sizes() == ref.sizes(), "anchorcache: ", name, "[", i, "] has shape ",
              t.sizes(), " but k[0] has ", ref.sizes(), "; all layers must share one shape");
  TORCH_CHECK(t.stride(-1) == 1, "anchorcache: ", name, "[", i,
              "] must have a contiguous head_dim (stride 1), got strides ", t.strides());
}

KvPlan plan_kv(at::TensorList k, at::TensorList v, const std::string& layout_name,
               int64_t batch_index) {
  const Layout layout = parse_layout(layout_name);
  TORCH_CHECK(!k.empty(), "anchorcache: k must hold at least one layer");
  TORCH_CHECK(k.size() == v.size(), "anchorcache: k has ", k.size(), " layers but v has ",
              v.size());
  const at::Tensor& ref = k[0];
  const int64_t want_dim = layout == Layout::kTHD ? 3 : 4;
  TORCH_CHECK(ref.defined() && ref.dim() == want_dim, "anchorcache: layout '", layout_name,
              "' needs ", want_dim, "-D cache tensors, got k[0] with shape ",
              ref.defined() ? ref.sizes() : at::IntArrayRef{});
  for (size_t i = 0; i < k.size(); ++i) {
    check_same(ref, k[i], "k", i);
    check_same(ref, v[i], "v", i);
  }
  KvPlan plan;
  plan.num_layers = static_cast<int64_t>(k.size());
  plan.dtype = ref.scalar_type();
  plan.device = ref.device();
  plan.elem_bytes = static_cast<int64_t>(ref.element_size());
  const int64_t t_dim = layout == Layout::kTHD ? 0 : 2;
  const int64_t h_dim = 1;
  plan.num_tokens = ref.size(t_dim);
  plan.kv_heads = ref.size(h_dim);
  plan.head_dim = ref.size(-1);
  if (layout == Layout::kTHD) {
    TORCH_CHECK(batch_index == 0, "anchorcache: layout 'thd' has no batch dim; batch_index must "
                "be 0, got ", batch_index);
  } else {
    TORCH_CHECK(batch_index >= 0 && batch_index < ref.size(0), "anchorcache: batch_index ",
                batch_index, " out of range for batch size ", ref.size(0));
  }
  bool heads_adjacent = true;
  plan.sides.reserve(k.size() * 2);
  for (size_t i = 0; i < k.size(); ++i) {
    for (const at::Tensor* t : {&k[i], &v[i]}) {
      KvSide side;
      int64_t offset_bytes = 0;
      if (layout == Layout::kBHTD) offset_bytes = batch_index * t->stride(0) * plan.elem_bytes;
      side.base = static_cast<char*>(t->data_ptr()) + offset_bytes;
      side.stride_t_bytes = t->stride(t_dim) * plan.elem_bytes;
      side.stride_h_bytes = t->stride(h_dim) * plan.elem_bytes;
      if (plan.kv_heads > 1 && t->stride(h_dim) != plan.head_dim) heads_adjacent = false;
      plan.sides.push_back(side);
    }
  }
  plan.heads_per_row = heads_adjacent ? 1 : plan.kv_heads;
  plan.chunk_bytes = heads_adjacent ? plan.row_bytes() : plan.head_dim * plan.elem_bytes;
  return plan;
}

RowSel make_rows(const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                 int64_t num_tokens) {
  RowSel rows;
  if (!index.has_value()) {
    TORCH_CHECK(start >= 0 && start <= end && end <= num_tokens, "anchorcache: rows [", start,
                ", ", end, ") out of range for a cache of ", num_tokens, " tokens");
    rows.start = start;
    rows.n = end - start;
    return rows;
  }
  const at::Tensor& idx = *index;
  TORCH_CHECK(idx.dim() == 1, "anchorcache: a row index must be 1-D, got shape ", idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt,
              "anchorcache: a row index must be int64 (or int32), got ", idx.scalar_type());
  at::Tensor idx64 = idx.to(at::kLong).contiguous();
  rows.n = idx64.numel();
  if (rows.n > 0) {
    int64_t lo = 0;
    int64_t hi = 0;
    if (idx64.is_cpu()) {
      const int64_t* p = idx64.data_ptr<int64_t>();
      lo = hi = p[0];
      for (int64_t i = 1; i < rows.n; ++i) {
        lo = std::min(lo, p[i]);
        hi = std::max(hi, p[i]);
      }
    } else {
      auto [mn, mx] = at::aminmax(idx64);
      at::Tensor both = at::stack({mn, mx}).cpu();
      lo = both[0].item<int64_t>();
      hi = both[1].item<int64_t>();
    }
    TORCH_CHECK(lo >= 0 && hi < num_tokens, "anchorcache: row index holds values in [", lo, ", ",
                hi, "], out of range for a cache of ", num_tokens, " tokens");
  }
  rows.index = idx64;
  return rows;
}

std::vector<int64_t> slab_shape(const KvPlan& plan, int64_t n_rows) {
  return {plan.num_layers, 2, n_rows, plan.kv_heads, plan.head_dim};
}

int64_t check_slab(const KvPlan& plan, const at::Tensor& slab, const char* what) {
  TORCH_CHECK(slab.defined(), "anchorcache: ", what, " is undefined");
  TORCH_CHECK(slab.dim() == 5 && slab.size(0) == plan.num_layers && slab.size(1) == 2 &&
                  slab.size(3) == plan.kv_heads && slab.size(4) == plan.head_dim,
              "anchorcache: ", what, " must have shape [", plan.num_layers, ", 2, n_rows, ",
              plan.kv_heads, ", ", plan.head_dim, "], got ", slab.sizes());
  TORCH_CHECK(slab.scalar_type() == plan.dtype, "anchorcache: ", what, " has dtype ",
              slab.scalar_type(), " but the cache has ", plan.dtype);
  TORCH_CHECK(slab.is_contiguous(), "anchorcache: ", what, " must be contiguous");
  return slab.size(2);
}

std::vector<int64_t> state_offsets(at::TensorList states, int64_t index) {
  std::vector<int64_t> offsets;
  offsets.reserve(states.size() + 1);
  int64_t end = 0;
  for (size_t i = 0; i < states.size(); ++i) {
    const at::Tensor& s = states[i];
    TORCH_CHECK(s.defined() && s.dim() >= 1, "anchorcache: states[", i,
                "] needs a leading slot/batch dim");
    TORCH_CHECK(index >= 0 && index < s.size(0), "anchorcache: state index ", index,
                " out of range for states[", i, "] with ", s.size(0), " slots");
    const int64_t start = (end + kStateAlignBytes - 1) / kStateAlignBytes * kStateAlignBytes;
    offsets.push_back(start);
    end = start + (s.numel() / s.size(0)) * static_cast<int64_t>(s.element_size());
  }
  offsets.push_back(end);
  return offsets;
}

// A typed view of piece i of a uint8 slab, shaped like states[i][index].
static at::Tensor piece_view(const at::Tensor& slab, const at::Tensor& state, int64_t offset) {
  at::Tensor like = state.select(0, 0);
  const int64_t nbytes = like.numel() * static_cast<int64_t>(like.element_size());
  return slab.narrow(0, offset, nbytes).view(like.scalar_type()).view(like.sizes());
}

static void check_state_slab(const at::Tensor& slab, const std::vector<int64_t>& offsets) {
  TORCH_CHECK(slab.defined() && slab.dim() == 1 && slab.scalar_type() == at::kByte &&
                  slab.is_contiguous(),
              "anchorcache: a state slab must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(slab.numel() == offsets.back(), "anchorcache: state slab has ", slab.numel(),
              " bytes but the states need ", offsets.back());
}

void copy_states_to_slab(at::TensorList states, int64_t index, const at::Tensor& slab) {
  const std::vector<int64_t> offsets = state_offsets(states, index);
  check_state_slab(slab, offsets);
  int64_t end = 0;
  for (size_t i = 0; i < states.size(); ++i) {
    // Zero the alignment gap so equal states always give byte-identical slabs.
    if (offsets[i] > end) slab.narrow(0, end, offsets[i] - end).zero_();
    at::Tensor piece = piece_view(slab, states[i], offsets[i]);
    piece.copy_(states[i].select(0, index));
    end = offsets[i] + piece.numel() * static_cast<int64_t>(piece.element_size());
  }
}

void copy_slab_to_states(const at::Tensor& slab, at::TensorList states, int64_t index) {
  const std::vector<int64_t> offsets = state_offsets(states, index);
  check_state_slab(slab, offsets);
  for (size_t i = 0; i < states.size(); ++i) {
    states[i].select(0, index).copy_(piece_view(slab, states[i], offsets[i]));
  }
}

}  // namespace anchorcache
