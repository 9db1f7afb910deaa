"""Custom torch.autograd.Functions in the graph: exported as onnxruntime's PythonOp and run by our runners.
"""
