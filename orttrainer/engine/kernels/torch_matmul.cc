// com.orttrainer::TorchMatMul -- a matrix product of the training graph computed by torch's kernels
// (MKL / oneDNN) inside the one onnxruntime session, as an onnxruntime custom-op library.
//
//   Y = alpha * op(A) @ op(B) [+ beta * C]     op(X) = X, or X with its last two dims swapped (transA/B)
//
// A, B, C and Y are fp32; batch dims broadcast as in numpy's matmul. `compute` = 1 computes the
// product in bfloat16 as torch.autocast does (operands rounded to bf16, fp32 accumulation inside
// oneDNN, the product rounded to bf16), then widens it into Y. Y comes from the session's memory plan
// (KernelContext_GetOutput), so the arena reuses it after its last reader, as it does a MatMul's.
//
// The library does not link against onnxruntime and ships none of its headers: onnxruntime hands
// RegisterCustomOps its API table, an append-only array of function pointers whose positions are
// fixed per API version. The few entries used here are declared below by position (onnxruntime's
// C API, versions 1 and 17); docs/ort-notes.md says how they were checked.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

extern "C" {

struct OrtStatus;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;
struct OrtApi;

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum OrtElementType { ELEMENT_FLOAT = 1 };

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// The custom-op description onnxruntime reads, up to the fields of API version 16 (`version` says
// how many it may read).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  int (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  int (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);   // 0 required, 1 optional
  int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t);       // 0: the provider's default memory
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
};

}  // extern "C"

