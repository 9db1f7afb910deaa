"""The training loop behind `orttrainer train`: data, model, ORTTrainer, steps, evaluation, checkpoints.

Only the public trainer API is used (train_step, eval_step, save/load_checkpoint, state_dict,
_train_step_info, startup_seconds, loss_scaler). In short::

    data    = recipe_data.prepare(recipe)                    # built into runs/data/ on first use
    trainer = ORTTrainer(model, model_desc, optimizer, options=recipe.options(scheduler))
    while step < end_step:
        batch = next(batches)                                # ResumableLoader: exact data position
        onnxruntime.set_seed(seed_of(micro_step, rank))      # dropout masks: a function of step and rank
        loss = trainer.train_step(**batch)[0]
        every gradient_accumulation_steps calls: one optimizer step ->
            reporter.maybe_log(step), evaluator.maybe_evaluate(step), checkpointer.maybe_save(step)

The parts own their state and their intervals: `Resume` and `Checkpointer` (checkpointer.py: where a
run starts from; checkpoint-N/ folders, marker last), `Reporter` (report/reporter.py: console,
metrics.jsonl, TensorBoard, results.json, summary), `Evaluator` (evaluation.py), `StepProfiler`
(report/node_profile.py). `_Run` keeps the set-up, the step counters, the order of the calls and the
end; a checkpoint's loop state is the state_dict() of the run, the reporter, the evaluator and the
checkpointer (the RNG states).

Ctrl-C and SIGTERM (what SLURM, Kubernetes and torchrun send before killing a job; interrupt.py): the
first signal asks the loop to stop after the current train_step; it then saves a checkpoint (one process
also in the middle of a gradient-accumulation window: checkpoint-N-M, M micro-steps into step N+1;
several ranks finish the window first, as a checkpoint holds no rank's unreduced gradients), writes
results.json and exits with status 130 (SIGINT) or 143 (SIGTERM).

One run per output folder: rank 0 holds run/lock.py's lock for the whole run.
"""

import json
import math
import random
import signal
import time
from pathlib import Path

import numpy as np

from orttrainer.optim.lr_scheduler import _LRScheduler
from orttrainer.placement.dims import LayoutError, ParallelDims
from orttrainer.run import evaluation, run_folder
from orttrainer.run import hf_models as models
from orttrainer.run.report import measures as watch
from orttrainer.run.checkpointer import Checkpointer, Resume, newest_note
from orttrainer.run.errors import TrainingError
from orttrainer.run.interrupt import EXIT_INTERRUPTED, EXIT_TERMINATED, Interrupt
from orttrainer.run.lock import OutputLock
from orttrainer.run.hf_models import MODEL_JSON, TOKENIZER_JSON
from orttrainer.run.ranks import DATA_BUILD_TIMEOUT, Ranks
from orttrainer.run.recipe.spec import RecipeError, check_paths
from orttrainer.run.report.reporter import Console, Reporter, write_durably

# Optimizer steps in a row without an update (mixed precision: non-finite gradients) before giving up.
MAX_CONSECUTIVE_SKIPS = 50


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


def _step_seed(seed, micro_step, rank=0):
    """onnxruntime's seed for one train_step: a function of the step, so a resumed run draws the same
    dropout masks, and of the rank, so data-parallel ranks do not all draw the same masks. Rank 0
    (and one process) keeps the seeds it always had."""
    return (seed * 1_000_003 + micro_step + rank * 2**40) % (2**62)


