// CUDA implementation of the anchorcache operators (schema in ext/csrc/schema.cpp).
//
// One kernel moves every chunk of a copy (all layers, K and V) in one launch: a grid-stride
// loop over machine words, consecutive threads on consecutive words of a chunk, so both the
// cache side and the slab side are coalesced. A pinned host slab is read or written in place
// through unified addressing (zero-copy, PCIe-bound); a device slab is HBM-bound; a pageable
// host slab goes through a device staging copy. Every op returns when its data is in place
// (the current stream is synchronized), so callers may read or free slabs right away.
#include "../csrc/kv_ops.h"

#include <ATen/ATen.h>
// c10/cuda headers only: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers that a bare
// toolkit install may lack, and nothing here needs them.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <numeric>

namespace anchorcache {
namespace {

constexpr int kThreads = 256;

// table: per side (layer * 2 + kv) three int64: base address, token stride, head stride (bytes).
template <typename Word, bool kToSlab>
__global__ void copy_chunks_kernel(const int64_t* __restrict__ table,
                                   const int64_t* __restrict__ index, int64_t start,
                                   int64_t n_rows, int64_t heads_per_row,
                                   int64_t words_per_chunk, char* __restrict__ slab,
                                   int64_t total_words) {
  const int64_t per_side = n_rows * heads_per_row;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total_words;
       i += step) {
    const int64_t q = i / words_per_chunk;
    const int64_t w = i - q * words_per_chunk;
    const int64_t side = q / per_side;
    const int64_t rem = q - side * per_side;
    const int64_t r = rem / heads_per_row;
    const int64_t h = rem - r * heads_per_row;
    const int64_t t = index != nullptr ? index[r] : start + r;
    char* cache = reinterpret_cast<char*>(table[side * 3]) + t * table[side * 3 + 1] +
                  h * table[side * 3 + 2];
    Word* c = reinterpret_cast<Word*>(cache) + w;
    Word* s = reinterpret_cast<Word*>(slab) + q * words_per_chunk + w;
    if (kToSlab) {
      *s = *c;
    } else {
      *c = *s;
    }
  }
}

// Largest power-of-two word (<= 16 bytes) dividing every address, stride and the chunk size.
int64_t word_bytes(const KvPlan& plan, const char* slab) {
  int64_t g = plan.chunk_bytes;
  g = std::gcd(g, static_cast<int64_t>(reinterpret_cast<uintptr_t>(slab)));
  for (const KvSide& s : plan.sides) {
    g = std::gcd(g, static_cast<int64_t>(reinterpret_cast<uintptr_t>(s.base)));
    g = std::gcd(g, s.stride_t_bytes);
    g = std::gcd(g, s.stride_h_bytes);
  }
  for (int64_t w : {16, 8, 4, 2}) {
    if (g % w == 0) return w;
  }
  return 1;
}

template <typename Word>
void launch(bool to_slab, dim3 grid, cudaStream_t stream, const int64_t* table,
            const int64_t* index, const RowSel& rows, const KvPlan& plan, char* slab,
            int64_t total_words) {
  const int64_t wpc = plan.chunk_bytes / static_cast<int64_t>(sizeof(Word));
  if (to_slab) {
    copy_chunks_kernel<Word, true><<<grid, kThreads, 0, stream>>>(
        table, index, rows.start, rows.n, plan.heads_per_row, wpc, slab, total_words);
  } else {
    copy_chunks_kernel<Word, false><<<grid, kThreads, 0, stream>>>(
        table, index, rows.start, rows.n, plan.heads_per_row, wpc, slab, total_words);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The device address of a slab: itself on CUDA; for pinned host memory the mapped address
// (equal to the host address under unified addressing, which is what a failed query means).
char* device_address(const at::Tensor& t) {
  char* p = static_cast<char*>(t.data_ptr());
  if (t.is_cuda()) return p;
  void* d = nullptr;
  if (cudaHostGetDevicePointer(&d, p, 0) == cudaSuccess && d != nullptr) {
    return static_cast<char*>(d);
  }
  (void)cudaGetLastError();  // clear the (non-sticky) error left by the failed query
  return p;
}

at::Tensor alloc_host_pinned(at::IntArrayRef shape, at::ScalarType dtype) {
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(true));
}

void copy_kv_cuda(const KvPlan& plan, const RowSel& rows, const at::Tensor& slab, bool to_slab) {
  TORCH_CHECK(plan.device.is_cuda(), "anchorcache: KV tensors must be on a CUDA device when a "
              "slab or index is on CUDA, got ", plan.device);
  const c10::cuda::CUDAGuard guard(plan.device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(plan.device.index());
  TORCH_CHECK(slab.is_cpu() || slab.device() == plan.device, "anchorcache: a slab must be on the "
              "CPU or on the cache's device ", plan.device, ", got ", slab.device());
  const int64_t total_bytes = static_cast<int64_t>(plan.sides.size()) * rows.n *
                              plan.heads_per_row * plan.chunk_bytes;
  if (total_bytes == 0) return;

  // Pinned host and device slabs are addressed directly; pageable host memory is staged.
  const bool direct = slab.is_cuda() || slab.is_pinned();
  at::Tensor target = slab;
  if (!direct) target = to_slab ? at::empty_like(slab, slab.options().device(plan.device))
                                : slab.to(plan.device);

  at::Tensor index;
  if (rows.index.has_value()) {
    TORCH_CHECK(rows.index->is_cpu() || rows.index->device() == plan.device, "anchorcache: the "
                "row index must be on the CPU or on the cache's device ", plan.device);
    index = rows.index->to(plan.device);
  }
  std::vector<int64_t> host_table;
  host_table.reserve(plan.sides.size() * 3);
  for (const KvSide& s : plan.sides) {
    host_table.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(s.base)));
    host_table.push_back(s.stride_t_bytes);
    host_table.push_back(s.stride_h_bytes);
  }
  at::Tensor table = at::tensor(host_table, at::kLong).to(plan.device);

  char* slab_ptr = device_address(target);
  const int64_t wb = word_bytes(plan, slab_ptr);
  const int64_t total_words = total_bytes / wb;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        plan.device.index()));
  const int64_t blocks = std::min<int64_t>((total_words + kThreads - 1) / kThreads,
                                           static_cast<int64_t>(sms) * 16);
  const dim3 grid(static_cast<unsigned>(blocks));
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* idx = index.defined() ? index.data_ptr<int64_t>() : nullptr;
  switch (wb) {
    case 16: launch<uint4>(to_slab, grid, stream, tab, idx, rows, plan, slab_ptr, total_words); break;
    case 8: launch<uint2>(to_slab, grid, stream, tab, idx, rows, plan, slab_ptr, total_words); break;
    case 4: launch<uint32_t>(to_slab, grid, stream, tab, idx, rows, plan, slab_ptr, total_words); break;
    case 2: launch<uint16_t>(to_slab, grid, stream, tab, idx, rows, plan, slab_ptr, total_words); break;
    default: launch<uint8_t>(to_slab, grid, stream, tab, idx, rows, plan, slab_ptr, total_words); break;
  }
  if (!direct && to_slab) slab.copy_(target);
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
}

