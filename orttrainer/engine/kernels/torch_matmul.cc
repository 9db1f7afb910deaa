// com.orttrainer::TorchMatMul -- a matrix product of the training graph computed by torch's kernels
// (MKL / oneDNN) inside the one onnxruntime session.
//
//   Y = alpha * op(A) @ op(B) [+ beta * C]     op(X) = X, or X with its last two dims swapped (transA/B)
//
// A, B, C and Y are fp32; batch dims broadcast as in numpy's matmul. `compute` = 1 computes the
// product in bfloat16 as torch.autocast does (operands rounded to bf16, fp32 accumulation inside
// oneDNN, the product rounded to bf16), then widens it into Y. Y comes from the session's memory plan
// (KernelContext_GetOutput), so the arena reuses it after its last reader, as it does a MatMul's.

#include "ort_api.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>

namespace {

using namespace ort;

// A fp32 tensor viewing an onnxruntime value's buffer (no copy).
at::Tensor view_of(const OrtValue* value) {
  return at::from_blob(data_of<float>(value), dims_of(value), at::TensorOptions().dtype(at::kFloat));
}

at::Tensor operand(at::Tensor x, bool transposed) {
  if (!transposed) return x;
  if (x.dim() < 2) throw Failure("TorchMatMul: a transposed operand needs at least two dims");
  return x.transpose(-1, -2);
}

struct Product {
  bool trans_a = false, trans_b = false, bf16 = false;
  float alpha = 1.0f, beta = 1.0f;
  int64_t blocks = 1;  // blocks per product: torch's thread count when the session was made

