"""The export cache never trains a stale graph (engine/export/cache.py, engine/export/cache_key.py): the key sees
the code forward reaches, config objects and package versions; every hit is checked against an eager
forward; the folder has an LRU size bound; concurrent processes never read half an entry."""

import copy
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from helpers.models import MLP, MLP_DESC, cross_entropy
from helpers.training import cache_key

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine.export import cache as export_cache

STALE = "did not match the model's eager outputs"


def options(cache_dir, **utils):
    return ORTTrainerOptions({"device": {"id": "cpu"}, "utils": {"export_cache_dir": str(cache_dir), **utils}})


def mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def first_loss_and_eager(model, cache_dir, desc=MLP_DESC, batch=None, loss_fn=cross_entropy, **utils):
    """(trainer, ORT loss of the first train step, eager loss at the same initial weights)."""
    batch = batch or mlp_batch()
    model.eval()
    with torch.no_grad():
        eager = (loss_fn(model(*batch[:-1]), batch[-1]) if loss_fn else model(*batch)[0]).item()
    model.train()
    trainer = ORTTrainer(model, copy.deepcopy(desc), optim.SGDConfig(lr=0.0), loss_fn=loss_fn,
                         options=options(cache_dir, **utils))
    return trainer, trainer.train_step(*batch)[0].item(), eager


def stale_warnings(caplog):
    return [r for r in caplog.records if STALE in r.getMessage()]


# ============================================================================ code forward reaches
HELPERS = """
import torch

SCALE = {scale}


def activation(x):
    return {body} * SCALE
"""

NET = """
import torch
{import_line}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2({call}(self.fc1(x)))
"""


def write_module(folder, name, text):
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    stamp = time.time() + 10 * len(list(folder.iterdir()))  # a new mtime: no stale bytecode or linecache
    os.utime(path, (stamp, stamp))


@pytest.mark.parametrize("where", ["same module", "helper module"])
@pytest.mark.parametrize("change", ["SCALE", "body"])
def test_changed_helper_or_global_is_exported_and_trained(tmp_path, monkeypatch, caplog, where, change):
    """The issue's case: forward calls a module-level helper `relu(x) * SCALE`; changing SCALE or the
    helper's body between two runs re-exports, and the second run trains the new function."""
    code = tmp_path / "code"
    code.mkdir()
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    tag = f"{where.split()[0]}_{change}".lower()
    net_name, helper_name = f"net_{tag}", f"helpers_{tag}"

    def write(scale, body):
        helpers = HELPERS.format(scale=scale, body=body)
        if where == "same module":
            write_module(code, net_name, NET.format(import_line=helpers.replace("import torch", ""),
                                                    call="activation"))
        else:
            write_module(code, helper_name, helpers)
            write_module(code, net_name, NET.format(import_line=f"import {helper_name}",
                                                    call=f"{helper_name}.activation"))
        importlib.invalidate_caches()
        for name in (helper_name, net_name):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
        return importlib.import_module(net_name)

    def run(module):
        torch.manual_seed(0)
        return first_loss_and_eager(module.Net(), tmp_path / "cache")

    first, old_loss, old_eager = run(write(1.0, "torch.relu(x)"))
    assert first._build.source == "export" and old_loss == pytest.approx(old_eager, rel=1e-5)

    new = write(3.0, "torch.relu(x)") if change == "SCALE" else write(1.0, "torch.tanh(x)")
    with caplog.at_level(logging.WARNING, logger="orttrainer"):
        second, new_loss, new_eager = run(new)
        assert second._build.source == "export"  # the key changed: no stale entry was even loaded
        assert new_loss == pytest.approx(new_eager, rel=1e-5) and abs(new_loss - old_loss) > 1e-2
        third, again, _ = run(new)  # the same code again: its own entry
    assert third._build.source == "export cache" and again == pytest.approx(new_eager, rel=1e-5)
    assert not stale_warnings(caplog)


# ============================================================================ config objects
class Config:
    """A config object whose choice is private (like Hugging Face's _attn_implementation)."""

    def __init__(self, act):
        self.hidden = 16
        self._act = act


