"""The engine's parallel runtimes over torch.distributed: data parallel and ZeRO-1, Adasum, Megatron
tensor parallel, and pipeline parallel (the cut and the stage's schedule).
"""
