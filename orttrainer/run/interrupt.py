"""Ctrl-C and SIGTERM during `orttrainer train`: a request to stop at the next safe point.

The first signal only records the request (the loop saves a checkpoint and exits 130 or 143). A second
SIGINT more than REPEAT_SECONDS after the first raises KeyboardInterrupt (abort now): one Ctrl-C reaches a
torchrun rank twice, from the terminal and forwarded by torchrun. Repeated SIGTERMs are ignored (the
scheduler's SIGKILL follows anyway).
"""

import signal
import threading
import time

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Interrupt:
    """Installs the handlers while entered; `requested` and `signal` say what arrived."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_SECONDS = 1.0

    def __init__(self):
        self.requested = False
        self.signal = None
        self._at = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.requested:
            if signum == signal.SIGINT and now - self._at > self.REPEAT_SECONDS:
                self.restore()
                raise KeyboardInterrupt
            return
        self.requested, self.signal, self._at = True, signum, now  # no printing: it may interrupt a print

    def stop_elsewhere(self):
        """Another rank received the signal: stop here too. A later Ctrl-C on this rank is then a second
        one (abort), timed from now unless a signal of its own came first."""
        self.requested = True
        self._at = self._at or time.monotonic()

    def restore(self):
        """The handlers that were there before (idempotent)."""
        for signum, previous in self._previous.items():
            if previous is None:
                previous = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, previous)
        self._previous = {}

    def __exit__(self, *exc):
        if not self.requested:  # a stop on any rank's signal: kept, as a SIGTERM (torchrun stops the
            self.restore()       # ranks once one exits) must not kill the interrupt save; train() restores
        return False
