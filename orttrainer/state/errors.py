"""The error type of the checkpoint modules."""


class _CheckpointError(ValueError, AssertionError):
    """Bad or inconsistent checkpoint files. A ValueError; also an AssertionError because the
    original raised bare assertions here and existing callers may catch those."""