class ConfiguredNet(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc1 = torch.nn.Linear(6, config.hidden)
        self.fc2 = torch.nn.Linear(config.hidden, 4)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h) if self.config._act == "tanh" else torch.relu(h))


def test_config_attribute_change_is_exported_and_trained(tmp_path, caplog):
    torch.manual_seed(0)
    relu, relu_loss, relu_eager = first_loss_and_eager(ConfiguredNet(Config("relu")), tmp_path)
    assert relu._build.source == "export" and relu_loss == pytest.approx(relu_eager, rel=1e-5)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="orttrainer"):
        tanh, tanh_loss, tanh_eager = first_loss_and_eager(ConfiguredNet(Config("tanh")), tmp_path)
    assert tanh._build.source == "export" and not stale_warnings(caplog)
    assert tanh_loss == pytest.approx(tanh_eager, rel=1e-5) and abs(tanh_loss - relu_loss) > 1e-3


# ============================================================================ Hugging Face GPT-2
def tiny_gpt2(attn_implementation):
    transformers = pytest.importorskip("transformers")
    from orttrainer.run import hf_models as models

    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0, attn_implementation=attn_implementation,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = models.model_class("gpt2")(config)
    assert model.config._attn_implementation == attn_implementation
    return model, models.model_desc("gpt2", config)


def gpt2_batch():
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return ids, ids


def test_gpt2_eager_and_sdpa_attention_get_their_own_entries(tmp_path):
    keys = []
    for implementation in ("eager", "sdpa"):
        model, desc = tiny_gpt2(implementation)
        trainer, loss, eager = first_loss_and_eager(model, tmp_path, desc=desc, batch=gpt2_batch(), loss_fn=None)
        assert trainer._build.source == "export" and loss == pytest.approx(eager, rel=1e-5)
        keys.append(cache_key(trainer))
    model, desc = tiny_gpt2("sdpa")
    again = ORTTrainer(model, desc, optim.SGDConfig(lr=0.0), options=options(tmp_path))
    assert keys[0] != keys[1] and cache_key(again) == keys[1]  # the same config: the same key


def test_changed_library_version_re_exports(tmp_path, monkeypatch):
    """A model class from an installed package (transformers): its version is part of the key."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(Conv1D(16, 6), torch.nn.ReLU(), Conv1D(4, 16))

    first, _, _ = first_loss_and_eager(model(), tmp_path)
    key = cache_key(first)
    real = importlib.metadata.version

    def fake(name):
        return "999.0.fake" if name == "transformers" else real(name)

    with monkeypatch.context() as patch:
        patch.setattr(importlib.metadata, "version", fake)
        upgraded, loss, eager = first_loss_and_eager(model(), tmp_path)
        assert cache_key(upgraded) != key
    assert transformers.__version__ != "999.0.fake"
    assert first._build.source == "export" and upgraded._build.source == "export"
    assert loss == pytest.approx(eager, rel=1e-5)
    again, _, _ = first_loss_and_eager(model(), tmp_path)  # the real version: the first entry again
    assert again._build.source == "export cache"


# ============================================================================ verification of a hit
class Scaled(MLP):
    scale = 1.0

    def forward(self, x):
        return super().forward(x) * self.scale


def test_stale_entry_is_caught_by_verification_and_rebuilt(tmp_path, caplog):
    """An entry whose key matches but whose graph computes something else (what the key cannot see):
    the hit's check against eager finds it, deletes the entry, re-exports and warns once."""
    torch.manual_seed(0)
    honest, _, _ = first_loss_and_eager(Scaled(), tmp_path)
    entry = honest._graphs.cache.path(honest._build.signature)
    # The graphs of another function (scale 3, in a folder of its own) under this key.
    torch.manual_seed(0)
    other = Scaled()
    other.scale = 3.0
    tampered, _, _ = first_loss_and_eager(other, tmp_path / "other")
    other_entry = tampered._graphs.cache.path(tampered._build.signature)
    swap_graphs(entry, other_entry)

    torch.manual_seed(0)
    model = Scaled()
    model.train()
    rng = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="orttrainer"):
        trainer, loss, eager = first_loss_and_eager(model, tmp_path)
        assert trainer._build.source == "export"  # rebuilt after the failed check
        assert loss == pytest.approx(eager, rel=1e-5)
        losses = [trainer.train_step(*mlp_batch())[0].item() for _ in range(2)]
    warnings = stale_warnings(caplog)
    assert len(warnings) == 1 and str(entry) in warnings[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert "max diff" in warnings[0].getMessage()
    assert model.training and all(m.training for m in model.modules())  # the check left the mode alone
    assert torch.equal(torch.get_rng_state(), rng)  # ... and the caller's RNG
    caplog.clear()
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="orttrainer"):
        healed, healed_loss, _ = first_loss_and_eager(Scaled(), tmp_path)  # the rewritten entry is right
        assert healed._build.source == "export cache" and healed_loss == pytest.approx(loss, rel=1e-6)
        assert [healed.train_step(*mlp_batch())[0].item() for _ in range(2)] == pytest.approx(losses, rel=1e-6)
    assert not caplog.records


