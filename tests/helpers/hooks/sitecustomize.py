"""Test hooks for real `orttrainer train` processes: a test puts this folder on PYTHONPATH and sets

    HOOK_SIGNAL_AT=N   the process sends itself SIGTERM after its N-th train_step call
    HOOK_SLEEP=S       sleep S seconds after every train_step call (a slow run to signal from outside)
    HOOK_SAMPLES=DIR   every rank appends the sample indices it reads to DIR/rank{RANK}.txt

Python imports `sitecustomize` at start-up, so the hooks reach every process of a run, torchrun's
ranks included, while the command line stays the real one. Without those variables it does nothing.
"""

import os

if os.environ.get("HOOK_SIGNAL_AT") or os.environ.get("HOOK_SLEEP"):
    import signal
    import time

    from orttrainer.run import loop

    _train = loop.train

    def _hooked_train(recipe, resume=None, **kwargs):
        signal_at = int(os.environ.get("HOOK_SIGNAL_AT", "0"))
        sleep = float(os.environ.get("HOOK_SLEEP", "0"))

        def on_micro_step(run):
            if signal_at and run.calls == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if sleep:
                time.sleep(sleep)

        kwargs["on_micro_step"] = on_micro_step
        return _train(recipe, resume, **kwargs)

    loop.train = _hooked_train

if os.environ.get("HOOK_SAMPLES"):
    # HOOK_SAMPLES=DIR   every rank appends the sample indices it reads to DIR/rank{RANK}.txt
    from orttrainer.run.data import sampler as _sampler

    _iter = _sampler.ResumableSampler.__iter__

    def _recording_iter(self):
        path = os.path.join(os.environ["HOOK_SAMPLES"], f"rank{os.environ.get('RANK', '0')}.txt")
        with open(path, "a", encoding="utf-8") as f:
            for index in _iter(self):
                f.write(f"{index}\n")
                f.flush()
                yield index

    _sampler.ResumableSampler.__iter__ = _recording_iter
