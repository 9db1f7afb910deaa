"""Checkpoint and resume of a run: checkpoint-N folders, the loop state they carry, and finding and
reading the one to continue from (`--resume`, `run.init_from`).

Exact resume. A checkpoint folder holds the trainer's checkpoint file (weights, optimizer state,
step counters, loss scaler, a partly accumulated gradient) and, in its user_dict, the loop's state:
data position, Python/NumPy/torch RNG states, the partly logged window, best metrics. Dropout runs
inside onnxruntime with onnxruntime's RNG, whose position a checkpoint cannot hold; the loop seeds
it before every train_step from (run.seed, number of train_step calls), so the masks are a function
of the step and a resumed run computes exactly what an uninterrupted one does (same process or not;
tests/integration/test_recipes.py checks it with dropout on).
"""

import math
import random
import shlex
import shutil
import time
from pathlib import Path

import numpy as np

from orttrainer import checkpoint
from orttrainer._checkpoint_storage import DiskFullError
from orttrainer.run import hf_models as models
from orttrainer.run.errors import CheckpointWriteError, TrainingError
from orttrainer.run.hf_models import CHECKPOINT_FILE, COMPLETE_MARKER, MODEL_JSON
from orttrainer.run.recipe.spec import RecipeError, parse_yaml
from orttrainer.run.report.reporter import METRICS_FILE, RESULTS_FILE, write_durably


USER_DICT_KEY = "orttrainer_loop"
STATE_VERSION = 1


def _rng_state():
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], [int(x) for x in np_state[1]], int(np_state[2]), int(np_state[3]),
                      float(np_state[4])],
            "torch": [int(x) for x in torch.get_rng_state().tolist()]}


def set_rng_state(state):
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


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


