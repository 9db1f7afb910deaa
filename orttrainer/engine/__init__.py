"""The engine (private): turns a model into one onnxruntime training session -- export, graph rewrites,
gradient and optimizer graphs, and the session that runs them. `orttrainer.py` is its only client.
"""
