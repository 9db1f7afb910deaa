// The custom-op library's entry point: onnxruntime calls RegisterCustomOps when a session's options
// load it, handing over its API table; both ops join the com.orttrainer domain.

#include "ort_api.h"

namespace {
OrtCustomOpDomain* g_domain = nullptr;  // lives as long as the process: sessions keep pointing at it
}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(ort::kApiVersion);
  if (api == nullptr) return nullptr;  // cannot even report: onnxruntime older than 1.17
  ort::g_api = api;
  try {
    using ort::call;
    namespace slot = ort::slot;
    if (g_domain == nullptr) {
      call(slot::CreateCustomOpDomain, "CreateCustomOpDomain", "com.orttrainer", &g_domain);
      call(slot::CustomOpDomain_Add, "CustomOpDomain_Add", g_domain, torch_matmul_op());
      call(slot::CustomOpDomain_Add, "CustomOpDomain_Add", g_domain, adam_op());
    }
    call(slot::AddCustomOpDomain, "AddCustomOpDomain", options, g_domain);
    return nullptr;
  } catch (const std::exception& e) {
    return ort::failed(e.what());
  }
}