namespace {

// Positions in onnxruntime's OrtApi table.
namespace slot {
constexpr int CreateCustomOpDomain = 26, CustomOpDomain_Add = 27, AddCustomOpDomain = 28;
constexpr int GetTensorMutableData = 51, GetDimensionsCount = 61, GetDimensions = 62;
constexpr int GetTensorTypeAndShape = 65;
constexpr int KernelInfoGetAttribute_float = 85, KernelInfoGetAttribute_int64 = 86;
constexpr int KernelContext_GetInputCount = 88, KernelContext_GetInput = 90, KernelContext_GetOutput = 91;
constexpr int ReleaseStatus = 93, ReleaseTensorTypeAndShapeInfo = 99;
constexpr int CreateStatus = 0, KernelContext_ParallelFor = 274;
}  // namespace slot

constexpr uint32_t kApiVersion = 17;  // KernelContext_ParallelFor's version; onnxruntime 1.19 serves 19

const OrtApi* g_api = nullptr;

template <typename Fn>
Fn entry(int position) {
  return reinterpret_cast<Fn const*>(g_api)[position];
}

struct Failure : std::exception {
  std::string message;
  explicit Failure(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

// Calls an API entry returning OrtStatus*; a non-null status is released and becomes a Failure.
template <typename... Args>
void call(int position, const char* what, Args... args) {
  using Fn = OrtStatus* (*)(Args...);
  OrtStatus* status = entry<Fn>(position)(args...);
  if (status != nullptr) {
    entry<void (*)(OrtStatus*)>(slot::ReleaseStatus)(status);
    throw Failure(std::string("TorchMatMul: onnxruntime's ") + what + " failed");
  }
}

std::vector<int64_t> dims_of(const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  call(slot::GetTensorTypeAndShape, "GetTensorTypeAndShape", value, &info);
  size_t count = 0;
  std::vector<int64_t> dims;
  try {
    call(slot::GetDimensionsCount, "GetDimensionsCount", static_cast<const OrtTensorTypeAndShapeInfo*>(info), &count);
    dims.resize(count);
    call(slot::GetDimensions, "GetDimensions", static_cast<const OrtTensorTypeAndShapeInfo*>(info), dims.data(),
         count);
  } catch (...) {
    entry<void (*)(OrtTensorTypeAndShapeInfo*)>(slot::ReleaseTensorTypeAndShapeInfo)(info);
    throw;
  }
  entry<void (*)(OrtTensorTypeAndShapeInfo*)>(slot::ReleaseTensorTypeAndShapeInfo)(info);
  return dims;
}

// A fp32 tensor viewing an onnxruntime value's buffer (no copy).
at::Tensor view_of(const OrtValue* value) {
  void* data = nullptr;
  call(slot::GetTensorMutableData, "GetTensorMutableData", const_cast<OrtValue*>(value), &data);
  return at::from_blob(data, dims_of(value), at::TensorOptions().dtype(at::kFloat));
}

at::Tensor operand(at::Tensor x, bool transposed) {
  if (!transposed) return x;
  if (x.dim() < 2) throw Failure("TorchMatMul: a transposed operand needs at least two dims");
  return x.transpose(-1, -2);
}

struct Kernel {
  bool trans_a = false, trans_b = false, bf16 = false;
  float alpha = 1.0f, beta = 1.0f;
  int64_t blocks = 1;  // blocks per product: torch's thread count when the session was made
};

template <typename T>
T attribute_or(const OrtKernelInfo* info, const char* name, T fallback) {
  T value{};
  OrtStatus* status = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    status = entry<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(slot::KernelInfoGetAttribute_float)(
        info, name, &value);
  } else {
    status = entry<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(
        slot::KernelInfoGetAttribute_int64)(info, name, &value);
  }
  if (status != nullptr) {  // absent: its default
    entry<void (*)(OrtStatus*)>(slot::ReleaseStatus)(status);
    return fallback;
  }
  return value;
}

OrtStatus* failed(const char* message) {
  return entry<OrtStatus* (*)(int, const char*)>(slot::CreateStatus)(ORT_FAIL, message);
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  try {
    auto k = std::make_unique<Kernel>();
    k->trans_a = attribute_or<int64_t>(info, "transA", 0) != 0;
    k->trans_b = attribute_or<int64_t>(info, "transB", 0) != 0;
    k->bf16 = attribute_or<int64_t>(info, "compute", 0) == 1;
    k->alpha = attribute_or<float>(info, "alpha", 1.0f);
    k->beta = attribute_or<float>(info, "beta", 1.0f);
    // Fixed per kernel, not read at each call: a block's row count chooses oneDNN's bf16 kernel, so a
    // count that varied with the threads' state would change the bf16 products from run to run.
    k->blocks = std::max(1, at::get_num_threads());
    *out = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return failed(e.what());
  }
}

void* create_kernel_v1(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  void* kernel = nullptr;
  OrtStatus* status = create_kernel(op, api, info, &kernel);
  if (status != nullptr) entry<void (*)(OrtStatus*)>(slot::ReleaseStatus)(status);
  return kernel;
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

void product_in_blocks(OrtKernelContext* context, const Kernel& k, const at::Tensor& a, const at::Tensor& b,
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
  using ParallelFor = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
  OrtStatus* status = entry<ParallelFor>(slot::KernelContext_ParallelFor)(
      context, run_block, static_cast<size_t>(w.count), size_t{0}, &w);
  at::set_num_threads(threads);  // the caller's torch as it was
  if (status != nullptr) {
    entry<void (*)(OrtStatus*)>(slot::ReleaseStatus)(status);
    throw Failure("TorchMatMul: onnxruntime's KernelContext_ParallelFor failed");
  }
  if (w.error) std::rethrow_exception(w.error);
}

void compute(const Kernel& k, OrtKernelContext* context) {
  size_t inputs = 0;
  call(slot::KernelContext_GetInputCount, "KernelContext_GetInputCount",
       static_cast<const OrtKernelContext*>(context), &inputs);
  const OrtValue* values[3] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < inputs && i < 3; ++i)
    call(slot::KernelContext_GetInput, "KernelContext_GetInput", static_cast<const OrtKernelContext*>(context), i,
         &values[i]);
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
  OrtValue* y_value = nullptr;
  call(slot::KernelContext_GetOutput, "KernelContext_GetOutput", context, size_t{0},
       static_cast<const int64_t*>(shape.data()), shape.size(), &y_value);
  void* y_data = nullptr;
  call(slot::GetTensorMutableData, "GetTensorMutableData", y_value, &y_data);
  at::Tensor y = at::from_blob(y_data, shape, at::TensorOptions().dtype(at::kFloat));
  if (y.numel() == 0) return;
  product_in_blocks(context, k, a, b, values[2] != nullptr ? view_of(values[2]) : at::Tensor(), y);
}

OrtStatus* compute_v2(void* kernel, OrtKernelContext* context) {
  try {
    compute(*static_cast<Kernel*>(kernel), context);
    return nullptr;
  } catch (const std::exception& e) {
    return failed(e.what());
  }
}

void compute_v1(void* kernel, OrtKernelContext* context) { compute(*static_cast<Kernel*>(kernel), context); }
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }

const char* op_name(const OrtCustomOp*) { return "TorchMatMul"; }
const char* op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
int float_type(const OrtCustomOp*, size_t) { return ELEMENT_FLOAT; }
size_t three(const OrtCustomOp*) { return 3; }
size_t one(const OrtCustomOp*) { return 1; }
int input_characteristic(const OrtCustomOp*, size_t index) { return index == 2 ? 1 : 0; }
int required(const OrtCustomOp*, size_t) { return 0; }
int default_memory(const OrtCustomOp*, size_t) { return 0; }
int arity_one(const OrtCustomOp*) { return 1; }
int homogeneous(const OrtCustomOp*) { return 1; }

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = 16;
  op.CreateKernel = create_kernel_v1;
  op.GetName = op_name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = float_type;
  op.GetInputTypeCount = three;
  op.GetOutputType = float_type;
  op.GetOutputTypeCount = one;
  op.KernelCompute = compute_v1;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = input_characteristic;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = arity_one;
  op.GetVariadicInputHomogeneity = homogeneous;
  op.GetVariadicOutputMinArity = arity_one;
  op.GetVariadicOutputHomogeneity = homogeneous;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute_v2;
  return op;
}

OrtCustomOp g_op = make_op();
OrtCustomOpDomain* g_domain = nullptr;  // lives as long as the process: sessions keep pointing at it

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(kApiVersion);
  if (api == nullptr) return nullptr;  // cannot even report: onnxruntime older than 1.17
  g_api = api;
  try {
    if (g_domain == nullptr) {
      call(slot::CreateCustomOpDomain, "CreateCustomOpDomain", "com.orttrainer", &g_domain);
      call(slot::CustomOpDomain_Add, "CustomOpDomain_Add", g_domain, static_cast<const OrtCustomOp*>(&g_op));
    }
    call(slot::AddCustomOpDomain, "AddCustomOpDomain", options, g_domain);
    return nullptr;
  } catch (const std::exception& e) {
    return failed(e.what());
  }
}
