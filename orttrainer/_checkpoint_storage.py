"""Checkpoint files: nested dicts stored as HDF5, in the legacy layout, readable by plain h5py.

- `save` writes atomically: the file's size is computed (its layout is built in memory without the
  arrays' data) and checked against the free space, then the file is streamed from the caller's
  arrays (no second copy in memory) to a temporary file in the target folder, fsynced and renamed
  into place; an existing path is
  refused unless `overwrite=True`; a full disk raises `DiskFullError` (an OSError) and leaves no
  temporary file.
- `load` returns numpy values (arrays, numpy scalars, strings as bytes) like the original, and
  turns missing, truncated or non-HDF5 files into clear errors.
- `encode_user_dict` / `decode_user_dict`: the user's dict is stored as JSON when JSON holds it
  exactly, else as a pickle hex string (the legacy format). Pickles are read back through a
  restricted unpickler that only builds plain data, unless the caller passes
  `allow_unsafe_pickle=True`: a checkpoint from elsewhere must not run code.
"""

import _compat_pickle
import contextlib
import errno
import io
import json
import math
import os
import pickle
import secrets
import sys
from collections.abc import Mapping

import h5py
import numpy

__all__ = [
    "save", "load", "atomic_write", "encode_user_dict", "decode_user_dict",
    "to_serialized_hex", "from_serialized_hex",
]


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

def save(save_obj, path, overwrite=False):
    """Save the nested dict `save_obj` to the HDF5 file `path`.

    Nested mappings become HDF5 groups; other values become datasets (torch tensors are stored as
    numpy arrays; numpy arrays, Python scalars and strings as h5py stores them). The file appears
    at `path` complete or not at all. An existing `path` raises FileExistsError unless
    `overwrite=True`. `path` may also be a writable binary file object (written in place).
    """
    if not isinstance(save_obj, Mapping):
        raise ValueError("Object to be saved must be a dictionary")
    if _is_file_like(path):
        with h5py.File(path, "w") as f:
            _write_group(f, save_obj, "")
        return

    needed = hdf5_size(save_obj)
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    check_free_space(folder, needed, os.fspath(path))

    def write(tmp_path):
        # Streamed from the caller's arrays (no second copy of the state in memory), through a file
        # object that keeps a failed write from HDF5 (see _WriteGuard).
        with open(tmp_path, "r+b") as raw:
            guard = _WriteGuard(raw)
            with h5py.File(guard, "w") as f:
                _write_group(f, save_obj, "")
            guard.flush()
        if guard.error is not None:
            raise guard.error

    try:
        atomic_write(path, write, overwrite=overwrite)
    except OSError as exc:
        free = _free_bytes(folder)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) or (exc.errno is None and free is not None and free < needed):
            raise DiskFullError(os.fspath(path), needed, free) from None
        raise


class _WriteGuard:
    """The file object h5py writes a checkpoint through. A failed write (a full disk) inside HDF5
    cascades into errors while the file closes and can crash the process; here the first error is
    kept in `error`, later writes are dropped, HDF5 closes normally, and the caller raises `error`
    (the half-written file is deleted)."""

    def __init__(self, file):
        self._file = file
        self.error = None

    def _guarded(self, call, *args, result=None):
        if self.error is None:
            try:
                return call(*args)
            except OSError as exc:
                self.error = exc
        return result

    def write(self, data):
        return self._guarded(self._file.write, data, result=memoryview(data).nbytes)

    def truncate(self, size=None):
        return self._guarded(self._file.truncate, size, result=size)

    def flush(self):
        self._guarded(self._file.flush)

    def read(self, size=-1):
        return self._file.read(size)

    def readinto(self, buffer):
        return self._file.readinto(buffer)

    def seek(self, offset, whence=0):
        return self._file.seek(offset, whence)

    def tell(self):
        return self._file.tell()


class DiskFullError(OSError):
    """Not enough space to write a file; `path`, `needed` and `free` (bytes, None if unknown)."""

    def __init__(self, path, needed, free):
        self.path, self.needed, self.free = path, needed, free
        free_text = f", {free:,} free" if free is not None else ""
        super().__init__(errno.ENOSPC, f"no space left to write {path}: it needs {needed:,} bytes{free_text}")


def _free_bytes(folder):
    try:
        stat = os.statvfs(folder)
    except (OSError, AttributeError):  # AttributeError: no statvfs on this OS
        return None
    return stat.f_bavail * stat.f_frsize


def check_free_space(folder, needed, path):
    """DiskFullError when `folder`'s file system has less than `needed` bytes free for `path`."""
    free = _free_bytes(folder)
    if free is not None and free < needed:
        raise DiskFullError(path, needed, free)


# Arrays above this size are left out of the layout pass of `hdf5_size` (their bytes are counted).
_LAYOUT_ONLY_BYTES = 4096


