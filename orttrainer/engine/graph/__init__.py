"""The engine's graph building: rewrites of the forward graph, the gradient, optimizer, recompute and
precision edits that make ONE training graph.
"""
