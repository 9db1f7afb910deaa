"""The engine's export: a torch model (+ loss_fn) to a forward ONNX model, and the cache of built graphs.
"""
