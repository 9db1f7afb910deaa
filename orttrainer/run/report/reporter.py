"""What a run tells the user and writes about itself: the console (progress bar or log lines),
metrics.jsonl, results.json and the closing summary.
"""

import json
import sys
import time

from orttrainer.run import evaluation
from orttrainer.run.report import measures as watch
from orttrainer.run.errors import TrainingError
from orttrainer.run.run_folder import open_append, write_durably  # noqa: F401 - callers import it here

METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.json"


def read_metrics(path):
    """The records of a metrics.jsonl, in order; a line cut short by a crash is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


def _fmt_seconds(seconds):
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(int(round(seconds)), 60)
    return f"{minutes}m{sec:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m{sec:02d}s"


def _json_line(record):
    return json.dumps(record, allow_nan=True) + "\n"


class Console:
    """Progress bar (tqdm, on a terminal) or periodic log lines; messages go around the bar."""

    def __init__(self, mode, stream=None):
        self.stream = stream or sys.stdout
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar_enabled = is_tty if mode == "auto" else bool(mode)
        self.bar = None
        self.quiet = False  # ranks other than 0 of a multi-process run

    def silence(self):
        self.quiet, self.bar_enabled = True, False

    def say(self, text):
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def open_bar(self, total, initial, desc):
        if not self.bar_enabled:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=self.stream,
                        dynamic_ncols=True, smoothing=0.1)

    def close_bar(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Reporter:
    """What a run reports: the console's progress bar and log lines, metrics.jsonl, TensorBoard
    (run.report_to), results.json and the summary; it owns the log interval (`maybe_log`), the window
    of losses and times since the last log and the run's throughput counters (`state_dict`).

    Rank 0 writes the files; every rank calls `maybe_log` (the loss is averaged over the ranks).
    """

    def __init__(self, out, recipe, console, ranks, trainer, *, end_step, seq_length, tokens_per_micro,
                 flops_per_token, matmul_gflops, t_start, lr, resume_command=None):
        self.out, self.recipe, self.console, self.ranks, self.trainer = out, recipe, console, ranks, trainer
        self.log_every = recipe.run.log_every
        self.end_step, self.seq_length, self.tokens_per_micro = end_step, seq_length, tokens_per_micro
        self.flops_per_token, self.matmul_gflops = flops_per_token, matmul_gflops
        self.t_start, self.lr, self.resume_command = t_start, lr, resume_command
        self.metrics = self.board = None
        self.startup = None
        self.load_state_dict({"window": _new_window(), "first_loss": None, "last_loss": None,
                              "train_seconds": 0.0, "train_tokens": 0})

    def state_dict(self):
        return {"window": dict(self.window), "first_loss": self.first_loss, "last_loss": self.last_loss,
                "train_seconds": self.train_seconds, "train_tokens": self.train_tokens}

    def load_state_dict(self, state):
        self.window = dict(state["window"])
        self.first_loss, self.last_loss = state.get("first_loss"), state.get("last_loss")
        self.train_seconds, self.train_tokens = state["train_seconds"], state["train_tokens"]

    def open(self, step, resumed):
        """metrics.jsonl (a resumed run keeps the records up to its step) and the TensorBoard writer."""
        if not self.ranks.is_main:
            return  # rank 0 writes the run's files
        path = self.out / METRICS_FILE
        kept = []
        if resumed and path.exists():
            kept = [_json_line(r) for r in read_metrics(path) if r.get("step", 0) <= step]
        elif not resumed and path.exists():
            path.unlink()
        write_durably(path, "".join(kept))
        self.metrics = open_append(path)
        if "tensorboard" in self.recipe.run.report_to:
            self.board = watch.Board.open(self.out / watch.TB_FOLDER, step if resumed else None)

    def record(self, record):
        if self.metrics is None:
            return
        try:
            self.metrics.write(_json_line(record))
            self.metrics.flush()
            if self.board is not None:
                self.board.scalars(record["kind"], record, record["step"])
        except OSError as exc:
            resume = f"; resume with: {self.resume_command}" if self.resume_command else ""
            raise TrainingError(f"cannot append to {self.metrics.name}: {exc.strerror or exc}{resume}") from None

    def close(self):
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def count(self, loss, seconds=None):
        """One train_step call's loss; `seconds` it took (None: the first call, which is start-up)."""
        w = self.window
        w["loss_sum"] += loss
        w["losses"] += 1
        if seconds is not None:
            w["seconds"] = w.get("seconds", 0.0) + seconds
            w["timed_tokens"] = w.get("timed_tokens", 0) + self.tokens_per_micro
            self.train_seconds += seconds
            self.train_tokens += self.tokens_per_micro

    def maybe_log(self, step, loss, skipped):
        """A new optimizer step: the progress bar moves; every log_every steps and at the last one, a
        metrics.jsonl record and (without a bar) a log line. `loss`: this rank's last micro-step's."""
        if self.console.bar is not None:
            postfix = {"loss": f"{loss:.4f}", "lr": f"{self.lr():.2e}"}
            seconds = self.window.get("seconds", 0.0)
            if seconds:
                postfix["tok/s"] = f"{self.window['timed_tokens'] / seconds:,.0f}"
            self.console.bar.set_postfix(postfix, refresh=False)
            self.console.bar.update(step - self.console.bar.n)
        if step % self.log_every == 0 or step == self.end_step:
            self._log(step, skipped)
            return True
        return False

    def _mfu(self, tokens_per_s):
        """Model FLOPs utilisation against the matmul rate measured at start-up (measures.py)."""
        if not tokens_per_s or not self.matmul_gflops:
            return None
        return tokens_per_s * self.flops_per_token / (self.ranks.world_size * self.matmul_gflops * 1e9)

    def _log(self, step, skipped):
        w = self.window
        loss = self.ranks.mean(w["loss_sum"] / max(1, w["losses"]))  # the global batch's loss
        seconds = w.get("seconds", 0.0)
        tokens_per_s = (w["timed_tokens"] / seconds) if seconds > 0 and w.get("timed_tokens") else None
        record = {"kind": "train", "step": step, "loss": loss, "lr": self.lr(),
                  "tokens_per_s": tokens_per_s, "micro_steps": w["losses"]}
        if self.trainer.loss_scaler is not None:
            record["loss_scale"] = float(self.trainer.loss_scaler.loss_scale)
            record["skipped_steps"] = skipped
            record["nan_steps"] = self.trainer.mixed_precision_counters.nan_steps
        record["grad_norm"] = self.trainer.last_gradient_norm
        record["mfu"] = self._mfu(tokens_per_s)
        record["peak_rss_mb"] = watch.peak_rss_mb()
        self.record(record)
        if self.first_loss is None:
            self.first_loss = {"step": step, "loss": loss}
        self.last_loss = {"step": step, "loss": loss}
        if self.console.bar is None:
            line = (f"step {step:>{len(str(self.end_step))}}/{self.end_step} | loss {loss:.4f} | "
                    f"lr {record['lr']:.2e}")
            if tokens_per_s:
                line += f" | {tokens_per_s:,.0f} tok/s"
            if "loss_scale" in record:
                line += f" | loss scale {record['loss_scale']:g}, skipped {skipped}"
            self.console.say(line + f" | {_fmt_seconds(time.perf_counter() - self.t_start)}")
        self.window = _new_window()

    def set_startup(self, data_seconds, model_seconds, now=None):
        """The start-up times of results.json; `now`: the first step is done (printed, and its total)."""
        startup = dict(self.trainer.startup_seconds)
        self.startup = {"data": data_seconds, "model": model_seconds, **startup}
        if now is None:
            return
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in startup.items())
        self.startup["total_to_first_step"] = now - self.t_start
        self.console.say(f"start-up {now - self.t_start:.1f} s (data {data_seconds:.1f}, "
                         f"model {model_seconds:.1f}, {parts}); throughput below excludes it")

    def results(self, status, steps, evaluator, eval_seconds, checkpointer):
        """results.json's content. `steps`: {start, end, max, micro_steps, skipped}."""
        throughput = {}
        if self.train_seconds > 0:
            gas = self.recipe.trainer["batch"]["gradient_accumulation_steps"]
            samples = self.train_tokens / self.seq_length
            throughput = {"tokens_per_s": self.train_tokens / self.train_seconds,
                          "samples_per_s": samples / self.train_seconds,
                          "optimizer_steps_per_s": samples / self.recipe.data.batch_size / gas
                          / self.ranks.world_size / self.train_seconds,
                          "seconds": self.train_seconds, "tokens": self.train_tokens,
                          "excludes": "start-up (data, model, export, graph, session, first step), "
                                      "evaluation and checkpointing"}
        best = evaluator.best if evaluator is not None else None
        return {
            "status": status,
            "recipe": self.recipe.path,
            "kind": self.recipe.kind,
            "output_dir": str(self.out),
            "steps": steps,
            "final": {"train_loss": self.last_loss, "eval": evaluator.last if evaluator else None},
            "first": {"train_loss": self.first_loss},
            "best": {"step": evaluator.best_step, **best} if best else None,
            "throughput": throughput,
            "startup_seconds": self.startup,
            "eval_seconds": eval_seconds,
            "checkpoint_seconds": checkpointer.seconds,
            "wall_seconds": time.perf_counter() - self.t_start,
            "checkpoint": str(checkpointer.last) if checkpointer.last else None,
            "loss_scale": float(self.trainer.loss_scaler.loss_scale) if self.trainer.loss_scaler else None,
            "world_size": self.ranks.world_size,
            "mfu": self._mfu(throughput.get("tokens_per_s")),
            "matmul_gflops": self.matmul_gflops,
            "flops_per_token": self.flops_per_token,
            "peak_rss_mb": watch.peak_rss_mb(),
            **self._classification_headline(evaluator.last if evaluator else None),
        }

    def _classification_headline(self, last_eval):
        """Classification: the final dev accuracy next to the bar it must clear."""
        if self.recipe.kind != "bert-classification" or not last_eval:
            return {}
        return {key: last_eval.get(name) for key, name in
                (("eval_accuracy", "accuracy"), ("majority_baseline", "majority_baseline"), ("f1", "f1"))}

    def write_results(self, results):
        if not self.ranks.is_main:
            return
        write_durably(self.out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")

    def summary(self, r, folder):
        """The closing lines of a completed run; `r`: its results."""
        s = r["startup_seconds"]
        startup_total = s.get("total_to_first_step") or sum(v for v in s.values() if isinstance(v, float))
        lines = [f"done: step {r['steps']['end']} of {self.end_step} in {_fmt_seconds(r['wall_seconds'])} "
                 f"(start-up {startup_total:.1f} s, evaluation {r['eval_seconds']:.1f} s, "
                 f"checkpoints {r['checkpoint_seconds']:.1f} s)"]
        if r["throughput"]:
            t = r["throughput"]
            lines.append(f"throughput: {t['tokens_per_s']:,.0f} tokens/s, {t['samples_per_s']:.1f} samples/s "
                         "(start-up, evaluation and checkpoints excluded)")
            if r["mfu"] is not None:
                lines.append(f"MFU: {r['mfu'] * 100:.1f}% ({self.flops_per_token / 1e6:.2f} MFLOP/token against "
                             f"{r['matmul_gflops']:.1f} GFLOP/s fp32 matmul measured per rank)")
                if r["mfu"] > 1:  # the roof was measured while something else held the cores
                    lines.append("  MFU above 100%: the matmul rate measured at start-up was low (a busy machine?)")
        if r["peak_rss_mb"] is not None:
            lines.append(f"peak memory: {r['peak_rss_mb']:,.0f} MiB (VmHWM, rank 0)")
        if self.first_loss and self.last_loss:
            lines.append(f"train loss: {self.first_loss['loss']:.4f} (step {self.first_loss['step']}) -> "
                         f"{self.last_loss['loss']:.4f} (step {self.last_loss['step']})")
        last_eval = r["final"]["eval"]
        if last_eval:
            headline = evaluation.summary(self.recipe.kind, last_eval)
            lines.append(f"eval (step {last_eval['step']}): {headline}")
        lines.append(f"checkpoint: {folder}")
        lines.append(f"metrics: {self.out / METRICS_FILE}, results: {self.out / RESULTS_FILE}")
        for line in lines:
            self.console.say(line)


def _new_window():
    return {"loss_sum": 0.0, "losses": 0, "tokens": 0}
