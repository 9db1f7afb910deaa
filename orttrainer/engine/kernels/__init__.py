"""torch's matrix kernels inside the one onnxruntime session: a custom-op library (torch_matmul.cc)
built from source once per install, its self-test, and the per-host choice of kernel."""