class Resume:
    """Where a run starts from: `--resume` (or a torchrun restart), the output folder's state, the
    checkpoint's loop state and the counters it restores. Used before the trainer exists, so it is apart
    from `Checkpointer`, which saves.

    `find()` picks the checkpoint folder (None: a fresh start), `check_fresh_output_dir` clears or
    refuses an old run, `read_loop_state` reads the folder's loop state, `warn_recipe_changes` and
    `warn_schedule_change` say what differs, `load_counters` queues the trainer's load and returns the
    loop's counters.
    """

    def __init__(self, out, resume, ranks, say):
        self.out, self.resume, self.ranks, self.say = Path(out), resume, ranks, say
        self.folder = None
        self.pending_load = None  # (what, path) of the checkpoint the trainer loads at session start

    def find(self):
        """The checkpoint folder to continue from, or None (a fresh start)."""
        self._resume_on_restart()
        if self.resume is None:
            self.folder = None
        elif self.resume == "auto":
            self.folder = self._newest_intact_checkpoint()
        else:
            self.folder = self._named_checkpoint()
        return self.folder

    def _resume_on_restart(self):
        """A rank torchrun restarted (--max-restarts) continues from the newest complete checkpoint of
        the output folder, as with --resume auto (a fresh start when the first attempt saved none);
        the --resume PATH the command was given is used only while the folder has no checkpoint."""
        from orttrainer.run.ranks import restart_attempt

        attempt = restart_attempt()
        if attempt == 0 or self.resume == "auto":
            return
        if self.resume is None or models.complete_checkpoints(self.out):
            self.say(f"restart {attempt} (torchrun): resuming from the newest complete checkpoint in {self.out} "
                     "(as --resume auto)")
            self.resume = "auto"

    def _named_checkpoint(self):
        file, folder = models.find_checkpoint(self.resume, "--resume")
        if folder is None or not (Path(folder) / MODEL_JSON).is_file():
            raise RecipeError(f"--resume: {self.resume} is not a checkpoint-N folder written by "
                              "`orttrainer train` "
                              "(other checkpoints can start a run as run.init_from or model.from)")
        damage = models.checkpoint_damage(folder)
        if damage is not None:
            raise RecipeError(f"--resume: {folder} is damaged: {damage}; resume from an earlier checkpoint "
                              "(--resume auto picks the newest intact one)")
        return Path(folder)

    def _newest_intact_checkpoint(self):
        """--resume auto: the newest complete checkpoint whose files match their checksums; newer
        unfinished or damaged ones are skipped with a warning (and replaced when the run passes them)."""
        found = models.complete_checkpoints(self.out)
        for path in models.incomplete_checkpoints(self.out):
            if not found or models.checkpoint_step(path) > models.checkpoint_step(found[-1]):
                self.say(f"resume: skipping {path} (no {COMPLETE_MARKER} marker: its save did not finish)")
        if not found:
            self.say(f"resume: no complete checkpoint in {self.out}; starting from scratch")
            return None
        for path in reversed(found):
            damage = models.checkpoint_damage(path)
            if damage is None:
                return path
            self.say(f"resume: warning: skipping {path}: it is damaged ({damage})")
        raise RecipeError(f"--resume auto: every checkpoint in {self.out} is damaged (see the warnings above); "
                          "use --output-dir DIR for a new run, or --set run.overwrite_output_dir=true "
                          "without --resume to replace this one")

    def check_fresh_output_dir(self, overwrite):
        existing = models.complete_checkpoints(self.out) + models.incomplete_checkpoints(self.out)
        files = [self.out / name for name in (METRICS_FILE, RESULTS_FILE) if (self.out / name).exists()]
        if not existing and not files:
            return
        if not overwrite:
            newest = f" (newest: {existing[-1].name})" if existing else ""
            raise RecipeError(f"run.output_dir: {self.out} already holds a run{newest}; use --resume auto to "
                              "continue it, --output-dir DIR for a new run, or --set "
                              "run.overwrite_output_dir=true to replace it")
        self.say(f"overwriting the run in {self.out}")
        if not self.ranks.is_main:
            return
        for path in existing:
            shutil.rmtree(path)
        for path in files:
            path.unlink()

    def read_loop_state(self):
        """This rank's loop state: its own file's (the partly logged window is the rank's own losses),
        rank 0's when the checkpoint has no file of this rank (it was saved by fewer processes)."""
        from orttrainer import _checkpoint_storage

        file = models.rank_file(self.folder, self.ranks.rank)
        if not file.is_file():
            file = self.folder / CHECKPOINT_FILE
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

    def warn_recipe_changes(self, state, recipe):
        try:
            old = parse_yaml(state["recipe"], "checkpoint recipe")
        except RecipeError:
            return
        new = recipe.doc
        changes = []
        for section in ("model", "data", "trainer"):
            changes += _diff(old.get(section) or {}, new.get(section) or {}, section)
        if changes:
            self.say("resume: the recipe differs from the checkpoint's in " + "; ".join(changes[:8])
                     + (f" and {len(changes) - 8} more" if len(changes) > 8 else ""))

    def warn_schedule_change(self, state, recipe, scheduler, step, phase_start):
        """A resumed run whose schedule differs from the checkpoint's (run.max_steps sets the default
        trainer.lr_scheduler.total_steps, so raising it stretches a decaying schedule): one warning with
        the old and the new learning rate of the next step, and how to keep the old schedule.
        `scheduler` is the loop's phase scheduler."""
        from types import SimpleNamespace

        from orttrainer.run.recipe.spec import lr_scheduler_of

        if state is None or scheduler is None:
            return
        try:
            old_trainer = parse_yaml(state["recipe"], "checkpoint recipe")["trainer"]
            old = lr_scheduler_of(old_trainer)
            old_lr0 = float(old_trainer["optimizer"]["lr"])
        except (RecipeError, KeyError, TypeError, AttributeError):
            return
        if old is None:
            return
        phase_step = step - phase_start

        def lr(schedule, lr0):
            info = SimpleNamespace(optimizer_config=SimpleNamespace(lr=lr0), optimization_step=phase_step)
            return float(schedule.get_lr(info)[0])

        was, now = lr(old, old_lr0), lr(scheduler.inner, float(recipe.trainer["optimizer"]["lr"]))
        if math.isclose(was, now, rel_tol=1e-9, abs_tol=0.0):
            return
        old_total, new_total = old_trainer["lr_scheduler"].get("total_steps"), \
            recipe.trainer["lr_scheduler"].get("total_steps")
        why = (f"trainer.lr_scheduler.total_steps {old_total} -> {new_total}, which follows run.max_steps unless "
               "set" if old_total != new_total else "the learning-rate settings changed")
        keep = (f"; to keep the checkpoint's schedule, resume with --set trainer.lr_scheduler.total_steps={old_total}"
                if old_total != new_total else "")
        self.say(f"resume: warning: the learning-rate schedule changed ({why}): the learning rate at step "
                 f"{step + 1} is {now:.6g}, the checkpoint's schedule gives {was:.6g}{keep}")

    def load_counters(self, trainer, state, init_source, gas):
        """Queues the load of the checkpoint the run starts from (applied when the trainer's session
        starts) and returns the loop's counters: step (optimizer steps, global), micro (train_step calls
        into the window), micro_total (train_step calls) and phase_start (the phase's first step)."""
        from orttrainer import checkpoint
        from orttrainer._utils import OPTIMIZATION_STEP_KEY, STEP_KEY, TRAIN_STEP_INFO_KEY

        self.pending_load = None
        if state is not None:
            _check_optimizer(trainer, self.folder / CHECKPOINT_FILE, "--resume")
            self.pending_load = ("--resume", str(self.folder / CHECKPOINT_FILE))
            files = models.files_to_load(self.folder / CHECKPOINT_FILE)
            own = models.rank_file(self.folder, self.ranks.rank)
            if trainer.options.distributed.enable_adasum and len(files) == 1 and own.is_file():
                files = [str(own)]  # Adasum: equal weights, but each rank's own optimizer moments
            trainer.load_checkpoint(*files)  # applied at session start
            return {key: state[key] for key in ("step", "micro", "micro_total", "phase_start")}
        if init_source is not None:
            _check_optimizer(trainer, init_source.path, "run.init_from")
            self.pending_load = ("run.init_from", init_source.path)
            saved, _ = checkpoint._load_checkpoint(models.files_to_load(init_source.path))
            info = saved.get(TRAIN_STEP_INFO_KEY, {})
            start = int(np.asarray(info.get(OPTIMIZATION_STEP_KEY, 0)))
            # This phase's accumulation window starts at a boundary (its gradient_accumulation_steps
            # may differ from the earlier phase's); any half-accumulated gradient is dropped.
            saved[TRAIN_STEP_INFO_KEY] = {OPTIMIZATION_STEP_KEY: start, STEP_KEY: start * gas}
            saved.pop("gradient_accumulation", None)
            trainer.load_state_dict(saved)
            self.say(f"init: weights, optimizer state and step count ({start}) from {init_source.path}")
            return {"step": start, "micro": 0, "micro_total": start * gas, "phase_start": start}
        return {"step": 0, "micro": 0, "micro_total": 0, "phase_start": 0}