def _seed_everything(seed):
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class _Run:
    """One `orttrainer train` run: `prepare()`, `loop()`, `finish()` (see `train`)."""

    def __init__(self, recipe, resume, resume_command, on_micro_step, stream):
        self.recipe, self.resume, self.resume_command = recipe, resume, resume_command
        self.on_micro_step = on_micro_step
        self.interrupt_handlers = Interrupt()  # loop() installs them; train() removes them at the end
        self.console = Console(recipe.run.progress_bar, stream)
        self.say = self.console.say
        self.out = Path(recipe.run.output_dir)
        self.kind = recipe.kind
        self.run = recipe.run
        self.ranks = Ranks()  # one process until prepare() reads the launcher's environment

    # ------------------------------------------------------------ set-up

    def prepare(self):
        """Everything before the first step. Returns False when there is nothing left to do."""
        from orttrainer import ORTTrainer
        from orttrainer.run.recipe import data as recipe_data

        run, recipe = self.run, self.recipe
        self.t_start = time.perf_counter()
        self.gas = recipe.trainer["batch"]["gradient_accumulation_steps"]
        self.ranks = Ranks.from_environment(recipe.trainer["distributed"]["world_size"], recipe.trainer)
        self.ranks.check_same_settings({**recipe.doc, "--resume": self.resume})
        try:  # the layout of the processes torchrun started (world_size 1 in a recipe: "as many as run")
            distributed = {**recipe.trainer["distributed"], "world_size": self.ranks.world_size}
            self.dims = ParallelDims.of(distributed)
        except LayoutError as exc:
            raise RecipeError(f"trainer.{exc}, with {self.ranks.world_size} processes running") from None
        if not self.ranks.is_main:
            self.console.silence()
        elif self.ranks.active:
            dims = self.dims
            self.say(f"ranks: {self.ranks.world_size} processes" + (
                f" as {dims.data} data-parallel x {dims.pipeline} pipeline stages (stage-major "
                "ranks), each pipeline" if dims.pipeline_parallel else ", each")
                + " reading its slice of every global batch of data.batch_size x ranks; rank 0 reports")

        check_paths(recipe)
        self._lock_output_dir()
        self.resume_point = Resume(self.out, self.resume, self.ranks, self.say)
        self.resume_dir = self.resume_point.find()
        self.state = None
        if self.resume_dir is None:
            if self.resume_point.resume is None:
                self.resume_point.check_fresh_output_dir(run.overwrite_output_dir)
            # --resume auto without a complete checkpoint: a fresh start over whatever is left.
        else:
            self.state = self.resume_point.read_loop_state()
            self.resume_point.warn_recipe_changes(self.state, recipe)
            done = self.state["phase_start"] + run.max_steps
            if self.state["step"] >= done and self.state["micro"] == 0:
                self.say(f"resume: {self.resume_dir} is at step {self.state['step']}; run.max_steps "
                         f"({run.max_steps}) is reached, nothing to do")
                return False
        state = self.state

        source, init_source, hint = self._weight_sources(state)
        if self.ranks.is_main:  # builds the data on first use; the other ranks then find it built
            self.data = recipe_data.prepare(recipe, hint, self.say)
        self.ranks.barrier(DATA_BUILD_TIMEOUT)
        if not self.ranks.is_main:
            self.data = recipe_data.prepare(recipe, hint, self.say)
        self.say(f"data: {self.data.description}")
        self.tokenizer = None
        if self.ranks.is_main and self.data.tokenizer:
            # Kept in memory for the checkpoints: it may come from a checkpoint rotation deletes.
            from orttrainer.run.data.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.data.tokenizer)

        self._build_model(state, source, init_source)

        self.flops_per_token = watch.flops_per_token(self.built.model, self.data.seq_length)
        self.matmul_gflops = watch.matmul_gflops(watch.run_threads())  # every rank: the cores are shared
        scheduler = recipe.lr_scheduler()
        self.scheduler = _PhaseScheduler(scheduler) if scheduler is not None else None
        distributed = self.ranks.options() if self.ranks.active else None
        options = recipe.options(self.scheduler, distributed)
        self.profiler = None
        if run.profile_steps and self.ranks.is_main:
            from orttrainer.run.report.node_profile import StepProfiler

            self.profiler = StepProfiler(self.out, *run.profile_steps, self.say)
            options.session_options = self.profiler.session_options()
        self.trainer = ORTTrainer(self.built.model, self.built.desc, recipe.optimizer_config(), options=options)

        counters = self.resume_point.load_counters(self.trainer, state, init_source, self.gas)
        self.step, self.micro = counters["step"], counters["micro"]
        self.micro_total, self.phase_start = counters["micro_total"], counters["phase_start"]
        if self.scheduler is not None:
            self.scheduler.offset = self.phase_start
        self.end_step = self.phase_start + run.max_steps
        self.resume_point.warn_schedule_change(state, recipe, self.scheduler, self.step, self.phase_start)
        self.skipped = state["skipped_steps"] if state is not None else 0
        self._make_loader(state)
        self.reporter = Reporter(
            self.out, recipe, self.console, self.ranks, self.trainer, end_step=self.end_step,
            seq_length=self.data.seq_length, tokens_per_micro=self.tokens_per_micro,
            flops_per_token=self.flops_per_token, matmul_gflops=self.matmul_gflops, t_start=self.t_start,
            lr=self._lr, resume_command=self.resume_command)
        self.evaluator = evaluation.Evaluator(
            self.trainer, self.kind, self.data.eval, self.input_names,
            recipe.data.eval_batch_size or recipe.data.batch_size, run.eval_batches,
            run.eval_every, self.reporter.record, self.say)
        self.checkpointer = Checkpointer(
            self.out, run.save_every, run.save_total_limit, self.trainer, self.ranks,
            [self, self.reporter, self.evaluator], self._run_files, recipe.to_yaml(), self.say,
            self.resume_command)
        if state is not None:
            # The checkpointer's part is the RNG states: restored after the loader's seeding.
            for part in (self.reporter, self.evaluator, self.checkpointer):
                part.load_state_dict(state)

        self.out.mkdir(parents=True, exist_ok=True)
        self.reporter.open(self.step, resumed=state is not None)
        if self.ranks.is_main:
            write_durably(self.out / "recipe.yaml", recipe.to_yaml())
        return True

    def _lock_output_dir(self):
        """Rank 0 creates the output folder and locks it; every rank stops when it cannot."""
        problem = None
        if self.ranks.is_main:
            self.created_out = not self.out.exists()
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                problem = RecipeError(f"run.output_dir: cannot create {self.out}: {exc.strerror or exc}")
            if problem is None:
                self.lock = OutputLock(self.out)
                try:
                    self.lock.acquire(self.say)
                    run_folder.check_output_dir(self.out)  # the user's files: refused, never replaced
                    self.marked = run_folder.mark(self.out)
                except (RecipeError, OSError) as exc:
                    problem = exc if isinstance(exc, RecipeError) else \
                        RecipeError(f"run.output_dir: cannot use {self.out}: {exc}")
        if self.ranks.any(problem is not None):
            raise problem or RecipeError("rank 0 cannot use the output folder (see its error)")

    def close(self):
        """Whatever the run holds: metrics file, lock (an empty folder it created goes too), ranks."""
        if getattr(self, "reporter", None) is not None:
            try:
                self.reporter.close()
            except OSError:
                pass  # a full disk: the error that stopped the run is the one to report
        lock = getattr(self, "lock", None)
        if lock is not None:
            if getattr(self, "marked", False):
                try:
                    run_folder.unmark_if_unused(self.out)
                except OSError:
                    pass
            lock.release()
            if getattr(self, "created_out", False):
                try:
                    self.out.rmdir()  # only when empty: a run that failed before writing anything
                except OSError:
                    pass
        self.ranks.close()

    def _weight_sources(self, state):
        """(model.from source, run.init_from source, tokenizer hint): where the weights come from."""
        recipe, run = self.recipe, self.run
        source = init_source = hint = None
        if state is not None:
            tokenizer = self.resume_dir / TOKENIZER_JSON
            hint = str(tokenizer) if tokenizer.is_file() else None
        elif recipe.model.from_:
            source = models.weight_source(recipe.model.from_, "model.from")
            hint = source.tokenizer
        elif run.init_from:
            init_source = models.weight_source(run.init_from, "run.init_from")
            if init_source.kind != "checkpoint":
                raise RecipeError(f"run.init_from: {run.init_from} is a Hugging Face folder; "
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
            self.kind, recipe.model.config, seed=run.seed, vocab_size=self.data.vocab_size,
            seq_length=self.data.seq_length, special=self.data.special, label_list=self.data.label_list,
            source=source, base_config=base_config)
        self.model_seconds = time.perf_counter() - t_model
        if state is None:
            origin = "weights from run.init_from" if init_source is not None else self.built.source
            size = sum(p.numel() for p in self.built.model.parameters()) / 1e6
            new = f"; new: {', '.join(self.built.random_init)}" if source and self.built.random_init else ""
            self.say(f"model: {type(self.built.model).__name__}, {size:.2f}M parameters, {origin}{new}")
        self.input_names = [name for name, _ in self.built.desc["inputs"]]

    def _make_loader(self, state):
        """The training batches, at the resumed data position and RNG state when resuming."""
        from orttrainer.run.data import ResumableLoader

        batch_size, seed = self.recipe.data.batch_size, self.run.seed
        # Each data-parallel rank reads its slice of every global batch (batch_size per rank); the stages of
        # a pipeline and the ranks of a tensor-parallel group read the same slice.
        self.data_ranks = self.dims.data
        data_rank = self.dims.coords(self.ranks.rank).data
        self.loader = ResumableLoader(self.data.train, batch_size, seed=seed, shuffle=True, drop_last=True,
                                      rank=data_rank, world_size=self.data_ranks)
        if len(self.loader) == 0:
            raise RecipeError(f"data.batch_size: got {batch_size}; the training data has only "
                              f"{len(self.data.train)} examples")
        _seed_everything(seed)
        if state is not None:
            saved = state["data"].get("world_size", self.data_ranks)
            if saved != self.data_ranks and state["micro"]:
                raise RecipeError(f"--resume: {self.resume_dir.name} was saved {state['micro']} micro-steps into "
                                  f"an accumulation window by {saved} process(es), whose partial gradient "
                                  f"belongs to that number of ranks; resume on {saved}, or from a checkpoint-N "
                                  "folder (saved at a step boundary)")
            try:
                self.loader.load_state_dict(state["data"])
            except ValueError as exc:
                raise RecipeError(f"--resume: {exc}") from None
            if saved != self.data_ranks:
                self.say(f"resume: saved on {saved} data rank(s), now {self.data_ranks}: the data continues at "
                         f"sample {self.loader.cursor} of epoch {self.loader.epoch}'s global order")
        self.tokens_per_micro = batch_size * self.data.seq_length * self.data_ranks

    def state_dict(self):
        """The loop's part of a checkpoint's loop state."""
        return {
            "step": self.step, "micro": self.micro, "micro_total": self.micro_total,
            "phase_start": self.phase_start,
            "skipped_steps": self.skipped,
            "data": dict(self.loader.state_dict()),
        }

    def _run_files(self):
        """The files of every checkpoint beside the trainer's: model and tokenizer (held in memory: the
        file it came from may be rotated away)."""
        files = {MODEL_JSON: json.dumps(self.built.model_json(self.data.label_list), indent=1)}
        if self.tokenizer is not None:
            files[TOKENIZER_JSON] = self.tokenizer.to_str()
        return files

    # ------------------------------------------------------------ steps

    def _lr(self):
        if self.scheduler is not None and self.scheduler.get_last_lr():
            return float(self.scheduler.get_last_lr()[0])
        return float(self.recipe.trainer["optimizer"]["lr"])

    def loop(self):
        import onnxruntime as ort

        run = self.run
        self.interrupted = self.unsafe_interrupt = False
        self.signal = None
        seed = run.seed
        batches = self.loader.batches()
        first_call = True
        self.calls = 0
        self.consecutive_skips = 0
        finishing_window = False
        in_step = False
        self.bar_label = Path(self.recipe.path).stem if self.recipe.path else "train"
        mark = time.perf_counter()
        with self.interrupt_handlers as interrupt:
            try:
                while self.step < self.end_step:
                    # Every rank stops at the same micro-step, on the signal some rank received.
                    stop = self.ranks.max(interrupt.signal or (signal.SIGINT if interrupt.requested else 0))
                    if stop:
                        self.signal = signal.Signals(stop)
                        interrupt.stop_elsewhere()
                        if not self.ranks.active or self.micro == 0:
                            self.interrupted = True
                            break
                        if not finishing_window:
                            # Checkpoints hold no rank's unreduced part of a window: end it first.
                            finishing_window = True
                            self.say(f"stop requested: finishing the accumulation window first "
                                     f"({self.gas - self.micro} more micro-steps)")
                    batch = next(batches)
                    inputs = {name: batch[name] for name in self.input_names}
                    ort.set_seed(_step_seed(seed, self.micro_total, self.ranks.rank))
                    in_step = True
                    if self.profiler is not None:
                        self.profiler.before_call(self.step + 1 - self.phase_start)
                    if first_call:
                        outputs = self._first_train_step(inputs)
                    else:
                        outputs = self.trainer.train_step(**inputs)
                    in_step = False
                    if self.profiler is not None:
                        self.profiler.after_call(self.step + 1 - self.phase_start)
                    self.calls += 1
                    loss = float(outputs[0])
                    if self.trainer.loss_scaler is None and self.ranks.any(not math.isfinite(loss)):
                        self._stop_on_nonfinite_loss(loss)
                    now = time.perf_counter()
                    self.micro_total += 1
                    self.micro += 1
                    self.reporter.count(loss, None if first_call else now - mark)
                    if first_call:
                        first_call = False
                        self._check_counters()
                        self.reporter.set_startup(self.data.seconds, self.model_seconds, now)
                        # Opened after start-up, so the bar's rate and ETA are steady-state ones.
                        self.console.open_bar(self.end_step, self.step, self.bar_label)
                    mark = now
                    if self.on_micro_step is not None:
                        self.on_micro_step(self)
                    if self.micro < self.gas:
                        continue
                    self.micro = 0
                    if self._end_window(loss):
                        mark = time.perf_counter()  # evaluation and checkpoints are not training time
            except KeyboardInterrupt:
                if in_step:
                    self.unsafe_interrupt = True
                self.interrupted = True
            if interrupt.requested:
                self.interrupted = True
            self.signal = self.signal or interrupt.signal
        self.console.close_bar()

    def _end_window(self, loss):
        """The accumulation window is over: a new optimizer step (True) or a skipped one (mixed precision:
        non-finite gradients). A new step is shown, logged, and evaluated / saved at its intervals."""
        new_step = self.trainer._train_step_info.optimization_step
        if new_step == self.step:
            self.skipped += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                raise TrainingError(f"{self.consecutive_skips} optimizer steps in a row were skipped "
                                    "(non-finite gradients); the loss is probably NaN")
            return False
        self.consecutive_skips = 0
        self.step = new_step
        self.reporter.maybe_log(self.step, loss, self.skipped)
        self._end_profile()
        if self.step < self.end_step:  # the last step's evaluation and checkpoint are finish()'s
            self.evaluator.maybe_evaluate(self.step)
            self.checkpointer.maybe_save(self.step)
        return True

    def _end_profile(self, run_ends=False):
        if self.profiler is not None:
            self.profiler.maybe_finish(self.step - self.phase_start, self.trainer, run_ends)

    def _write_curves(self):
        """curves.png in the run folder (rank 0): the plot of metrics.jsonl, or one warning."""
        if not self.ranks.is_main:
            return
        from orttrainer.run.report import plots as plotting

        try:
            plotting.plot_runs([self.out], self.out / plotting.CURVES_FILE)
        except (plotting.PlotError, OSError) as exc:
            self.say(f"warning: {plotting.CURVES_FILE} not written: {exc}")

    def _stop_on_nonfinite_loss(self, loss):
        """fp32 has no loss scaler to skip the step: stop before anything is logged or saved."""
        where = f"step {self.step + 1}" + (f" (micro-step {self.micro + 1} of {self.gas})" if self.gas > 1 else "")
        what = f"{loss}" if not math.isfinite(loss) else "not finite on another rank"
        raise TrainingError(f"the loss is {what} at {where}; stopped without saving{newest_note(self.out)}. "
                            "Lower trainer.optimizer.lr (or lengthen the warm-up), or check the data and the "
                            "checkpoint the run started from")

    def _first_train_step(self, inputs):
        """The first train_step exports the model, builds the session and applies a pending load."""
        try:
            return self.trainer.train_step(**inputs)
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:  # TypeError: a tensor's dtype
            pending = self.resume_point.pending_load
            if pending is None:
                raise
            raise RecipeError(f"{pending[0]}: cannot load {pending[1]} into this model: "
                              f"{str(exc).splitlines()[0]}") from exc

    def _check_counters(self):
        # The trainer's counters come from its checkpoint, the loop's from the user_dict: they must agree.
        info = self.trainer._train_step_info
        if info.step != self.micro_total or info.optimization_step not in (self.step, self.step + 1):
            raise TrainingError(f"the trainer's counters (step {info.step}, optimization_step "
                                f"{info.optimization_step}) disagree with the loop's ({self.micro_total} "
                                f"train_step calls, step {self.step})")

    # ------------------------------------------------------------ end

    def _interrupted_status(self):
        return EXIT_TERMINATED if self.signal == signal.SIGTERM else EXIT_INTERRUPTED

    def finish(self):
        """Final evaluation and checkpoint (or the interrupt checkpoint); results.json; summary."""
        if self.reporter.startup is None:
            self.reporter.set_startup(self.data.seconds, self.model_seconds)
        completed = not self.interrupted
        self._end_profile(run_ends=True)
        if self.unsafe_interrupt:
            newest = models.complete_checkpoints(self.out)
            where = f"the newest complete checkpoint is {newest[-1]}" if newest else "no checkpoint was saved"
            self.say(f"interrupted inside a training step: its state cannot be saved safely; {where}")
            self.reporter.write_results(self._results("interrupted"))
            self.reporter.close()
            return self._interrupted_status()
        if self.calls == 0:
            self.say("interrupted before the first step: nothing new to save")
            self.reporter.close()
            return self._interrupted_status()
        if completed:
            self.evaluator.evaluate(self.step)
        elif self.signal == signal.SIGTERM:
            self.say("terminated (SIGTERM): saving a checkpoint")
        else:
            self.say("interrupt: saving a checkpoint (Ctrl-C again to stop without saving)")
        folder = self.checkpointer.save(self.step, self.micro)
        self.reporter.write_results(self._results("completed" if completed else "interrupted"))
        self.reporter.close()
        self._write_curves()
        if not completed:
            where = f"step {self.step}"
            if self.micro:
                where += f" (+{self.micro} of {self.gas} micro-steps)"
            self.say(f"interrupted at {where}: saved {folder}")
            if self.resume_command:
                self.say(f"resume with: {self.resume_command}")
            return self._interrupted_status()
        self._export_at_end(folder)
        self.reporter.summary(self._results("completed"), folder)
        return 0

    def _results(self, status):
        steps = {"start": self.phase_start, "end": self.step, "max": self.end_step,
                 "micro_steps": self.micro_total, "skipped": self.skipped}
        eval_seconds = self.evaluator.seconds + (self.profiler.seconds if self.profiler else 0.0)
        return self.reporter.results(status, steps, self.evaluator, eval_seconds, self.checkpointer)

    def _export_at_end(self, folder):
        """run.export_at_end: rank 0 exports the final checkpoint (every rank's file is written by now)."""
        formats = self.run.export_at_end
        if not formats or not self.ranks.is_main:
            return
        from orttrainer.run import model_export as export

        export.export_at_end(folder, [formats] if isinstance(formats, str) else list(dict.fromkeys(formats)),
                             self.out, self.say)


def train(recipe, resume=None, *, resume_command=None, on_micro_step=None, stream=None):
    """Run `recipe` (a Recipe); returns the exit status: 0 done, 130 interrupted by SIGINT and 143 by
    SIGTERM (checkpoint saved). TrainingError (CheckpointWriteError) when training cannot go on.

    `resume`: None (fresh run; the output folder must not hold one), "auto" (newest complete
    checkpoint of the output folder, or a fresh start) or a checkpoint path. `on_micro_step(run)` is
    called after every train_step (tests use it to interrupt). Expected problems raise RecipeError.
    """
    run = _Run(recipe, resume, resume_command, on_micro_step, stream)
    try:
        try:
            if not run.prepare():
                return 0
        except KeyboardInterrupt:
            run.say("interrupted during start-up: nothing to save")
            return EXIT_INTERRUPTED
        run.loop()
        return run.finish()
    finally:
        run.interrupt_handlers.restore()
        run.close()
