"""The training loop behind `orttrainer train`: data, model, ORTTrainer, steps, evaluation, checkpoints.

Only the public trainer API is used (train_step, eval_step, save/load_checkpoint, state_dict,
_train_step_info, startup_seconds, loss_scaler). In short::

    data    = recipe_data.prepare(recipe)                    # built into runs/data/ on first use
    trainer = ORTTrainer(model, model_desc, optimizer, options=recipe.options(scheduler))
    while step < end_step:
        batch = next(batches)                                # ResumableLoader: exact data position
        onnxruntime.set_seed(seed_of(micro_step))            # dropout masks depend on the step only
        loss = trainer.train_step(**batch)[0]
        every gradient_accumulation_steps calls: one optimizer step ->
            log (metrics.jsonl, progress bar), evaluate, checkpoint (checkpoint-N/, marker last)

Exact resume. A checkpoint folder holds the trainer's checkpoint file (weights, optimizer state,
step counters, loss scaler, a partly accumulated gradient) and, in its user_dict, the loop's state:
data position, Python/NumPy/torch RNG states, the partly logged window, best metrics. Dropout runs
inside onnxruntime with onnxruntime's RNG, whose position a checkpoint cannot hold; the loop seeds
it before every train_step from (run.seed, number of train_step calls), so the masks are a function
of the step and a resumed run computes exactly what an uninterrupted one does (same process or not;
tests/test_recipes.py checks it with dropout on).

Ctrl-C: the first SIGINT asks the loop to stop after the current train_step; it then saves a
checkpoint (also in the middle of a gradient-accumulation window: checkpoint-N-M, M micro-steps into
step N+1), writes results.json and exits with status 130. A second Ctrl-C aborts at once.
"""

import json
import math
import os
import random
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from orttrainer.run import evaluation, models
from orttrainer.run.models import CHECKPOINT_FILE, COMPLETE_MARKER, MODEL_JSON, TOKENIZER_JSON
from orttrainer.optim.lr_scheduler import _LRScheduler
from orttrainer.run.recipe import RecipeError, parse_yaml

EXIT_INTERRUPTED = 130
USER_DICT_KEY = "orttrainer_loop"
STATE_VERSION = 1
METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.json"
# Optimizer steps in a row without an update (mixed precision: non-finite gradients) before giving up.
MAX_CONSECUTIVE_SKIPS = 50


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss stays non-finite); printed as one line, exit status 1."""


class _PhaseScheduler(_LRScheduler):
    """Runs a scheduler on the steps of this phase: optimization_step - `offset`.

    BERT phase 2 continues phase 1's global step count (checkpoint names, logs) while its learning
    rate schedule (warm-up, decay over its own total_steps) starts again, as in NVIDIA's recipe.
    """

    class _Info:
        def __init__(self, info, offset):
            self.optimizer_config = info.optimizer_config
            self.optimization_step = max(0, info.optimization_step - offset)

    def __init__(self, inner, offset=0):
        super().__init__()
        self.inner = inner
        self.offset = offset

    def get_lr(self, train_step_info):
        return self.inner.get_lr(self._Info(train_step_info, self.offset))

    def __repr__(self):
        return f"{self.inner!r} from step {self.offset}"


# ---------------------------------------------------------------- small helpers


def _step_seed(seed, micro_step):
    return (seed * 1_000_003 + micro_step) % (2**62)


def _rng_state():
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], [int(x) for x in np_state[1]], int(np_state[2]), int(np_state[3]),
                      float(np_state[4])],
            "torch": [int(x) for x in torch.get_rng_state().tolist()]}


def _set_rng_state(state):
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _seed_everything(seed):
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _fmt_seconds(seconds):
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(int(round(seconds)), 60)
    return f"{minutes}m{sec:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m{sec:02d}s"


def _write_durably(path, text):
    tmp = Path(f"{path}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_line(record):
    return json.dumps(record, allow_nan=True) + "\n"


def _exact_json(value):
    """`value` as plain JSON data (non-finite floats -> None), so the user_dict is stored as JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _exact_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_exact_json(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, np.floating):
        return _exact_json(float(value))
    return value


