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


class ReportingMixin:
    """The reporting half of `loop._Run` (a mixin: it reads the run's attributes, `say` and `_lr`).

    metrics.jsonl: `_open_metrics`, `_record`, `_log_step`; the console: `_report_startup`;
    the end: `_results`, `_write_results`, `_summary`.
    """

    def _open_metrics(self):
        self.metrics = None
        if not self.ranks.is_main:
            return  # rank 0 writes the run's files
        path = self.out / METRICS_FILE
        kept = []
        if self.state is not None and path.exists():
            kept = [_json_line(r) for r in read_metrics(path) if r.get("step", 0) <= self.step]
        elif self.state is None and path.exists():
            path.unlink()
        write_durably(path, "".join(kept))
        self.metrics = open_append(path)
        self.board = None
        if "tensorboard" in self.run["report_to"]:
            resumed_at = self.step if self.state is not None else None
            self.board = watch.Board.open(self.out / watch.TB_FOLDER, resumed_at)

    def _record(self, record):
        if self.metrics is None:
            return
        try:
            self.metrics.write(_json_line(record))
            self.metrics.flush()
            if getattr(self, "board", None) is not None:
                self.board.scalars(record["kind"], record, record["step"])
        except OSError as exc:
            resume = f"; resume with: {self.resume_command}" if self.resume_command else ""
            raise TrainingError(f"cannot append to {self.metrics.name}: {exc.strerror or exc}{resume}") from None

    def _close_metrics(self):
        if getattr(self, "board", None) is not None:
            self.board.close()
            self.board = None
        if self.metrics is not None:
            self.metrics.close()

    def _mfu(self, tokens_per_s):
        """Model FLOPs utilisation against the matmul rate measured at start-up (measures.py)."""
        if not tokens_per_s or not self.matmul_gflops:
            return None
        return tokens_per_s * self.flops_per_token / (self.ranks.world_size * self.matmul_gflops * 1e9)

    def _log_step(self, step_loss):
        w = self.window
        loss = self.ranks.mean(w["loss_sum"] / max(1, w["losses"]))  # the global batch's loss
        seconds = w.get("seconds", 0.0)
        tokens_per_s = (w["timed_tokens"] / seconds) if seconds > 0 and w.get("timed_tokens") else None
        record = {"kind": "train", "step": self.step, "loss": loss, "lr": self._lr(),
                  "tokens_per_s": tokens_per_s, "micro_steps": w["losses"]}
        if self.trainer.loss_scaler is not None:
            record["loss_scale"] = float(self.trainer.loss_scaler.loss_scale)
            record["skipped_steps"] = self.skipped
            record["nan_steps"] = self.trainer.mixed_precision_counters.nan_steps
        record["grad_norm"] = self.trainer.last_gradient_norm
        record["mfu"] = self._mfu(tokens_per_s)
        record["peak_rss_mb"] = watch.peak_rss_mb()
        self._record(record)
        if self.first_loss is None:
            self.first_loss = {"step": self.step, "loss": loss}
        self.last_loss = {"step": self.step, "loss": loss}
        if self.console.bar is None:
            line = (f"step {self.step:>{len(str(self.end_step))}}/{self.end_step} | loss {loss:.4f} | "
                    f"lr {record['lr']:.2e}")
            if tokens_per_s:
                line += f" | {tokens_per_s:,.0f} tok/s"
            if "loss_scale" in record:
                line += f" | loss scale {record['loss_scale']:g}, skipped {self.skipped}"
            self.say(line + f" | {_fmt_seconds(time.perf_counter() - self.t_start)}")
        self.window = {"loss_sum": 0.0, "losses": 0, "tokens": 0}

    def _report_startup(self, now):
        startup = dict(self.trainer.startup_seconds)
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in startup.items())
        self.startup = {"data": self.data.seconds, "model": self.model_seconds, **startup}
        self.startup["total_to_first_step"] = now - self.t_start
        self.say(f"start-up {now - self.t_start:.1f} s (data {self.data.seconds:.1f}, "
                 f"model {self.model_seconds:.1f}, {parts}); throughput below excludes it")

    def _results(self, status):
        throughput = {}
        if self.train_seconds > 0:
            samples = self.train_tokens / self.data.seq_length
            throughput = {"tokens_per_s": self.train_tokens / self.train_seconds,
                          "samples_per_s": samples / self.train_seconds,
                          "optimizer_steps_per_s": samples / self.recipe.data["batch_size"] / self.gas
                          / self.ranks.world_size / self.train_seconds,
                          "seconds": self.train_seconds, "tokens": self.train_tokens,
                          "excludes": "start-up (data, model, export, graph, session, first step), "
                                      "evaluation and checkpointing"}
        return {
            "status": status,
            "recipe": self.recipe.path,
            "kind": self.kind,
            "output_dir": str(self.out),
            "steps": {"start": self.phase_start, "end": self.step, "max": self.end_step,
                      "micro_steps": self.micro_total, "skipped": self.skipped},
            "final": {"train_loss": self.last_loss, "eval": self.last_eval},
            "first": {"train_loss": self.first_loss},
            "best": {"step": self.best_step, **(self.best or {})} if self.best else None,
            "throughput": throughput,
            "startup_seconds": self.startup,
            "eval_seconds": self.eval_seconds,
            "checkpoint_seconds": self.checkpointer.seconds,
            "wall_seconds": time.perf_counter() - self.t_start,
            "checkpoint": str(self.checkpointer.last) if self.checkpointer.last else None,
            "loss_scale": float(self.trainer.loss_scaler.loss_scale) if self.trainer.loss_scaler else None,
            "world_size": self.ranks.world_size,
            "mfu": self._mfu(throughput.get("tokens_per_s")),
            "matmul_gflops": self.matmul_gflops,
            "flops_per_token": self.flops_per_token,
            "peak_rss_mb": watch.peak_rss_mb(),
            **self._classification_headline(),
        }

    def _classification_headline(self):
        """Classification: the final dev accuracy next to the bar it must clear."""
        if self.kind != "bert-classification" or not self.last_eval:
            return {}
        return {key: self.last_eval.get(name) for key, name in
                (("eval_accuracy", "accuracy"), ("majority_baseline", "majority_baseline"), ("f1", "f1"))}

    def _write_results(self, status):
        if not self.ranks.is_main:
            return
        write_durably(self.out / RESULTS_FILE, json.dumps(self._results(status), indent=2) + "\n")

    def _summary(self, folder):
        r = self._results("completed")
        s = r["startup_seconds"]
        startup_total = s.get("total_to_first_step") or sum(v for v in s.values() if isinstance(v, float))
        lines = [f"done: step {self.step} of {self.end_step} in {_fmt_seconds(r['wall_seconds'])} "
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
        if self.last_eval:
            lines.append(f"eval (step {self.last_eval['step']}): {evaluation.summary(self.kind, self.last_eval)}")
        lines.append(f"checkpoint: {folder}")
        lines.append(f"metrics: {self.out / METRICS_FILE}, results: {self.out / RESULTS_FILE}")
        for line in lines:
            self.say(line)
