// Validation and copy plans shared by the CPU (.cpp) and CUDA (.cu) implementations.
//
// A KV slab is always [num_layers, 2, n_rows, kv_heads, head_dim], contiguous, in the cache
// dtype; it does not depend on the cache layout, so a slab taken from one layout restores into
// the other. A copy is cut into "chunks": runs of bytes contiguous on both sides (one row of
// all heads when the heads of a token are adjacent in the cache, else one head row of
// head_dim elements). Chunk q of a slab lives at q * chunk_bytes, with
// q = ((layer * 2 + kv) * n_rows + row) * heads_per_chunk_row + head.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace anchorcache {

enum class Layout { kTHD, kBHTD };

Layout parse_layout(const std::string& layout);

// One cache tensor (layer, k or v) reduced to byte addressing. `base` already points at the
// selected batch entry (bhtd).
struct KvSide {
  char* base;
  int64_t stride_t_bytes;
  int64_t stride_h_bytes;
};

struct KvPlan {
  std::vector<KvSide> sides;  // num_layers * 2, order layer * 2 + kv
  int64_t num_layers = 0;
  int64_t num_tokens = 0;       // rows addressable in the cache (T)
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t elem_bytes = 0;
  int64_t chunk_bytes = 0;      // contiguous bytes per chunk
  int64_t heads_per_row = 0;    // chunks per token row: 1 when heads are adjacent, else kv_heads
  at::ScalarType dtype;
  at::Device device = at::kCPU;
  int64_t row_bytes() const { return kv_heads * head_dim * elem_bytes; }
};

// Checks k/v (same count, dtype, device, shape; head_dim stride 1; rank matching the layout;
// batch index in range) and builds the plan. Non-contiguous caches are accepted as long as
// head_dim is contiguous: they are addressed through their strides, never copied.
KvPlan plan_kv(at::TensorList k, at::TensorList v, const std::string& layout,
               int64_t batch_index);

// Rows of one copy: either index[0..n) (int64, on the plan's device or CPU) or start + [0, n).
struct RowSel {
  std::optional<at::Tensor> index;  // 1-D int64, contiguous
  int64_t start = 0;
  int64_t n = 0;
};

// Validates a [start, end) range or an index tensor against num_tokens. An index on CUDA is
// range-checked with one reduction (a device sync). Returns an int64 contiguous index.
RowSel make_rows(const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                 int64_t num_tokens);

std::vector<int64_t> slab_shape(const KvPlan& plan, int64_t n_rows);

// Checks that `slab` is a contiguous KV slab for `plan` with n_rows rows; returns n_rows.
int64_t check_slab(const KvPlan& plan, const at::Tensor& slab, const char* what);

// ---- recurrent / conv state: states[i][index] of every tensor, packed as bytes ----

constexpr int64_t kStateAlignBytes = 64;

// Byte offsets of each state piece inside the flat uint8 slab (64-byte aligned so every
// piece can be viewed with its own dtype; gaps are zero), plus the total size as the last
// element.
std::vector<int64_t> state_offsets(at::TensorList states, int64_t index);

// Copies states[i][index] into / out of a flat uint8 slab. Device-agnostic (Tensor::copy_),
// blocking: the data is in place when the call returns.
void copy_states_to_slab(at::TensorList states, int64_t index, const at::Tensor& slab);
void copy_slab_to_states(const at::Tensor& slab, at::TensorList states, int64_t index);

}  // namespace anchorcache
