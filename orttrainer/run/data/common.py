"""Small things shared by the data modules."""

import json
import os


class DataError(ValueError):
    """An expected problem with user data or arguments (the CLI prints it as one line)."""


def dump_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None


def as_path_list(paths):
    """One path or a list of paths -> list of str."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return [os.fspath(p) for p in paths]


def relative_to(path, base):
    """`path` relative to folder `base` when inside it (so output folders can move), else absolute."""
    if path is None:
        return None
    path, base = os.path.abspath(path), os.path.abspath(base)
    return os.path.relpath(path, base) if path.startswith(base + os.sep) else path


def resolve_from(path, base):
    """Inverse of `relative_to`."""
    return None if path is None else os.path.normpath(os.path.join(base, path))