def hdf5_size(save_obj):
    """The size in bytes of the HDF5 file of `save_obj`, to within HDF5's metadata placement (about
    0.2%): the file's layout is built in memory with the large arrays' datasets left unwritten (no
    copy of their data), and their bytes are added."""
    data_bytes = [0]
    with h5py.File(f"in-memory-{secrets.token_hex(6)}.h5", "w", driver="core", backing_store=False) as f:
        _write_group(f, save_obj, "", data_bytes)
        f.flush()
        return len(f.id.get_file_image()) + data_bytes[0]


def atomic_write(path, write, overwrite=False):
    """Call `write(tmp_path)` on a fresh temporary file next to `path`, then rename it to `path`.

    A crash at any moment leaves either the previous file or the complete new one at `path`; on
    any error the temporary file (`.<name>.<random>.tmp` in the same folder) is removed.
    """
    path = os.fspath(path)
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save {path}: folder {folder} does not exist")

    # Like tempfile.mkstemp, but created with mode 0o666 & ~umask so that the renamed file gets
    # the permissions a plain open() would give it (mkstemp makes it 0o600).
    tmp_path = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(tmp_path)
        _fsync(tmp_path)  # the data must be on disk before the rename makes it visible
        # Small window: another process creating `path` after the check above gets replaced.
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise
    with contextlib.suppress(OSError):  # persist the rename itself (not possible on every OS)
        _fsync(folder)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_group(group, mapping, where, layout_only=None):
    """Write `mapping` into the h5py group; with `layout_only` (a one-item list), large numeric
    arrays get an unwritten dataset and their byte count is added to layout_only[0]."""
    for key, value in mapping.items():
        name = f"{where}/{key}" if where else str(key)
        if not isinstance(key, str) or not key or "/" in key or key == ".":
            raise ValueError(f"cannot save key {name!r}: HDF5 names must be non-empty strings without '/'")
        if isinstance(value, Mapping):
            _write_group(group.create_group(key), value, name, layout_only)
            continue
        try:
            value = _storable(value)
            if (layout_only is not None and isinstance(value, numpy.ndarray) and value.dtype.kind in "biufc"
                    and value.nbytes > _LAYOUT_ONLY_BYTES):
                group.create_dataset(key, shape=value.shape, dtype=value.dtype)
                layout_only[0] += value.nbytes
                continue
            group[key] = value
        except (TypeError, ValueError) as exc:
            raise TypeError(f"cannot save {name!r} ({type(value).__name__}) to HDF5: {exc}") from exc


def _dfs_save(group, save_obj):
    """Write the nested dict `save_obj` into the h5py group (the original's helper of `save`)."""
    _write_group(group, save_obj, "")


def _storable(value):
    torch = sys.modules.get("torch")  # a tensor implies torch is already imported
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def _is_file_like(path):
    return hasattr(path, "read") or hasattr(path, "write")


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

def load(path, key=None):
    """Load the HDF5 checkpoint at `path` into a nested dict of numpy values.

    `key` selects one entry with '/' separators ('trainer_options', 'model/full_precision/w',
    a trailing slash is fine): a group comes back as a dict, a dataset as `dataset[()]` (a numpy
    array or numpy scalar; strings come back as bytes, as with the original and h5py >= 3).

    Raises FileNotFoundError (no such file), ValueError (not an HDF5 file, truncated or corrupt),
    KeyError (`key` not in the file; the message lists the keys that exist).
    """
    with open_checkpoint(path) as f:
        node = _lookup(f, key, path) if key else f
        if isinstance(node, h5py.Dataset):
            return node[()]
        return _read_group(node)


@contextlib.contextmanager
def open_checkpoint(path):
    """Open `path` read-only as an h5py.File, raising the errors documented in `load`."""
    if not _is_file_like(path):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        if not h5py.is_hdf5(path):
            raise _not_hdf5(path, "It does not start with the HDF5 signature; checkpoints are "
                                  "written by ORTTrainer.save_checkpoint.")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise _not_hdf5(path, f"h5py cannot open it ({exc}); it is probably truncated or corrupt.") from exc
    with f:
        try:
            yield f
        except OSError as exc:  # h5py reports unreadable data blocks as OSError
            raise _not_hdf5(path, f"Reading it failed ({exc}); it is probably corrupt.") from exc


def _not_hdf5(path, why):
    exc = ValueError(f"{path} is not an hdf5 file or a python file-like object.")
    exc.add_note(why)
    return exc


def _lookup(root, key, path):
    parts = [part for part in key.split("/") if part]
    node = root
    for i, part in enumerate(parts):
        where = "/".join(parts[:i]) or "the top level"
        if not isinstance(node, h5py.Group):
            raise KeyError(f"key {key!r} not found in {path}: {where} is a value, not a group")
        if part not in node:
            existing = ", ".join(sorted(node.keys())) or "nothing"
            raise KeyError(f"key {key!r} not found in {path}: {where} has no {part!r} (it has: {existing})")
        node = node[part]
    return node


def _read_group(group):
    return {key: _read_group(item) if isinstance(item, h5py.Group) else item[()]
            for key, item in group.items()}