class DropoutMLP(MLP):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_verified_hit_leaves_rng_and_mode_alone(tmp_path):
    torch.manual_seed(0)
    first_loss_and_eager(DropoutMLP(), tmp_path)
    torch.manual_seed(0)
    model = DropoutMLP()
    rng = torch.get_rng_state()
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.0), loss_fn=cross_entropy,
                         options=options(tmp_path))
    trainer.train_step(*mlp_batch())
    assert trainer._build.source == "export cache" and trainer.startup_seconds["export_cache_verify"] > 0
    assert torch.equal(torch.get_rng_state(), rng) and all(m.training for m in model.modules())


def test_verified_hit_runs_torch_before_onnxruntime(tmp_path, monkeypatch):
    """The eager forward's transient (torch's heap) must be gone before the eval run grows onnxruntime's
    arena, which keeps it: in the other order a warm cache raised the process peak 40% above the
    training steps' (docs/notes/recompute.md)."""
    import onnxruntime as ort

    torch.manual_seed(0)
    first_loss_and_eager(MLP(), tmp_path)
    torch.manual_seed(0)
    model, events = MLP(), []
    run, functional_call = ort.InferenceSession.run_with_iobinding, torch.func.functional_call

    def recorded_run(session, binding, run_options=None):
        events.append(f"onnxruntime {'train' if run_options.training_mode else 'eval'}")
        return run(session, binding, run_options)

    def recorded_call(*args, **kwargs):  # the verification's eager forward
        events.append("torch forward")
        return functional_call(*args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", recorded_run)
    monkeypatch.setattr(torch.func, "functional_call", recorded_call)
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.0), loss_fn=cross_entropy,
                         options=options(tmp_path))
    trainer.train_step(*mlp_batch())
    assert trainer._build.source == "export cache" and trainer._build.verified
    assert events == ["torch forward", "onnxruntime eval", "onnxruntime train"]


# ============================================================================ size bound
def entries(folder):
    return {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}


def entry_bytes(folder):
    return sum(f.stat().st_size for f in folder.iterdir())


