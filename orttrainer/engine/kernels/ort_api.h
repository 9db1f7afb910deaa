// What the custom-op library needs of onnxruntime's C API, declared here instead of shipped headers.
//
// The library does not link against onnxruntime and vendors none of its headers: onnxruntime hands
// RegisterCustomOps its API table, an append-only array of function pointers whose positions are
// fixed per API version. The few entries used are declared below by position (onnxruntime's C API,
// versions 1 and 17); docs/ort-notes.md says how they were checked.

#pragma once

#include <cstdint>
#include <exception>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
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
enum OrtElementType { ELEMENT_FLOAT = 1, ELEMENT_INT64 = 7, ELEMENT_BOOL = 9 };

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

namespace ort {

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

inline const OrtApi* g_api = nullptr;  // set by RegisterCustomOps (library.cc)

template <typename Fn>
Fn entry(int position) {
  return reinterpret_cast<Fn const*>(g_api)[position];
}

struct Failure : std::exception {
  std::string message;
  explicit Failure(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

inline void release(OrtStatus* status) { entry<void (*)(OrtStatus*)>(slot::ReleaseStatus)(status); }

// Calls an API entry returning OrtStatus*; a non-null status is released and becomes a Failure.
template <typename... Args>
void call(int position, const char* what, Args... args) {
  using Fn = OrtStatus* (*)(Args...);
  OrtStatus* status = entry<Fn>(position)(args...);
  if (status != nullptr) {
    release(status);
    throw Failure(std::string("onnxruntime's ") + what + " failed");
  }
}

inline OrtStatus* failed(const char* message) {
  return entry<OrtStatus* (*)(int, const char*)>(slot::CreateStatus)(ORT_FAIL, message);
}

inline std::vector<int64_t> dims_of(const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  call(slot::GetTensorTypeAndShape, "GetTensorTypeAndShape", value, &info);
  auto release_info = [&] { entry<void (*)(OrtTensorTypeAndShapeInfo*)>(slot::ReleaseTensorTypeAndShapeInfo)(info); };
  size_t count = 0;
  std::vector<int64_t> dims;
  try {
    call(slot::GetDimensionsCount, "GetDimensionsCount", static_cast<const OrtTensorTypeAndShapeInfo*>(info), &count);
    dims.resize(count);
    call(slot::GetDimensions, "GetDimensions", static_cast<const OrtTensorTypeAndShapeInfo*>(info), dims.data(),
         count);
  } catch (...) {
    release_info();
    throw;
  }
  release_info();
  return dims;
}

inline int64_t elements_of(const OrtValue* value) {
  int64_t n = 1;
  for (int64_t d : dims_of(value)) n *= d;
  return n;
}

// The buffer of a value; an input's too: kernels that update in place write through it.
template <typename T>
T* data_of(const OrtValue* value) {
  void* data = nullptr;
  call(slot::GetTensorMutableData, "GetTensorMutableData", const_cast<OrtValue*>(value), &data);
  return static_cast<T*>(data);
}

inline size_t input_count(const OrtKernelContext* context) {
  size_t count = 0;
  call(slot::KernelContext_GetInputCount, "KernelContext_GetInputCount", context, &count);
  return count;
}

// Input `index`, or nullptr where an optional input is absent.
inline const OrtValue* input(const OrtKernelContext* context, size_t index) {
  const OrtValue* value = nullptr;
  if (index < input_count(context)) call(slot::KernelContext_GetInput, "KernelContext_GetInput", context, index, &value);
  return value;
}

inline OrtValue* output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& shape) {
  OrtValue* value = nullptr;
  call(slot::KernelContext_GetOutput, "KernelContext_GetOutput", context, index, shape.data(), shape.size(), &value);
  return value;
}

// Runs fn(data, i) for i in [0, tasks) on the session's intra-op threads.
inline void parallel_for(OrtKernelContext* context, void (*fn)(void*, size_t), size_t tasks, void* data) {
  using ParallelFor = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
  OrtStatus* status = entry<ParallelFor>(slot::KernelContext_ParallelFor)(context, fn, tasks, size_t{0}, data);
  if (status != nullptr) {
    release(status);
    throw Failure("onnxruntime's KernelContext_ParallelFor failed");
  }
}

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
    release(status);
    return fallback;
  }
  return value;
}

// The description onnxruntime reads of an op `Op`, which names itself and its element types and
// computes through a kernel object made once per node:
//   static constexpr const char* name;  static constexpr int inputs[], outputs[];  (OrtElementType)
//   static bool optional(size_t input);
//   struct Kernel { explicit Kernel(const OrtKernelInfo*); void compute(OrtKernelContext*); };
// A kernel's exceptions become a failed status naming the op.
template <typename Op>
OrtCustomOp describe() {
  using Kernel = typename Op::Kernel;
  OrtCustomOp op{};
  op.version = 16;
  op.GetName = [](const OrtCustomOp*) { return Op::name; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) { return "CPUExecutionProvider"; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return Op::inputs[i]; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return std::size(Op::inputs); };
  op.GetOutputType = [](const OrtCustomOp*, size_t i) { return Op::outputs[i]; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return std::size(Op::outputs); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) { return Op::optional(i) ? 1 : 0; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) -> OrtStatus* {
    try {
      *out = new Kernel(info);
      return nullptr;
    } catch (const std::exception& e) {
      return failed((std::string(Op::name) + ": " + e.what()).c_str());
    }
  };
  op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) -> OrtStatus* {
    try {
      static_cast<Kernel*>(kernel)->compute(context);
      return nullptr;
    } catch (const std::exception& e) {
      return failed((std::string(Op::name) + ": " + e.what()).c_str());
    }
  };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  // Version-1 entries (onnxruntime 1.19 calls the V2 ones): exceptions reach onnxruntime, which
  // fails the run with them.
  op.CreateKernel = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) -> void* {
    return new Kernel(info);
  };
  op.KernelCompute = [](void* kernel, OrtKernelContext* context) { static_cast<Kernel*>(kernel)->compute(context); };
  return op;
}

}  // namespace ort

// The library's ops (torch_matmul.cc, adam.cc), registered by library.cc.
const OrtCustomOp* torch_matmul_op();
const OrtCustomOp* adam_op();