def _diff(old, new, prefix=""):
    """Dotted keys whose values differ between two nested dicts."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        where = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, where)
        elif a != b and not (isinstance(a, float) and isinstance(b, float)
                             and math.isnan(a) and math.isnan(b)):
            out.append(f"{where} ({a!r} -> {b!r})")
    return out


# ---------------------------------------------------------------- Ctrl-C


class _Interrupt:
    """First SIGINT: ask the loop to stop at the next safe point. Second: KeyboardInterrupt now."""

    def __init__(self):
        self.requested = False
        self._previous = None
        self._installed = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum, frame):
        if self.requested:
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True  # no printing here: a signal handler may interrupt a print

    def __exit__(self, *exc):
        if self._installed:
            previous = self._previous if self._previous is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, previous)
        return False


# ---------------------------------------------------------------- output


class _Console:
    """Progress bar (tqdm, on a terminal) or periodic log lines; messages go around the bar."""

    def __init__(self, mode, stream=None):
        self.stream = stream or sys.stdout
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar_enabled = is_tty if mode == "auto" else bool(mode)
        self.bar = None

    def say(self, text):
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


# ---------------------------------------------------------------- the run


class _Run:
    def __init__(self, recipe, resume, resume_command, on_micro_step, stream):
        self.recipe = recipe
        self.resume = resume
        self.resume_command = resume_command
        self.on_micro_step = on_micro_step
        self.console = _Console(recipe.run["progress_bar"], stream)
        self.say = self.console.say
        self.out = Path(recipe.run["output_dir"])
        self.kind = recipe.kind
        self.run = recipe.run

    # ------------------------------------------------------------ set-up

    def _find_resume(self):
        if self.resume is None:
            return None
        if self.resume == "auto":
            found = models.complete_checkpoints(self.out)
            newest = models.checkpoint_step(found[-1]) if found else None
            skipped = [p for p in models.incomplete_checkpoints(self.out)
                       if newest is None or models.checkpoint_step(p) > newest]
            for path in skipped:
                self.say(f"resume: skipping {path} (no {COMPLETE_MARKER} marker: its save did not finish)")
            if not found:
                self.say(f"resume: no complete checkpoint in {self.out}; starting from scratch")
                return None
            return found[-1]
        file, folder = models.find_checkpoint(self.resume, "--resume")
        if folder is None or not (Path(folder) / MODEL_JSON).is_file():
            raise RecipeError(f"--resume: {self.resume} is not a checkpoint-N folder written by "
                              "`orttrainer train` "
                              "(other checkpoints can start a run as run.init_from or model.from)")
        return Path(folder)

    def _check_fresh_output_dir(self):
        existing = models.complete_checkpoints(self.out) + models.incomplete_checkpoints(self.out)
        files = [self.out / name for name in (METRICS_FILE, RESULTS_FILE) if (self.out / name).exists()]
        if not existing and not files:
            return
        if not self.run["overwrite_output_dir"]:
            newest = f" (newest: {existing[-1].name})" if existing else ""
            raise RecipeError(f"run.output_dir: {self.out} already holds a run{newest}; use --resume auto to "
                              "continue it, --output-dir DIR for a new run, or --set "
                              "run.overwrite_output_dir=true to replace it")
        self.say(f"overwriting the run in {self.out}")
        for path in existing:
            shutil.rmtree(path)
        for path in files:
            path.unlink()

    def _read_loop_state(self, folder):
        from orttrainer import _checkpoint_storage

        file = folder / CHECKPOINT_FILE
        try:
            encoded = _checkpoint_storage.load(file, key="user_dict")
            user = _checkpoint_storage.decode_user_dict(encoded)
        except (OSError, ValueError, KeyError) as exc:
            raise RecipeError(f"--resume: cannot read the loop state of {file}: {exc}") from None
        state = user.get(USER_DICT_KEY) if isinstance(user, dict) else None
        if not state or state.get("version") != STATE_VERSION:
            raise RecipeError(f"--resume: {file} was not saved by `orttrainer train` (no loop state); "
                              "use it as run.init_from or model.from instead")
        return state

    def _warn_recipe_changes(self, state):
        try:
            old = parse_yaml(state["recipe"], "checkpoint recipe")
        except RecipeError:
            return
        new = self.recipe.doc
        changes = []
        for section in ("model", "data", "trainer"):
            changes += _diff(old.get(section) or {}, new.get(section) or {}, section)
        if changes:
            self.say("resume: the recipe differs from the checkpoint's in " + "; ".join(changes[:8])
                     + (f" and {len(changes) - 8} more" if len(changes) > 8 else ""))

    def prepare(self):
        """Everything before the first step. Returns False when there is nothing left to do."""
        from orttrainer import ORTTrainer
        from orttrainer.run import recipe_data

        run, recipe = self.run, self.recipe
        self.t_start = time.perf_counter()
        self.gas = recipe.trainer["batch"]["gradient_accumulation_steps"]

        self.resume_dir = self._find_resume()
        self.state = None
        if self.resume_dir is None:
            if self.resume is None:
                self._check_fresh_output_dir()
            # --resume auto without a complete checkpoint: a fresh start over whatever is left.
        else:
            self.state = self._read_loop_state(self.resume_dir)
            self._warn_recipe_changes(self.state)
            done = self.state["phase_start"] + run["max_steps"]
            if self.state["step"] >= done and self.state["micro"] == 0:
                self.say(f"resume: {self.resume_dir} is at step {self.state['step']}; run.max_steps "
                         f"({run['max_steps']}) is reached, nothing to do")
                return False
        state = self.state

        source, init_source, hint = self._weight_sources(state)
        self.data = recipe_data.prepare(recipe, hint, self.say)
        self.say(f"data: {self.data.description}")

        self._build_model(state, source, init_source)

        scheduler = recipe.lr_scheduler()
        self.scheduler = _PhaseScheduler(scheduler) if scheduler is not None else None
        self.trainer = ORTTrainer(self.built.model, self.built.desc, recipe.optimizer_config(),
                                  options=recipe.options(self.scheduler))

        self._restore_counters(state, init_source)
        self._restore_loop_state(state)
        self._make_loader(state)

        self.out.mkdir(parents=True, exist_ok=True)
        self._open_metrics()
        (self.out / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")
        return True

    def _weight_sources(self, state):
        """(model.from source, run.init_from source, tokenizer hint): where the weights come from."""
        recipe, run = self.recipe, self.run
        source = init_source = hint = None
        if state is not None:
            tokenizer = self.resume_dir / TOKENIZER_JSON
            hint = str(tokenizer) if tokenizer.is_file() else None
        elif recipe.model["from"]:
            source = models.weight_source(recipe.model["from"], "model.from")
            hint = source.tokenizer
        elif run["init_from"]:
            init_source = models.weight_source(run["init_from"], "run.init_from")
            if init_source.kind != "checkpoint":
                raise RecipeError(f"run.init_from: {run['init_from']} is a Hugging Face folder; "
                                  "run.init_from "
                                  "continues an orttrainer run (optimizer state, step count): use model.from")
            hint = init_source.tokenizer
        return source, init_source, hint

    def _build_model(self, state, source, init_source):
        """The torch model: its config from the resumed run or the recipe, weights from `source`."""
        run, recipe = self.run, self.recipe
        t_model = time.perf_counter()
        base_config = None
        if state is not None:
            saved = json.loads((self.resume_dir / MODEL_JSON).read_text(encoding="utf-8"))
            base_config = saved["config"]
        elif init_source is not None and init_source.model_json is not None:
            base_config = init_source.model_json["config"]
        self.built = models.build_model(
            self.kind, recipe.model["config"], seed=run["seed"], vocab_size=self.data.vocab_size,
            seq_length=self.data.seq_length, special=self.data.special, label_list=self.data.label_list,
            source=source, base_config=base_config)
        self.model_seconds = time.perf_counter() - t_model
        if state is None:
            origin = "weights from run.init_from" if init_source is not None else self.built.source
            size = sum(p.numel() for p in self.built.model.parameters()) / 1e6
            new = f"; new: {', '.join(self.built.random_init)}" if source and self.built.random_init else ""
            self.say(f"model: {type(self.built.model).__name__}, {size:.2f}M parameters, {origin}{new}")
        self.input_names = [name for name, _ in self.built.desc["inputs"]]

    def _restore_counters(self, state, init_source):
        """Optimizer steps (global), train_step calls and the phase's first step; queues the load of
        the checkpoint they come from (applied when the trainer's session starts)."""
        from orttrainer import checkpoint
        from orttrainer._utils import OPTIMIZATION_STEP_KEY, STEP_KEY, TRAIN_STEP_INFO_KEY

        self.pending_load = None
        if state is not None:
            self._check_optimizer(self.resume_dir / CHECKPOINT_FILE, "--resume")
            self.pending_load = ("--resume", str(self.resume_dir / CHECKPOINT_FILE))
            self.trainer.load_checkpoint(str(self.resume_dir / CHECKPOINT_FILE))  # applied at session start
            self.step, self.micro = state["step"], state["micro"]
            self.micro_total, self.phase_start = state["micro_total"], state["phase_start"]
        elif init_source is not None:
            self._check_optimizer(init_source.path, "run.init_from")
            self.pending_load = ("run.init_from", init_source.path)
            saved, _ = checkpoint._load_checkpoint([init_source.path])
            info = saved.get(TRAIN_STEP_INFO_KEY, {})
            start = int(np.asarray(info.get(OPTIMIZATION_STEP_KEY, 0)))
            # This phase's accumulation window starts at a boundary (its gradient_accumulation_steps
            # may differ from the earlier phase's); any half-accumulated gradient is dropped.
            saved[TRAIN_STEP_INFO_KEY] = {OPTIMIZATION_STEP_KEY: start, STEP_KEY: start * self.gas}
            saved.pop("gradient_accumulation", None)
            self.trainer.load_state_dict(saved)
            self.step, self.micro, self.micro_total, self.phase_start = start, 0, start * self.gas, start
            self.say(f"init: weights, optimizer state and step count ({start}) from {init_source.path}")
        else:
            self.step, self.micro, self.micro_total, self.phase_start = 0, 0, 0, 0
        if self.scheduler is not None:
            self.scheduler.offset = self.phase_start
        self.end_step = self.phase_start + self.run["max_steps"]

    def _restore_loop_state(self, state):
        """The partly logged window, best metrics, losses and throughput counters (fresh or resumed)."""
        self.window = {"loss_sum": 0.0, "losses": 0, "tokens": 0}
        self.skipped = 0
        self.best = None
        self.best_step = None
        self.last_eval = None
        self.first_loss = None
        self.last_loss = None
        self.train_seconds = 0.0
        self.train_tokens = 0
        if state is not None:
            self.window = dict(state["window"])
            self.skipped = state["skipped_steps"]
            self.best, self.best_step = state["best"], state["best_step"]
            self.last_eval = state.get("last_eval")
            self.first_loss = state.get("first_loss")
            self.last_loss = state.get("last_loss")
            self.train_seconds, self.train_tokens = state["train_seconds"], state["train_tokens"]

    def _make_loader(self, state):
        """The training batches, at the resumed data position and RNG state when resuming."""
        from orttrainer.run.data import ResumableLoader

        batch_size, seed = self.recipe.data["batch_size"], self.run["seed"]
        self.loader = ResumableLoader(self.data.train, batch_size, seed=seed, shuffle=True, drop_last=True)
        if len(self.loader) == 0:
            raise RecipeError(f"data.batch_size: got {batch_size}; the training data has only "
                              f"{len(self.data.train)} examples")
        _seed_everything(seed)
        if state is not None:
            try:
                self.loader.load_state_dict(state["data"])
            except ValueError as exc:
                raise RecipeError(f"--resume: {exc}") from None
            _set_rng_state(state["rng"])
        self.tokens_per_micro = batch_size * self.data.seq_length

    def _check_optimizer(self, file, what):
        from orttrainer import _checkpoint_storage

        try:
            options = _checkpoint_storage.load(file, key="trainer_options")
        except (OSError, ValueError, KeyError) as exc:
            raise RecipeError(f"{what}: cannot read {file}: {exc}") from None
        saved = options.get("optimizer_name")
        saved = saved.decode() if isinstance(saved, bytes) else saved
        mine = self.trainer.optim_config.name
        if saved is not None and str(saved) != mine:
            raise RecipeError(f"{what}: {file} was trained with {saved}, this recipe uses {mine} "
                              "(trainer.optimizer.name); the optimizer state cannot be carried over")

    def _open_metrics(self):
        path = self.out / METRICS_FILE
        kept = []
        if self.state is not None and path.exists():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by a crash
                    if record.get("step", 0) <= self.step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        elif self.state is None and path.exists():
            path.unlink()
        _write_durably(path, "".join(kept))
        self.metrics = open(path, "a", encoding="utf-8")

    def _record(self, record):
        self.metrics.write(_json_line(record))
        self.metrics.flush()

    # ------------------------------------------------------------ state

    def loop_state(self):
        return {
            "version": STATE_VERSION,
            "step": self.step, "micro": self.micro, "micro_total": self.micro_total,
            "phase_start": self.phase_start,
            "data": dict(self.loader.state_dict()),
            "rng": _rng_state(),
            "window": dict(self.window),
            "skipped_steps": self.skipped,
            "best": self.best, "best_step": self.best_step, "last_eval": self.last_eval,
            "first_loss": self.first_loss, "last_loss": self.last_loss,
            "train_seconds": self.train_seconds, "train_tokens": self.train_tokens,
            "recipe": self.recipe.to_yaml(),
        }

    def save(self):
        started = time.perf_counter()
        name = f"checkpoint-{self.step}" + (f"-{self.micro}" if self.micro else "")
        folder = self.out / name
        if folder.exists():
            if (folder / COMPLETE_MARKER).is_file():
                return folder
            shutil.rmtree(folder)  # left over from a save that did not finish
        folder.mkdir(parents=True)
        state = _exact_json(self.loop_state())
        self.trainer.save_checkpoint(str(folder / CHECKPOINT_FILE), user_dict={USER_DICT_KEY: state})
        _write_durably(folder / MODEL_JSON, json.dumps(self.built.model_json(self.data.label_list), indent=1))
        if self.data.tokenizer:
            from orttrainer.run.data.tokenizer import load_tokenizer

            load_tokenizer(self.data.tokenizer).save(str(folder / TOKENIZER_JSON))
        _write_durably(folder / "recipe.yaml", self.recipe.to_yaml())
        _write_durably(folder / COMPLETE_MARKER, json.dumps({"step": self.step, "micro": self.micro,
                                                             "time": time.time()}) + "\n")
        limit = self.run["save_total_limit"]
        if limit:
            complete = models.complete_checkpoints(self.out)
            for old in complete[:-limit]:
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        self.checkpoint_seconds += time.perf_counter() - started
        self.last_checkpoint = folder
        return folder

    # ------------------------------------------------------------ steps

    def _lr(self):
        if self.scheduler is not None and self.scheduler.get_last_lr():
            return float(self.scheduler.get_last_lr()[0])
        return float(self.recipe.trainer["optimizer"]["lr"])

    def _log_step(self, step_loss):
        w = self.window
        loss = w["loss_sum"] / max(1, w["losses"])
        seconds = w.get("seconds", 0.0)
        tokens_per_s = (w["timed_tokens"] / seconds) if seconds > 0 and w.get("timed_tokens") else None
        record = {"kind": "train", "step": self.step, "loss": loss, "lr": self._lr(),
                  "tokens_per_s": tokens_per_s, "micro_steps": w["losses"]}
        if self.trainer.loss_scaler is not None:
            record["loss_scale"] = float(self.trainer.loss_scaler.loss_scale)
            record["skipped_steps"] = self.skipped
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

    def _evaluate(self):
        if self.data.eval is None:
            return None
        started = time.perf_counter()
        metrics = evaluation.evaluate(self.trainer, self.kind, self.data.eval, self.input_names,
                           self.recipe.data["eval_batch_size"] or self.recipe.data["batch_size"],
                           self.run["eval_batches"])
        self.eval_seconds += time.perf_counter() - started
        if not metrics:
            return None
        self._record({"kind": "eval", "step": self.step, **metrics})
        self.last_eval = {"step": self.step, **metrics}
        if evaluation.better(self.kind, metrics, self.best):
            self.best, self.best_step = dict(metrics), self.step
        self.say(f"eval at step {self.step}: {evaluation.summary(self.kind, metrics)}")
        return metrics

    def loop(self):
        import onnxruntime as ort

        run = self.run
        self.eval_seconds = self.checkpoint_seconds = 0.0
        self.last_checkpoint = None
        self.interrupted = False
        self.unsafe_interrupt = False
        seed = run["seed"]
        batches = self.loader.batches()
        first_call = True
        self.calls = 0
        consecutive_skips = 0
        in_step = False
        self.bar_label = Path(self.recipe.path).stem if self.recipe.path else "train"
        mark = time.perf_counter()
        with _Interrupt() as interrupt:
            try:
                while self.step < self.end_step and not interrupt.requested:
                    batch = next(batches)
                    inputs = {name: batch[name] for name in self.input_names}
                    ort.set_seed(_step_seed(seed, self.micro_total))
                    in_step = True
                    if first_call:
                        outputs = self._first_train_step(inputs)
                    else:
                        outputs = self.trainer.train_step(**inputs)
                    in_step = False
                    self.calls += 1
                    loss = float(outputs[0])
                    now = time.perf_counter()
                    self.micro_total += 1
                    self.micro += 1
                    self.window["loss_sum"] += loss
                    self.window["losses"] += 1
                    if first_call:
                        first_call = False
                        self._check_counters()
                        self._report_startup(now)
                        # Opened after start-up, so the bar's rate and ETA are steady-state ones.
                        self.console.open_bar(self.end_step, self.step, self.bar_label)
                    else:
                        self.window["seconds"] = self.window.get("seconds", 0.0) + (now - mark)
                        timed = self.window.get("timed_tokens", 0)
                        self.window["timed_tokens"] = timed + self.tokens_per_micro
                        self.train_seconds += now - mark
                        self.train_tokens += self.tokens_per_micro
                    mark = now
                    if self.on_micro_step is not None:
                        self.on_micro_step(self)
                    if self.micro < self.gas:
                        continue
                    self.micro = 0
                    new_step = self.trainer._train_step_info.optimization_step
                    if new_step == self.step:
                        self.skipped += 1
                        consecutive_skips += 1
                        if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                            raise TrainingError(f"{consecutive_skips} optimizer steps in a row were skipped "
                                                "(non-finite gradients); the loss is probably NaN")
                        continue
                    consecutive_skips = 0
                    self.step = new_step
                    if self.console.bar is not None:
                        postfix = {"loss": f"{loss:.4f}", "lr": f"{self._lr():.2e}"}
                        seconds = self.window.get("seconds", 0.0)
                        if seconds:
                            postfix["tok/s"] = f"{self.window['timed_tokens'] / seconds:,.0f}"
                        self.console.bar.set_postfix(postfix, refresh=False)
                        self.console.bar.update(self.step - self.console.bar.n)
                    if self.step % run["log_every"] == 0 or self.step == self.end_step:
                        self._log_step(loss)
                    if self.step < self.end_step:
                        if run["eval_every"] and self.step % run["eval_every"] == 0:
                            self._evaluate()
                        if run["save_every"] and self.step % run["save_every"] == 0:
                            folder = self.save()
                            self.say(f"saved {folder}")
                        mark = time.perf_counter()
            except KeyboardInterrupt:
                if in_step:
                    self.unsafe_interrupt = True
                self.interrupted = True
            if interrupt.requested:
                self.interrupted = True
        self.console.close_bar()

    def _first_train_step(self, inputs):
        """The first train_step exports the model, builds the session and applies a pending load."""
        try:
            return self.trainer.train_step(**inputs)
        except (RuntimeError, ValueError, AssertionError) as exc:
            if self.pending_load is None:
                raise
            raise RecipeError(f"{self.pending_load[0]}: cannot load {self.pending_load[1]} into this model: "
                              f"{str(exc).splitlines()[0]}") from exc

    def _check_counters(self):
        # The trainer's counters come from its checkpoint, the loop's from the user_dict: they must agree.
        info = self.trainer._train_step_info
        if info.step != self.micro_total or info.optimization_step not in (self.step, self.step + 1):
            raise TrainingError(f"the trainer's counters (step {info.step}, optimization_step "
                                f"{info.optimization_step}) disagree with the loop's ({self.micro_total} "
                                f"train_step calls, step {self.step})")

    def _report_startup(self, now):
        startup = dict(self.trainer.startup_seconds)
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in startup.items())
        self.startup = {"data": self.data.seconds, "model": self.model_seconds, **startup}
        self.startup["total_to_first_step"] = now - self.t_start
        self.say(f"start-up {now - self.t_start:.1f} s (data {self.data.seconds:.1f}, "
                 f"model {self.model_seconds:.1f}, {parts}); throughput below excludes it")

    # ------------------------------------------------------------ end

    def finish(self):
        """Final evaluation and checkpoint (or the interrupt checkpoint); results.json; summary."""
        if not hasattr(self, "startup"):
            self.startup = {"data": self.data.seconds, "model": self.model_seconds,
                            **self.trainer.startup_seconds}
        completed = not self.interrupted
        if self.unsafe_interrupt:
            newest = models.complete_checkpoints(self.out)
            where = f"the newest complete checkpoint is {newest[-1]}" if newest else "no checkpoint was saved"
            self.say(f"interrupted inside a training step: its state cannot be saved safely; {where}")
            self._write_results("interrupted")
            self.metrics.close()
            return EXIT_INTERRUPTED
        if self.calls == 0:
            self.say("interrupted before the first step: nothing new to save")
            self.metrics.close()
            return EXIT_INTERRUPTED
        if completed:
            self._evaluate()
        else:
            self.say("interrupt: saving a checkpoint (Ctrl-C again to stop without saving)")
        folder = self.save()
        self._write_results("completed" if completed else "interrupted")
        self.metrics.close()
        if not completed:
            where = f"step {self.step}"
            if self.micro:
                where += f" (+{self.micro} of {self.gas} micro-steps)"
            self.say(f"interrupted at {where}: saved {folder}")
            if self.resume_command:
                self.say(f"resume with: {self.resume_command}")
            return EXIT_INTERRUPTED
        self._summary(folder)
        return 0

    def _results(self, status):
        throughput = {}
        if self.train_seconds > 0:
            samples = self.train_tokens / self.data.seq_length
            throughput = {"tokens_per_s": self.train_tokens / self.train_seconds,
                          "samples_per_s": samples / self.train_seconds,
                          "optimizer_steps_per_s": samples / self.recipe.data["batch_size"] / self.gas
                          / self.train_seconds,
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
            "checkpoint_seconds": self.checkpoint_seconds,
            "wall_seconds": time.perf_counter() - self.t_start,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "loss_scale": float(self.trainer.loss_scaler.loss_scale) if self.trainer.loss_scaler else None,
        }

    def _write_results(self, status):
        _write_durably(self.out / RESULTS_FILE, json.dumps(self._results(status), indent=2) + "\n")

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
        if self.first_loss and self.last_loss:
            lines.append(f"train loss: {self.first_loss['loss']:.4f} (step {self.first_loss['step']}) -> "
                         f"{self.last_loss['loss']:.4f} (step {self.last_loss['step']})")
        if self.last_eval:
            lines.append(f"eval (step {self.last_eval['step']}): {evaluation.summary(self.kind, self.last_eval)}")
        lines.append(f"checkpoint: {folder}")
        lines.append(f"metrics: {self.out / METRICS_FILE}, results: {self.out / RESULTS_FILE}")
        for line in lines:
            self.say(line)


def train(recipe, resume=None, *, resume_command=None, on_micro_step=None, stream=None):
    """Run `recipe` (a Recipe); returns the exit status: 0 done, 130 interrupted (checkpoint saved).

    `resume`: None (fresh run; the output folder must not hold one), "auto" (newest complete
    checkpoint of the output folder, or a fresh start) or a checkpoint path. `on_micro_step(run)` is
    called after every train_step (tests use it to interrupt). Expected problems raise RecipeError.
    """
    run = _Run(recipe, resume, resume_command, on_micro_step, stream)
    try:
        if not run.prepare():
            return 0
    except KeyboardInterrupt:
        run.say("interrupted during start-up: nothing to save")
        return EXIT_INTERRUPTED
    run.loop()
    return run.finish()


def resume_command(recipe_path, overrides, output_dir):
    parts = ["orttrainer", "train", recipe_path]
    for assignment in overrides:
        parts += ["--set", assignment]
    if output_dir:
        parts += ["--output-dir", str(output_dir)]
    parts += ["--resume", "auto"]
    return " ".join(shlex.quote(p) for p in parts)