def _check_optimizer(trainer, file, what):
    from orttrainer import _checkpoint_storage

    try:
        options = _checkpoint_storage.load(file, key="trainer_options")
    except (OSError, ValueError, KeyError) as exc:
        raise RecipeError(f"{what}: cannot read {file}: {exc}") from None
    saved = options.get("optimizer_name")
    saved = saved.decode() if isinstance(saved, bytes) else saved
    mine = trainer.optim_config.name
    if saved is not None and str(saved) != mine:
        raise RecipeError(f"{what}: {file} was trained with {saved}, this recipe uses {mine} "
                          "(trainer.optimizer.name); the optimizer state cannot be carried over")


def newest_note(out):
    """What the newest complete checkpoint of `out` is, for messages of a run that stops."""
    newest = models.complete_checkpoints(out)
    if not newest:
        return "; no checkpoint was saved before"
    return f"; the newest checkpoint is {newest[-1]}, left as it was"


class Checkpointer:
    """checkpoint-N[-M]/ folders of a run: every `every` optimizer steps (`maybe_save`), or when told
    (`save`: an interrupt, the end of the run); at most `keep` complete ones (0: all).

    `states`: the run's parts whose `state_dict()` (flat keys) go into the loop state of every
    checkpoint, with the RNG states, which this class saves and `load_state_dict` restores.
    `run_files()`: {file name: text} written beside the trainer's files (model.json, tokenizer.json).
    """

    def __init__(self, out, every, keep, trainer, ranks, states, run_files, recipe_yaml, say,
                 resume_command=None):
        self.out, self.every, self.keep = Path(out), every, keep
        self.trainer, self.ranks, self.states = trainer, ranks, states
        self.run_files, self.recipe_yaml = run_files, recipe_yaml
        self.say, self.resume_command = say, resume_command
        self.last = None  # the folder last saved
        self.seconds = 0.0

    def maybe_save(self, step, micro=0):
        """A checkpoint when `step` is a multiple of the interval; returns its folder or None."""
        if not self.every or step % self.every:
            return None
        folder = self.save(step, micro)
        self.say(f"saved {folder}")
        return folder

    def state_dict(self):
        """The checkpointer's own part of the loop state: the Python, NumPy and torch RNG states."""
        return {"rng": _rng_state()}

    def load_state_dict(self, state):
        set_rng_state(state["rng"])

    def loop_state(self):
        """The loop state a checkpoint carries in its user_dict."""
        state = {"version": STATE_VERSION}
        for part in self.states:
            state.update(part.state_dict())
        state.update(self.state_dict())
        state["recipe"] = self.recipe_yaml
        return state

    def save(self, step, micro=0):
        """checkpoint-N[-M]/: every rank's trainer file, then (rank 0) the run's files and, last, the
        COMPLETE marker with the files' checksums, written only once every rank's file is: --resume
        auto never sees a partial one. A checkpoint of the same name from an earlier attempt (a run
        resumed from an older checkpoint passes it again) is replaced. Failing to write (a full disk)
        removes the partial folder and raises CheckpointWriteError; older checkpoints stay as they were."""
        started = time.perf_counter()
        name = f"checkpoint-{step}" + (f"-{micro}" if micro else "")
        folder = self.out / name
        if folder == self.last:
            return folder  # saved at this very state already (an interrupt right after a periodic save)
        state = self.trainer.state_dict()
        self._check_finite_weights(state, step)
        user = {USER_DICT_KEY: _exact_json(self.loop_state())}
        rank_file = str(models.rank_file(folder, self.ranks.rank))
        # Three steps, each followed by the ranks agreeing that all of them succeeded.
        self._save_step(folder, self._make_folder if self.ranks.is_main else None, folder)
        self._save_step(folder, checkpoint._save_checkpoint, state, rank_file, user_dict=user)
        del state
        self._save_step(folder, self._write_run_files if self.ranks.is_main else None, folder, step, micro)
        if self.ranks.is_main:
            self._rotate(folder)
        self.seconds += time.perf_counter() - started
        self.last = folder
        return folder

    def _save_step(self, folder, write, *args, **kwargs):
        failure = None
        if write is not None:
            try:
                write(*args, **kwargs)
            except OSError as exc:
                failure = exc
        if self.ranks.any(failure is not None):
            self._abandon_save(folder, failure)

    @staticmethod
    def _make_folder(folder):
        if folder.is_symlink():
            folder.unlink()  # a link itself: a checkpoint is never written through it
        elif folder.exists():
            shutil.rmtree(folder)  # an earlier attempt at this step, or a save that did not finish
        folder.mkdir(parents=True)

    def _check_finite_weights(self, state, step):
        """Refuse to save NaN/inf weights: they would replace (and rotate away) good checkpoints."""
        from orttrainer._utils import FULL_PRECISION_KEY, MODEL_KEY

        bad = [name for name, value in state.get(MODEL_KEY, {}).get(FULL_PRECISION_KEY, {}).items()
               if not np.isfinite(np.asarray(value)).all()]
        if bad:
            raise TrainingError(f"step {step}: weights hold NaN or inf ({', '.join(bad[:3])}"
                                f"{' ...' if len(bad) > 3 else ''}); not saving a checkpoint over the good "
                                f"ones{newest_note(self.out)}")

    def _abandon_save(self, folder, failure):
        if self.ranks.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        self.ranks.barrier()
        if failure is None:
            text = "another rank could not write its file (see its error)"
        elif isinstance(failure, DiskFullError):
            text = f"the disk is full: {failure.path} needs {failure.needed:,} bytes" + \
                (f", {failure.free:,} are free" if failure.free is not None else "")
        else:
            text = str(failure)
        resume = f"; free space and resume with: {self.resume_command}" if self.resume_command else ""
        raise CheckpointWriteError(f"checkpoint: cannot write {folder}: {text}; removed the partial folder"
                                   f"{newest_note(self.out)}{resume}")

    def _write_run_files(self, folder, step, micro):
        """Rank 0's part of a save: model, tokenizer, recipe and, last, the marker."""
        for name, text in self.run_files().items():
            write_durably(folder / name, text)
        write_durably(folder / "recipe.yaml", self.recipe_yaml)
        # The marker last: it lists every rank's file, so all of them are written by now.
        write_durably(folder / COMPLETE_MARKER, models.marker_text(
            folder, step=step, micro=micro, world_size=self.ranks.world_size))

    def _rotate(self, folder):
        if self.keep:
            complete = models.complete_checkpoints(self.out)
            for old in complete[:-self.keep]:
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)


def resume_command(recipe_path, overrides, output_dir, nproc=1):
    parts = ["orttrainer", "train", recipe_path] + (["--nproc", str(nproc)] if nproc > 1 else [])
    for assignment in overrides:
        parts += ["--set", assignment]
    if output_dir:
        parts += ["--output-dir", str(output_dir)]
    parts += ["--resume", "auto"]
    return " ".join(shlex.quote(p) for p in parts)
