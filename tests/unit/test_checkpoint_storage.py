"""orttrainer._checkpoint_storage: HDF5 layout, atomic writes, clear errors, user_dict encoding."""

import collections
import enum
import io
import os
import pickle
import tracemalloc

import h5py
import numpy as np
import pytest
import torch

from orttrainer import _checkpoint_storage as storage


def _nested():
    return {
        "model": {"full_precision": {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
                                     "fc.bias": torch.tensor([1.0, 2.0], dtype=torch.float16)}},
        "optimizer": {"fc.weight": {"Update_Count": np.array([3], dtype=np.int64)}, "empty": {}},
        "trainer_options": {"mixed_precision": False, "zero_stage": 1, "optimizer_name": "AdamOptimizer",
                            "lr": 0.5},
        "user_dict": "json:{}",
    }


def _leftovers(folder):
    return [name for name in os.listdir(folder) if name.endswith(".tmp")]


# ------------------------------------------------------------------ save / load round trip

def test_round_trip_of_nested_dicts_gives_numpy_values(tmp_path):
    path = tmp_path / "ckpt.ortcp"
    storage.save(_nested(), path)
    loaded = storage.load(path)

    weights = loaded["model"]["full_precision"]
    np.testing.assert_array_equal(weights["fc.weight"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert weights["fc.bias"].dtype == np.float16  # torch tensors are stored as numpy arrays
    assert loaded["optimizer"]["empty"] == {}
    options = loaded["trainer_options"]
    assert type(options["mixed_precision"]) is np.bool_ and not options["mixed_precision"]
    assert type(options["zero_stage"]) is np.int64 and type(options["lr"]) is np.float64
    assert options["optimizer_name"] == b"AdamOptimizer"  # strings come back as bytes (legacy, h5py >= 3)


@pytest.mark.parametrize("key, expected", [
    ("trainer_options", {"mixed_precision": False, "zero_stage": 1, "optimizer_name": b"AdamOptimizer", "lr": 0.5}),
    ("trainer_options/", {"mixed_precision": False, "zero_stage": 1, "optimizer_name": b"AdamOptimizer", "lr": 0.5}),
    ("trainer_options/zero_stage", 1),
    ("/optimizer/fc.weight/Update_Count/", [3]),
    ("optimizer/empty", {}),
])
def test_load_with_a_key_returns_the_sub_dict_or_the_leaf(tmp_path, key, expected):
    path = tmp_path / "ckpt.ortcp"
    storage.save(_nested(), path)
    value = storage.load(path, key=key)
    if isinstance(expected, dict):
        assert value == expected
    else:
        np.testing.assert_array_equal(value, expected)


def test_files_are_plain_hdf5_with_the_legacy_layout(tmp_path):
    path = tmp_path / "ckpt.ortcp"
    storage.save(_nested(), path)
    with h5py.File(path, "r") as f:
        assert isinstance(f["model/full_precision"], h5py.Group)
        assert f["model/full_precision/fc.weight"].shape == (2, 3)
        assert f["trainer_options/optimizer_name"][()] == b"AdamOptimizer"


def test_file_objects_work_like_the_original(tmp_path):
    buffer = io.BytesIO()
    storage.save({"a": {"b": np.arange(3)}}, buffer)
    buffer.seek(0)
    np.testing.assert_array_equal(storage.load(buffer, key="a/b"), np.arange(3))


def test_saved_file_gets_the_usual_permissions(tmp_path):
    path = tmp_path / "ckpt.ortcp"
    old_umask = os.umask(0o022)
    try:
        storage.save({"a": 1}, path)
    finally:
        os.umask(old_umask)
    assert os.stat(path).st_mode & 0o777 == 0o644  # not mkstemp's 0o600


# ------------------------------------------------------------------ legacy files

def test_legacy_file_written_with_plain_h5py_and_pickle_hex_loads(tmp_path):
    path = tmp_path / "legacy.ortcp"
    user_dict = {"epoch": 7, "tensor": torch.arange(4.0), "array": np.arange(3), "pair": (1, "a")}
    with h5py.File(path, "w-") as f:  # what the original _checkpoint_storage.save did
        f.create_group("model").create_group("full_precision")["w"] = np.ones((2, 2), np.float32)
        options = f.create_group("trainer_options")
        options["optimizer_name"] = "LambOptimizer"
        options["world_rank"] = 0
        f["user_dict"] = pickle.dumps(user_dict).hex()

    loaded = storage.load(path)
    assert loaded["trainer_options"]["optimizer_name"] == b"LambOptimizer"
    decoded = storage.decode_user_dict(loaded["user_dict"])  # bytes, restricted unpickler
    assert decoded["epoch"] == 7 and decoded["pair"] == (1, "a")
    assert torch.equal(decoded["tensor"], torch.arange(4.0))
    np.testing.assert_array_equal(decoded["array"], np.arange(3))


# ------------------------------------------------------------------ refusals and atomicity

@pytest.mark.parametrize("obj", [[1, 2, 3], 2.352, "abc"])
def test_saving_something_other_than_a_dict_fails(tmp_path, obj):
    with pytest.raises(ValueError, match="Object to be saved must be a dictionary"):
        storage.save(obj, tmp_path / "x.ortcp")


def test_unsupported_values_fail_naming_the_key_and_leave_nothing(tmp_path):
    path = tmp_path / "x.ortcp"
    with pytest.raises(TypeError, match="'a/int_set'"):
        storage.save({"a": {"int_set": {1, 2, 3}}}, path)
    assert os.listdir(tmp_path) == []


def test_existing_file_is_refused_unless_overwrite(tmp_path):
    path = tmp_path / "ckpt.ortcp"
    storage.save({"version": 1}, path)
    with pytest.raises(FileExistsError, match="overwrite=True") as error:
        storage.save({"version": 2}, path)
    assert str(path) in str(error.value)
    assert storage.load(path, key="version") == 1

    storage.save({"version": 2}, path, overwrite=True)
    assert storage.load(path, key="version") == 2
    assert _leftovers(tmp_path) == []


def test_crash_before_the_rename_keeps_the_previous_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.ortcp"
    storage.save({"version": 1}, path)
    seen = []

    def crash(src, dst):
        seen.append(os.path.basename(src))
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        storage.save({"version": 2, "big": np.zeros(1000)}, path, overwrite=True)

    assert seen[0].startswith(".ckpt.ortcp.") and seen[0].endswith(".tmp")  # a temp file next to the target
    assert storage.load(path) == {"version": 1}
    assert _leftovers(tmp_path) == []


def test_interrupt_while_writing_leaves_no_file(tmp_path, monkeypatch):
    write_group = storage._write_group

    def interrupted(group, mapping, where, layout_only=None):
        if layout_only is not None:  # the size computation, before the temporary file exists
            return write_group(group, mapping, where, layout_only)
        raise KeyboardInterrupt

    monkeypatch.setattr(storage, "_write_group", interrupted)
    with pytest.raises(KeyboardInterrupt):
        storage.save({"a": 1}, tmp_path / "ckpt.ortcp")
    assert os.listdir(tmp_path) == []


def test_save_streams_the_arrays_without_a_second_copy(tmp_path):
    state = {"model": {"w": np.random.default_rng(0).random(1_000_000)}, "step": 3}  # 8 MB of weights
    tracemalloc.start()
    try:
        storage.save(state, tmp_path / "big.ortcp")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # an in-memory image of the file would be 8 MB more
    np.testing.assert_array_equal(storage.load(tmp_path / "big.ortcp", key="model/w"), state["model"]["w"])


def test_free_space_check_uses_the_size_of_the_file(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    state = {"model": {f"w{i}": rng.random(97 * i + 1).astype(np.float32) for i in range(60)},
             "optimizer": {"w1": {"Moment_1": np.zeros((64, 64))}}, "name": "x" * 300, "step": np.int64(7)}
    needed = storage.hdf5_size(state)
    path = tmp_path / "a.ortcp"
    storage.save(state, path)
    assert abs(needed - path.stat().st_size) <= 0.01 * path.stat().st_size, (needed, path.stat().st_size)
    monkeypatch.setattr(storage, "_free_bytes", lambda folder: needed - 1)
    with pytest.raises(storage.DiskFullError, match=f"needs {needed:,} bytes"):
        storage.save(state, tmp_path / "b.ortcp")
    assert sorted(os.listdir(tmp_path)) == ["a.ortcp"]


def test_missing_folder_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        storage.save({"a": 1}, tmp_path / "nope" / "ckpt.ortcp")


# ------------------------------------------------------------------ bad files

def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "missing.ortcp"
    with pytest.raises(FileNotFoundError, match="missing.ortcp"):
        storage.load(path)


@pytest.mark.parametrize("content", [b"", b"not an hdf5 file at all\n" * 10])
def test_non_hdf5_file_gives_the_legacy_message_and_a_note(tmp_path, content):
    path = tmp_path / "bad.ortcp"
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        storage.load(path)
    assert str(error.value) == f"{path} is not an hdf5 file or a python file-like object."
    assert "HDF5 signature" in " ".join(error.value.__notes__)


def test_truncated_file_gives_the_legacy_message_and_a_note(tmp_path):
    path = tmp_path / "ckpt.ortcp"
    storage.save({"w": np.arange(10_000, dtype=np.float64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is not an hdf5 file") as error:
        storage.load(path)
    assert "truncated" in " ".join(error.value.__notes__)


def test_missing_key_names_the_key_and_the_keys_that_exist(tmp_path):
    path = tmp_path / "ckpt.ortcp"
    storage.save(_nested(), path)
    with pytest.raises(KeyError) as error:
        storage.load(path, key="trainer_options/world_rank")
    message = error.value.args[0]
    assert "'trainer_options/world_rank'" in message and "world_rank" in message
    assert "mixed_precision, optimizer_name, zero_stage" in message
    with pytest.raises(KeyError, match="is a value, not a group"):
        storage.load(path, key="user_dict/x")


# ------------------------------------------------------------------ user_dict encoding

@pytest.mark.parametrize("user_dict", [
    {}, {"epoch": 3, "loss": 0.25, "name": "run", "done": False, "none": None, "nested": {"a": [1, 2.5, "x"]}},
])
def test_plain_user_dicts_are_stored_as_json(user_dict):
    encoded = storage.encode_user_dict(user_dict)
    assert encoded.startswith("json:")
    decoded = storage.decode_user_dict(encoded.encode())  # HDF5 gives bytes back
    assert decoded == user_dict
    assert type(decoded["done"] if "done" in decoded else False) is bool


class _Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("value", [
    (1, 2), {1: "int key"}, float("nan"), np.float64(1.5), _Color.RED, collections.OrderedDict(a=1),
    np.arange(3), torch.ones(2), b"bytes", {1, 2},
])
def test_values_json_cannot_hold_exactly_use_pickle_and_come_back_exactly(value):
    encoded = storage.encode_user_dict({"v": value})
    assert not encoded.startswith("json:")
    assert encoded == storage.to_serialized_hex({"v": value})  # the legacy format
    if isinstance(value, _Color):  # IntEnum is not plain data: only with the explicit opt-in
        decoded = storage.decode_user_dict(encoded, allow_unsafe_pickle=True)["v"]
    else:
        decoded = storage.decode_user_dict(encoded)["v"]
    assert type(decoded) is type(value)
    if isinstance(value, (np.ndarray, torch.Tensor)):
        assert (decoded == value).all()
    elif value == value:  # not NaN
        assert decoded == value


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_restricted_unpickler_accepts_numpy_and_torch_at_every_protocol(protocol):
    obj = {"t": torch.arange(6.0).reshape(2, 3)[:, 1:], "p": torch.nn.Parameter(torch.ones(2)),
           "half": torch.ones(2, dtype=torch.bfloat16), "a": np.arange(4).reshape(2, 2),
           "s": np.float32(2.5), "dtype": torch.float16, "misc": [slice(1, 2), range(3), frozenset({1}), 1j,
                                                                  bytearray(b"x"), type(None), None]}
    decoded = storage.from_serialized_hex(pickle.dumps(obj, protocol=protocol).hex())
    assert torch.equal(decoded["t"], obj["t"]) and isinstance(decoded["p"], torch.nn.Parameter)
    assert decoded["half"].dtype == torch.bfloat16
    np.testing.assert_array_equal(decoded["a"], obj["a"])
    assert decoded["s"] == np.float32(2.5) and decoded["dtype"] is torch.float16
    assert decoded["misc"] == obj["misc"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_restricted_unpickler_refuses_a_payload_that_would_run_code(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"x": _RunsCode(marker)}).hex()
    for decode in (storage.decode_user_dict, storage.from_serialized_hex):
        with pytest.raises(pickle.UnpicklingError) as error:
            decode(payload)
        assert "system" in str(error.value) and "allow_unsafe_pickle=True" in str(error.value)
    assert not marker.exists()


class _Trusted:
    def __eq__(self, other):
        return isinstance(other, _Trusted)


def test_custom_classes_need_allow_unsafe_pickle():
    payload = storage.to_serialized_hex({"obj": _Trusted()})
    with pytest.raises(pickle.UnpicklingError, match="test_checkpoint_storage._Trusted"):
        storage.decode_user_dict(payload)
    assert storage.decode_user_dict(payload, allow_unsafe_pickle=True) == {"obj": _Trusted()}
    assert storage.from_serialized_hex(payload, allow_unsafe_pickle=True) == {"obj": _Trusted()}


class _MakesAClass:
    def __reduce__(self):
        return (type, ("Evil", (), {}))


class _OtherCodec:
    def __reduce__(self):
        import _codecs

        return (_codecs.encode, ("x", "rot13"))


@pytest.mark.parametrize("obj", [_MakesAClass(), _OtherCodec()])
def test_allowed_spellings_of_none_type_and_bytes_do_not_open_a_door(obj):
    with pytest.raises(pickle.UnpicklingError, match="restricted unpickler"):
        storage.decode_user_dict(pickle.dumps(obj).hex())


def test_a_string_that_is_neither_json_nor_hex_is_a_value_error():
    with pytest.raises(ValueError, match="neither JSON"):
        storage.decode_user_dict("not hex")


# ------------------------------------------------------------------ _utils: keys and converters

def test_utils_keys_and_converters():
    from orttrainer import _utils

    assert _utils.state_dict_full_precision_key() == "full_precision"
    assert _utils.state_dict_sharded_optimizer_keys() == {"Moment_1", "Moment_2"}
    assert _utils.state_dict_train_step_info_optimization_step_key() == "optimization_step"
    assert [_utils.get_device_index(d) for d in ("cpu", "cuda", "cuda:1")] == [0, 0, 1]
    assert _utils.dtype_torch_to_numpy(torch.bfloat16) is np.float16  # legacy: numpy has no bfloat16
    # Unlike the original, unsigned and bfloat16 types map to their own torch dtypes.
    assert _utils.dtype_onnx_to_torch("UINT8") is torch.uint8
    assert _utils.dtype_onnx_to_torch(12) is torch.uint32 and _utils.dtype_onnx_to_torch(16) is torch.bfloat16
    assert _utils.dtype_onnx_to_torch(0) is None
    with pytest.raises(ValueError, match="STRING has no torch dtype"):
        _utils.dtype_onnx_to_torch("string")
