// The one schema of the anchorcache operators. Implementations are registered per device:
// CPU in cpu_ops.cpp, CUDA in ext/cuda/kv_copy.cu. Python calls them only from ext/kernels.py.
//
// Rows of a copy are either `index` (1-D int64 token slots, SGLang's pool) or, when index is
// None, the range [start, end). A KV slab is [num_layers, 2, n_rows, kv_heads, head_dim] in
// the cache dtype; a state slab is flat uint8 (see kv_plan.h for the packing).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <torch/library.h>

TORCH_LIBRARY(anchorcache, m) {
  m.def(
      "snapshot_kv(Tensor[] k, Tensor[] v, Tensor? index, int start, int end, str layout, "
      "int batch_index) -> Tensor");
  m.def(
      "snapshot_kv_out(Tensor[] k, Tensor[] v, Tensor? index, int start, int end, str layout, "
      "int batch_index, Tensor(a!) out) -> ()");
  m.def("snapshot_state(Tensor[] states, int index) -> Tensor");
  m.def("snapshot_state_out(Tensor[] states, int index, Tensor(a!) out) -> ()");
  // Link j writes slabs[j] into rows indices[j] (or [starts[j], starts[j] + n_rows_j)) of every
  // layer, links in order; then state_slab (if given) goes into states[i][state_index].
  m.def(
      "restore_chain(Tensor[] slabs, Tensor?[] indices, int[] starts, str layout, "
      "int batch_index, Tensor(a!)[] k, Tensor(b!)[] v, Tensor? state_slab, "
      "Tensor(c!)[] states, int state_index) -> ()");
}