def _dfs_load(group, load_obj):
    """Read the h5py group into the dict `load_obj` (the original's helper of `load`)."""
    load_obj.update(_read_group(group))


# --------------------------------------------------------------------------------------------
# user_dict
# --------------------------------------------------------------------------------------------

_JSON_PREFIX = "json:"  # never a valid start of hex, so legacy pickle-hex strings stay unambiguous


def encode_user_dict(user_dict):
    """Encode `user_dict` as a string for the checkpoint's 'user_dict' entry.

    'json:<json>' when JSON holds it exactly (only dict/list/str/int/float/bool/None with str keys
    and finite floats), else the legacy pickle hex (`to_serialized_hex`), which old readers read.
    """
    if _is_exact_json(user_dict):
        return _JSON_PREFIX + json.dumps(user_dict, allow_nan=False)
    return to_serialized_hex(user_dict)


def decode_user_dict(serialized, allow_unsafe_pickle=False):
    """Decode what `encode_user_dict` (or the original ORTTrainer) stored; str or bytes.

    Pickle payloads may only build plain data (builtins, numpy arrays, torch tensors) unless
    `allow_unsafe_pickle=True`; anything else raises pickle.UnpicklingError naming the global.
    """
    if isinstance(serialized, (bytes, bytearray)):
        serialized = bytes(serialized).decode()
    if not isinstance(serialized, str):
        raise TypeError(f"user_dict must be a str or bytes, got {type(serialized).__name__}")
    if serialized.startswith(_JSON_PREFIX):
        return json.loads(serialized[len(_JSON_PREFIX):])
    return from_serialized_hex(serialized, allow_unsafe_pickle=allow_unsafe_pickle)


def to_serialized_hex(user_dict):
    """The legacy encoding: pickle bytes as a hex string."""
    return pickle.dumps(user_dict).hex()


def from_serialized_hex(serialized_hex, allow_unsafe_pickle=False):
    """Decode a pickle hex string (str or bytes) with the restricted unpickler (see decode_user_dict)."""
    if isinstance(serialized_hex, (bytes, bytearray)):
        serialized_hex = bytes(serialized_hex).decode()
    try:
        data = bytes.fromhex(serialized_hex)
    except ValueError as exc:
        raise ValueError(f"user_dict is neither JSON ('{_JSON_PREFIX}...') nor a pickle hex string: "
                         f"{exc}") from None
    if allow_unsafe_pickle:
        return pickle.loads(data)
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def _is_exact_json(obj):
    kind = type(obj)  # exact types: subclasses (OrderedDict, IntEnum, np.float64) need pickle
    if obj is None or kind in (str, int, bool):
        return True
    if kind is float:
        return math.isfinite(obj)
    if kind is list:
        return all(_is_exact_json(item) for item in obj)
    if kind is dict:
        return all(type(k) is str and _is_exact_json(v) for k, v in obj.items())
    return False


# Globals a plain-data pickle may reference.
_ALLOWED_GLOBALS = {
    *(("builtins", name) for name in (
        "dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes",
        "bytearray", "bool", "slice", "range")),
    ("collections", "OrderedDict"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),  # arrays pickled with protocol 5
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
}


def _none_type(*args):
    # Pickle spells the NoneType object as type(None); nothing else may go through `type`.
    if args != (None,):
        raise pickle.UnpicklingError("the restricted unpickler only allows type(None)")
    return type(None)


def _latin1_encode(*args):
    # Protocol <= 2 pickles spell bytes as _codecs.encode(text, 'latin1'); other codecs refused.
    if len(args) != 2 or args[1] not in ("latin1", "latin-1") or not isinstance(args[0], str):
        raise pickle.UnpicklingError(f"the restricted unpickler only allows _codecs.encode(str, 'latin1'), "
                                     f"not the codec {args[1:]!r}")
    return args[0].encode("latin1")


def _load_storage_bytes(data):
    # torch.storage._load_from_bytes calls torch.load(weights_only=False), which runs any pickle:
    # load the storage with torch's own restricted loader instead.
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


_SUBSTITUTES = {
    ("builtins", "type"): _none_type,
    ("_codecs", "encode"): _latin1_encode,
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        spelled = f"{module}.{name}"
        if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2 names (protocol <= 2)
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if module.startswith("numpy.core"):  # numpy 1 spelling of numpy._core
            module = "numpy._core" + module[len("numpy.core"):]
        if (module, name) in _SUBSTITUTES:
            return _SUBSTITUTES[(module, name)]
        if (module, name) in _ALLOWED_GLOBALS or _is_torch_dtype(module, name):
            if module.startswith("numpy._core") and not hasattr(numpy, "_core"):
                module = "numpy.core" + module[len("numpy._core"):]  # running on numpy 1
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"Refusing to unpickle the global '{spelled}': the user_dict of this checkpoint holds more "
            "than plain data (builtins, numpy arrays, torch tensors), and unpickling it could run code. "
            "If the file is trusted, pass allow_unsafe_pickle=True.")


def _is_torch_dtype(module, name):
    if module != "torch":
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)
