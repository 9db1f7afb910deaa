"""The engine's runtime: the onnxruntime session that runs a training graph, the state that outlives it,
the graph life cycle per input signature, and the checks of what users pass.
"""
