"""The output folder of a run: which of its entries a run wrote, and writes that never follow a link.

A run replaces and deletes files of fixed names in its folder (recipe.yaml, metrics.jsonl, tb/, the
checkpoint-N folders, ...). It does so only in a folder an orttrainer run has written: one holding
`orttrainer-run.json` (written by the first run into the folder before anything else) or, from runs of
older versions, a complete checkpoint. Anywhere else an entry of those names is the user's, and the run
refuses to start, naming them. A link among them is never a run's (a run writes no links): the run
refuses it wherever it is, and every file is written under a private name opened with O_EXCL |
O_NOFOLLOW, then renamed over the link itself, so nothing outside the folder is ever written.
"""

import json
import os
import time
from pathlib import Path

from orttrainer.run.recipe.errors import RecipeError

RUN_MARKER = "orttrainer-run.json"
CHECKPOINT_FILE = "checkpoint.ortcp"  # in each checkpoint-N folder, beside COMPLETE once it is whole
COMPLETE_MARKER = "COMPLETE"
# Entries a run writes (and may replace or delete) besides checkpoint-N[-M]/ and its lock.
RUN_ENTRIES = ("recipe.yaml", "metrics.jsonl", "results.json", "curves.png", "tb", "profile",
               "export-hf", "export-onnx")
# TensorBoard's SummaryWriter names its files so; a fresh run removes only these from tb/.
TB_EVENTS_GLOB = "events.out.tfevents.*"


def _private_file(path, binary):
    """A new file next to `path`, opened without following a link: a leftover of the same name (a
    crashed run of this PID, or a planted link) is removed first, never written through."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:
        tmp.unlink()
        fd = os.open(tmp, flags, 0o644)
    return tmp, (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8"))


def write_durably(path, data):
    """Replaces `path` with `data` (str or bytes) in one step (private file, fsync, rename): never half
    written, and never through a link at `path` (the rename replaces the link itself)."""
    tmp, f = _private_file(path, isinstance(data, bytes))
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not stay full of our half-written file
        raise


def open_append(path):
    """`path` opened for appending text; OSError (ELOOP) when it is a link."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    return os.fdopen(fd, "a", encoding="utf-8")


def _run_entries(out):
    """The entries of `out` a run writes: RUN_ENTRIES and checkpoint-N[-M], by name."""
    if not out.is_dir():
        return []
    return sorted(child for child in out.iterdir()
                  if child.name in RUN_ENTRIES or checkpoint_step(child) is not None)


def is_run_folder(out):
    return (Path(out) / RUN_MARKER).is_file() or bool(complete_checkpoints(out))


def check_output_dir(out):
    """RecipeError naming the entries of `out` that a run would replace or delete but no run wrote:
    links (anywhere), and in a folder no run wrote, every entry of a run's names."""
    out = Path(out)
    marker = out / RUN_MARKER
    links = [p for p in [marker, *_run_entries(out)] if p.is_symlink()]
    foreign = [] if is_run_folder(out) else [p for p in _run_entries(out) if not p.is_symlink()]
    if not links and not foreign:
        return
    names = [p.name + ("/" if p.is_dir() else "") for p in foreign] + [f"{p.name} (a link)" for p in links]
    raise RecipeError(f"run.output_dir: {out} holds {', '.join(names)}, which no orttrainer run wrote there "
                      "and this run would replace or delete; move them out of the folder, or use --output-dir "
                      "DIR for this run")


def mark(out):
    """Writes the marker into `out` unless it is there; True when this call wrote it."""
    marker = Path(out) / RUN_MARKER
    if marker.is_file():
        return False
    from orttrainer import __version__

    write_durably(marker, json.dumps({"written_by": "orttrainer train", "version": __version__,
                                      "created": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return True


def unmark_if_unused(out):
    """Removes the marker again when the run wrote nothing else (it failed at start-up)."""
    if not _run_entries(Path(out)):
        (Path(out) / RUN_MARKER).unlink(missing_ok=True)


def remove_tb_events(folder):
    """A fresh run's tb/: the event files of earlier runs go, whatever else the user put there stays."""
    folder = Path(folder)
    if folder.is_dir() and not folder.is_symlink():
        for path in folder.glob(TB_EVENTS_GLOB):
            if path.is_file() or path.is_symlink():
                path.unlink()


def checkpoint_step(folder):
    """(step, micro) of a `checkpoint-N` or `checkpoint-N-M` folder name, or None."""
    name = Path(folder).name
    if not name.startswith("checkpoint-"):
        return None
    parts = name[len("checkpoint-"):].split("-")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def complete_checkpoints(run_dir):
    """Complete checkpoint folders (marker present) of a run, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        step = checkpoint_step(child)
        if step is not None and child.is_dir() and (child / COMPLETE_MARKER).is_file() \
                and (child / CHECKPOINT_FILE).is_file():
            found.append((step, child))
    return [path for _, path in sorted(found)]