const Backend kCuda{&alloc_host_pinned, &copy_kv_cuda};

at::Tensor snapshot_kv_cuda(at::TensorList k, at::TensorList v,
                            const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                            const std::string& layout, int64_t batch_index) {
  return snapshot_kv(kCuda, k, v, index, start, end, layout, batch_index);
}

void snapshot_kv_out_cuda(at::TensorList k, at::TensorList v,
                          const std::optional<at::Tensor>& index, int64_t start, int64_t end,
                          const std::string& layout, int64_t batch_index, const at::Tensor& out) {
  snapshot_kv_out(kCuda, k, v, index, start, end, layout, batch_index, out);
}

at::Tensor snapshot_state_cuda(at::TensorList states, int64_t index) {
  return snapshot_state(kCuda, states, index);
}

void snapshot_state_out_cuda(at::TensorList states, int64_t index, const at::Tensor& out) {
  snapshot_state_out(kCuda, states, index, out);
}

void restore_chain_cuda(at::TensorList slabs,
                        const c10::List<std::optional<at::Tensor>>& indices,
                        at::IntArrayRef starts, const std::string& layout, int64_t batch_index,
                        at::TensorList k, at::TensorList v,
                        const std::optional<at::Tensor>& state_slab, at::TensorList states,
                        int64_t state_index) {
  restore_chain(kCuda, slabs, indices, starts, layout, batch_index, k, v, state_slab, states,
                state_index);
}

}  // namespace

TORCH_LIBRARY_IMPL(anchorcache, CUDA, m) {
  m.impl("snapshot_kv", &snapshot_kv_cuda);
  m.impl("snapshot_kv_out", &snapshot_kv_out_cuda);
  m.impl("snapshot_state", &snapshot_state_cuda);
  m.impl("snapshot_state_out", &snapshot_state_out_cuda);
  m.impl("restore_chain", &restore_chain_cuda);
}

}  // namespace anchorcache
