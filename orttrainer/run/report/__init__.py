"""What a run reports: the console and metrics files, TensorBoard and the measures behind MFU, plots,
and onnxruntime's per-node profile.
"""
