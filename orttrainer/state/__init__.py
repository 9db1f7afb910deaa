"""The legacy state_dict (private): where each entry lives among the session's buffers, the checks a
load runs before it changes anything, the Megatron and pipeline parts, and the aggregation of rank files.
"""
