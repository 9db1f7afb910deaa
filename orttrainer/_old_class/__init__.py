"""The old `onnxruntime.capi.ort_trainer` class's helpers (private): its module-level functions and its
optimizer arguments as a new optimizer config, re-exported by `orttrainer.ort_trainer`.
"""
