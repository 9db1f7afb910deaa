"""The trainer's parts (private): which graphs and session serve a call, how they are built, and the
step counters -- what `orttrainer.py`, the legacy facade, delegates to.
"""