  explicit Product(const OrtKernelInfo* info);
  void compute(OrtKernelContext* context) const;
};

Product::Product(const OrtKernelInfo* info) {
  trans_a = attribute_or<int64_t>(info, "transA", 0) != 0;
  trans_b = attribute_or<int64_t>(info, "transB", 0) != 0;
  bf16 = attribute_or<int64_t>(info, "compute", 0) == 1;
  alpha = attribute_or<float>(info, "alpha", 1.0f);
  beta = attribute_or<float>(info, "beta", 1.0f);
  // Fixed per kernel, not read at each call: a block's row count chooses oneDNN's bf16 kernel, so a
  // count that varied with the threads' state would change the bf16 products from run to run.
  blocks = std::max(1, at::get_num_threads());
}

// The product split into blocks of rows (or of batches) run on onnxruntime's intra-op threads, each
// block by torch on one thread: torch's own OpenMP threads would compete for the cores with
// onnxruntime's pool, whose threads spin between kernels.
enum class Split { none, batch, rows };

struct Blocks {
  at::Tensor a, b, y, c;  // c: a Gemm's bias (undefined without one)
  bool bf16 = false;
  float alpha = 1.0f, beta = 1.0f;
  Split split = Split::none;  // batch: dim 0 of a, b and y (same rank); rows: y's and a's rows
  int dim = 0;                // the dim of y that is split
  int64_t size = 1, count = 1;
  std::mutex lock;  // guards error
  std::exception_ptr error;
};

void one_block(Blocks& w, int64_t index) {
  const int64_t start = w.size * index / w.count, stop = w.size * (index + 1) / w.count;
  if (stop <= start) return;
  at::Tensor a = w.a, b = w.b, y = w.y, c = w.c;
  if (w.split != Split::none) y = y.narrow(w.dim, start, stop - start);
  if (w.split == Split::batch) {
    a = a.narrow(0, start, stop - start);
    b = b.narrow(0, start, stop - start);
  } else if (w.split == Split::rows) {
    a = a.narrow(a.dim() - 2, start, stop - start);
    if (c.defined() && c.dim() >= 2 && c.size(-2) == w.size) c = c.narrow(c.dim() - 2, start, stop - start);
  }
  if (a.size(-1) == 0) {  // an empty inner dim: the product is zeros
    y.zero_();
  } else if (w.bf16) {
    y.copy_(at::matmul(a.to(at::kBFloat16), b.to(at::kBFloat16)));
  } else if (y.is_contiguous()) {
    at::matmul_out(y, a, b);
  } else {
    y.copy_(at::matmul(a, b));
  }
  if (w.alpha != 1.0f) y.mul_(w.alpha);
  if (c.defined()) y.add_(c, w.beta);
}

void run_block(void* data, size_t index) {
  auto& w = *static_cast<Blocks*>(data);
  try {
    at::set_num_threads(1);  // this thread's torch (OpenMP and MKL): one thread
    c10::InferenceMode no_autograd;
    one_block(w, static_cast<int64_t>(index));
  } catch (...) {
    std::lock_guard<std::mutex> guard(w.lock);
    if (!w.error) w.error = std::current_exception();  // the first one is reported by the caller
  }
}

constexpr int64_t kRowsPerBlock = 64;  // fewer rows than this per block cost more than they share

void product_in_blocks(OrtKernelContext* context, const Product& k, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& c, at::Tensor& y) {
  Blocks w;
  w.a = a;
  w.b = b;
  w.c = c;
  w.y = y;
  w.bf16 = k.bf16;
  w.alpha = k.alpha;
  w.beta = k.beta;
  // One block per thread: every block packs B again (oneDNN, MKL), so more blocks cost more.
  const int threads = at::get_num_threads();
  const int64_t blocks = k.blocks;
  const bool same_rank = a.dim() == y.dim() && b.dim() == y.dim() && y.dim() >= 3;
  if (same_rank && y.size(0) >= 2 && a.size(0) == y.size(0) && b.size(0) == y.size(0)) {
    w.split = Split::batch;
    w.size = y.size(0);
    w.count = std::min<int64_t>(w.size, blocks);
  } else if (a.dim() >= 2 && y.dim() >= 2) {  // y's rows are op(A)'s rows
    w.split = Split::rows;
    w.dim = static_cast<int>(y.dim()) - 2;
    w.size = y.size(w.dim);
    w.count = std::max<int64_t>(1, std::min<int64_t>(blocks, w.size / kRowsPerBlock));
  }
  try {
    parallel_for(context, run_block, static_cast<size_t>(w.count), &w);
  } catch (...) {
    at::set_num_threads(threads);
    throw;
  }
  at::set_num_threads(threads);  // the caller's torch as it was
  if (w.error) std::rethrow_exception(w.error);
}

void Product::compute(OrtKernelContext* context) const {
  const Product& k = *this;
  const OrtValue* values[3] = {input(context, 0), input(context, 1), input(context, 2)};
  if (values[0] == nullptr || values[1] == nullptr) throw Failure("TorchMatMul: inputs A and B are required");
  at::Tensor a = operand(view_of(values[0]), k.trans_a);
  at::Tensor b = operand(view_of(values[1]), k.trans_b);
  if (a.dim() < 1 || b.dim() < 1) throw Failure("TorchMatMul: operands must have at least one dim");

  // The product's shape, as at::matmul gives it (numpy rules, broadcast batch dims).
  c10::InferenceMode no_autograd;  // plain kernels: nothing here needs a gradient
  std::vector<int64_t> shape;
  {
    auto meta_a = at::empty(a.sizes(), at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
    auto meta_b = at::empty(b.sizes(), at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
    auto meta_y = at::matmul(meta_a, meta_b);
    shape.assign(meta_y.sizes().begin(), meta_y.sizes().end());
  }
  void* y_data = data_of<float>(output(context, 0, shape));
  at::Tensor y = at::from_blob(y_data, shape, at::TensorOptions().dtype(at::kFloat));
  if (y.numel() == 0) return;
  product_in_blocks(context, k, a, b, values[2] != nullptr ? view_of(values[2]) : at::Tensor(), y);
}

struct TorchMatMul {
  static constexpr const char* name = "TorchMatMul";
  static constexpr int inputs[] = {ELEMENT_FLOAT, ELEMENT_FLOAT, ELEMENT_FLOAT};  // A, B, C (optional)
  static constexpr int outputs[] = {ELEMENT_FLOAT};
  static bool optional(size_t input) { return input == 2; }
  using Kernel = Product;
};

}  // namespace

const OrtCustomOp* torch_matmul_op() {
  static const OrtCustomOp op = ort::describe<TorchMatMul>();
  return &op;
}