def test_least_recently_used_entries_are_evicted_beyond_the_bound(tmp_path):
    def trainer(hidden, bound):
        torch.manual_seed(0)
        t = ORTTrainer(MLP(hidden=hidden), copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.0), loss_fn=cross_entropy,
                       options=options(tmp_path, export_cache_max_bytes=bound))
        t.train_step(*mlp_batch())
        return t, t._graphs.cache.path(t._build.signature)

    roomy = 1 << 30
    _, small = trainer(8, roomy)
    _, medium = trainer(16, roomy)
    assert entries(tmp_path) == {small.name, medium.name}
    two = entry_bytes(small) + entry_bytes(medium)

    hit, _ = trainer(8, roomy)  # a hit makes `small` the most recently used
    assert hit._build.source == "export cache"
    _, large = trainer(32, two + entry_bytes(small) // 2)  # room for `large` and one of the others
    assert entries(tmp_path) == {small.name, large.name}  # the least recently used one went

    _, huge = trainer(64, 1)  # a bound smaller than one entry keeps just the entry written
    assert entries(tmp_path) == {huge.name}


# ============================================================================ concurrent processes
RACER = """
import json, logging, os, sys, time
from orttrainer.engine.export.cache import ExportCache

role, root, ready = sys.argv[1], sys.argv[2], sys.argv[3]
warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("orttrainer").addHandler(handler)
cache = ExportCache(root, "fingerprint", lambda name: None)
key = cache._key("graphs", "the same signature")
open(os.path.join(ready, role), "w").close()
deadline = time.time() + 60
while len(os.listdir(ready)) < 2 and time.time() < deadline:  # both imported: race from here
    time.sleep(0.01)
stats = {"hits": 0, "writes": 0, "torn": 0}
end = time.time() + 2
i = 0
while time.time() < end:
    i += 1
    payload = f"ent:{role}-{i}:".encode() * (1000 + 997 * (i % 50))  # up to 1 MB: long writes
    cache._write(key, {"a": payload, "b": payload})
    stats["writes"] += 1
    for _ in range(3):
        files = cache._read(key)
        if files is not None:
            stats["hits"] += 1
            stats["torn"] += files["a"] != files["b"] or files["a"][:4] != b"ent:"
print(json.dumps(dict(stats, warnings=warnings)))
"""


@pytest.mark.multiprocess
def test_two_processes_writing_and_reading_one_entry_never_see_half_of_it(tmp_path):
    """Two real processes store the same key at once, each reading it between its writes (while the
    other replaces it): every read is a whole entry or a miss, never a mix or a 'corrupt' warning."""
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    root, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    roles = ("one", "two")
    procs = [subprocess.Popen([sys.executable, str(script), role, str(root), str(ready)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, text=True) for role in roles]
    results = {}
    try:
        for role, proc in zip(roles, procs):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            results[role] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            proc.kill()
    for result in results.values():
        assert result["writes"] > 5 and result["hits"] > 0 and result["torn"] == 0, results
        assert not result["warnings"], results
    assert entries(root) == {export_cache.digest([export_cache.FORMAT, "fingerprint", "graphs",
                                                  "the same signature"])}
    assert not list(root.glob(".tmp-*"))  # every staging and trash folder was cleaned up


def swap_graphs(entry, other_entry):
    """Put the graphs of `other_entry` into `entry`, with checksums that match: the key fits, the graph is wrong."""
    manifest = json.loads((entry / "manifest.json").read_text())
    for name in ("forward.onnx", "training.onnx"):
        data = (other_entry / name).read_bytes()
        (entry / name).write_bytes(data)
        manifest["files"][name] = hashlib.sha256(data).hexdigest()
    (entry / "manifest.json").write_text(json.dumps(manifest))


def test_stale_entry_of_a_later_size_is_caught_and_training_goes_on(tmp_path, caplog):
    """A cache hit for a second baked sequence length is checked too (eager forward with the weights
    trained so far); the failed one is re-exported and training continues from the same state."""
    from helpers.models import ATTENTION_DESC, Attention, attention_batch as batch

    class ScaledAttention(Attention):
        scale = 1.0

        def forward(self, ids):
            return super().forward(ids) * self.scale

    def attention(folder, scale=1.0, cache=True):
        torch.manual_seed(0)
        model = ScaledAttention()
        model.scale = scale
        return ORTTrainer(model, copy.deepcopy(ATTENTION_DESC), optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy,
                          options=options(folder, export_cache=cache))

    def steps(trainer):
        losses = [trainer.train_step(*batch(20, 0))[0].item()]
        losses.append(trainer.train_step(*batch(11, 1))[0].item())
        cache = trainer._graphs.cache
        return losses, cache and cache.path(trainer._build.signature)

    _, short = steps(attention(tmp_path))
    _, other_short = steps(attention(tmp_path / "other", scale=3.0))
    swap_graphs(short, other_short)

    with caplog.at_level(logging.WARNING, logger="orttrainer"):
        trainer = attention(tmp_path)
        losses, _ = steps(trainer)
    assert trainer._graphs.builds and trainer._build.source == "export"
    warnings = stale_warnings(caplog)
    assert len(warnings) == 1 and str(short) in warnings[0].getMessage()
    reference, _ = steps(attention(tmp_path, cache=False))
    assert losses == pytest.approx(reference, rel=1e-5)  # the stale graph trained nothing


# ============================================================================ two ranks
def retune_constant(entry, old, new):
    """Change every scalar constant `old` of the entry's graphs to `new` (checksums rewritten): the key
    still fits, the graphs compute another function. Returns how many were changed."""
    import onnx
    from onnx import numpy_helper

    changed = 0
    manifest = json.loads((entry / "manifest.json").read_text())
    for name in ("forward.onnx", "training.onnx"):
        model = onnx.load_from_string((entry / name).read_bytes())
        tensors = list(model.graph.initializer)
        tensors += [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
        for tensor in tensors:
            if int(np.prod(tensor.dims)) != 1 or tensor.data_location == onnx.TensorProto.EXTERNAL:
                continue  # not a scalar (model tensors are data-less stubs here)
            value = numpy_helper.to_array(tensor)
            if value.size == 1 and value.dtype.kind == "f" and value.item() == old:
                tensor.CopyFrom(numpy_helper.from_array(value.astype(value.dtype) * 0 + new, tensor.name))
                changed += 1
        data = model.SerializeToString()
        (entry / name).write_bytes(data)
        manifest["files"][name] = hashlib.sha256(data).hexdigest()
    (entry / "manifest.json").write_text(json.dumps(manifest))
    return changed


def _cache_rank(rank, port, cache_dir, out_dir):
    """One rank: train with the cache, (rank 1) retune its entry, train again from the cache."""
    import torch.distributed as dist
    from helpers.distributed_worker import batch, rank_slice

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("orttrainer").addHandler(handler)
    result = {}
    try:
        runs = []
        for attempt in range(2):
            torch.manual_seed(17 * rank)  # different initial weights per rank: rank 0's are broadcast
            model = Scaled()
            model.scale = 2.0
            trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy,
                                 options=ORTTrainerOptions({"device": {"id": "cpu"},
                                                            "utils": {"export_cache_dir": cache_dir},
                                                            "distributed": {"world_rank": rank, "world_size": 2}}))
            losses = [trainer.train_step(*rank_slice(batch(step, 0), rank, 2))[0].item() for step in range(3)]
            runs.append({"losses": losses, "source": trainer._build.source})
            if attempt == 0 and rank == 1:
                result["retuned"] = retune_constant(trainer._graphs.cache.path(trainer._build.signature), 2.0, 5.0)
            dist.barrier()
        result["runs"] = runs
        result["warnings"] = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    except Exception as exc:  # reported to the test through the file
        import traceback
        result["error"] = f"{exc}\n{traceback.format_exc()}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
def test_a_stale_entry_on_one_rank_rebuilds_on_both(tmp_path):
    """2 gloo ranks in real processes: rank 1's entry is retuned; both ranks' first hit is checked,
    the verdict is all-reduced, both rebuild (rank 0's weights broadcast again) and train as before."""
    import torch.multiprocessing as mp
    from helpers.distributed_worker import free_port

    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_cache_rank, args=(rank, port, str(tmp_path / "cache"), str(tmp_path)))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(240)
            assert not proc.is_alive(), "ranks still running after 240 s"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result['error']}"
        first, second = result["runs"]
        assert first["source"] == "export" and second["source"] == "export"  # rebuilt, on both ranks
        assert second["losses"] == pytest.approx(first["losses"], rel=1e-6)
        assert len(result["warnings"]) == 1 and STALE in result["warnings"][0], result["warnings"]
    assert results[1]["retuned"] > 0
    assert "max diff" in results[1]["warnings"][0] and "another rank's entry" in results[0]["warnings"][0]
