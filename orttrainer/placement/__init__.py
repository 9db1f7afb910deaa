"""Where a trainer runs (private): the parallel layout (data x tensor x pipeline), the device and
onnxruntime session options, and the torch.distributed process group. Below both the engine and the run.
"""
