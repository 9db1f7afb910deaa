"""The graph life cycle (engine/runtime/lifecycle.py): re-export on baked sizes with one shared state, the export
cache on disk, the legacy `_training_session` getters, failed debug saves, deterministic compute."""

import copy
import logging
from unittest import mock

import numpy as np
import pytest
import torch
from helpers.models import ATTENTION_DESC, GPT_DESC, MLP, MLP_DESC, Attention, TinyGPT, cross_entropy
from helpers.models import attention_batch as batch
from helpers.training import cache_key
from helpers import training

from orttrainer import optim
from orttrainer._trainer.factory import GraphFactory
from orttrainer.engine.export import baked_sizes


def attention_trainer(gas=1, **extra):
    """No export cache unless `extra` sets utils: what these tests learn must come from their own exports."""
    extra.setdefault("utils", {"export_cache": False})
    torch.manual_seed(0)
    model = Attention()
    reference = copy.deepcopy(model)
    trainer = training.make_trainer(model, ATTENTION_DESC, optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy,
                                    batch={"gradient_accumulation_steps": gas}, **extra)
    return trainer, reference


# ============================================================================ baked sizes, sessions
def test_multihead_attention_trains_like_eager_across_sequence_lengths(caplog):
    trainer, reference = attention_trainer()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    shapes = [(20, 3), (33, 3), (20, 2), (7, 4)]  # (sequence length, batch size)
    losses, eager = [], []
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        for step, (seq, size) in enumerate(shapes):
            ids, labels = batch(seq, step, size)
            losses.append(trainer.train_step(ids, labels)[0].item())
            if step == 0:
                first_session = trainer._training_session.runtime
            torch_optimizer.zero_grad()
            loss = cross_entropy(reference(ids), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # AdamConfig's max_norm_clip
            torch_optimizer.step()
            eager.append(loss.item())
            if step == 2:  # back at 20 (another batch size, which stays symbolic): the first session
                assert trainer._training_session.runtime is first_session
    np.testing.assert_allclose(losses, eager, rtol=1e-4)
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)

    graphs = trainer._graphs
    assert graphs.baked == {"seq"}  # MHA reshapes to (seq, batch * heads, head_dim): batch stays symbolic
    assert graphs.known == {"seq": True, "batch": False}
    assert len(graphs.builds) == 3  # 20, 33, 7: the return to 20 reused its session
    for seconds in graphs.builds:
        assert {"export", "training_graph", "session"} <= set(seconds) and seconds["session"] > 0
    assert "baked_size_detection" not in graphs.builds[0]  # the first export is not compared with anything
    assert "baked_size_detection" in graphs.builds[1]
    assert sum("graph built for" in r.getMessage() for r in caplog.records) == 3
    states = {id(b.runtime.state) for b in graphs._sessions.values()}
    assert len(states) == 1  # every session reads and writes the same tensors


def test_eval_step_at_a_new_length_changes_no_state():
    trainer, _ = attention_trainer()
    trainer.train_step(*batch(20, 0))
    before = trainer._training_session.get_state()
    trainer.eval_step(*batch(9, 1))
    after = trainer._training_session.get_state()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert len(trainer._graphs.builds) == 2


def test_transition_inside_an_accumulation_window_keeps_the_gradients():
    trainer, reference = attention_trainer(gas=2)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    windows = [[20, 33], [7, 20]]
    for w, window in enumerate(windows):
        torch_optimizer.zero_grad()
        for i, seq in enumerate(window):
            ids, labels = batch(seq, 10 * w + i)
            trainer.train_step(ids, labels)
            (cross_entropy(reference(ids), labels) / len(window)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch_optimizer.step()
    assert trainer._train_step_info.optimization_step == 2
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_graph_without_baked_sizes_serves_every_size_with_one_session():
    trainer = training.make_trainer(TinyGPT, GPT_DESC, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy, seed=0)
    for seq, size in [(12, 4), (7, 2), (20, 5)]:
        ids = torch.randint(0, 50, (size, seq))
        trainer.train_step(ids, ids)
    assert trainer._graphs.known == {"batch": False, "seq": False}
    assert len(trainer._graphs.builds) == 1


def test_baked_sizes_are_explained_by_the_differing_constants():
    """Unit: a constant that is seq in one trace and the changed seq in the other names seq; batch ×
    a factor names batch; an unexplainable difference names every symbol."""
    import onnx
    from onnx import helper

    def graph(values):
        nodes = [helper.make_node("Constant", [], [f"c{i}"], value=helper.make_tensor(f"t{i}", onnx.TensorProto.INT64,
                                                                                    [len(v)], v))
                 for i, v in enumerate(values)]
        return helper.make_model(helper.make_graph(nodes, "g", [], []))

    sizes, changed = {"batch": 4, "seq": 20}, {"batch": 3, "seq": 18}
    same = graph([[7, 20]])
    assert baked_sizes.baked_symbols(same, graph([[7, 20]]), sizes, changed) == frozenset()
    assert baked_sizes.baked_symbols(same, graph([[7, 18]]), sizes, changed) == {"seq"}
    assert baked_sizes.baked_symbols(graph([[8, 1]]), graph([[6, 1]]), sizes, changed) == {"batch"}
    assert baked_sizes.baked_symbols(graph([[80]]), graph([[54]]), sizes, changed) == {"batch", "seq"}
    assert baked_sizes.baked_symbols(same, graph([[5, 20]]), sizes, changed) == {"batch", "seq"}  # 7 -> 5: ?


# ============================================================================ export cache
def no_export():
    """Any export inside this block fails the test (the trainer's GraphFactory exports)."""
    return mock.patch.object(GraphFactory, "export", side_effect=AssertionError("exported"))


def mlp_trainer(cache_dir, seed=0, **extra):
    return training.make_trainer(MLP, MLP_DESC, optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy, seed=seed,
                                 utils={"export_cache_dir": str(cache_dir), **extra})


def mlp_batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def train(trainer):
    return training.train(trainer, mlp_batches())


def test_warm_export_cache_skips_export_and_takes_the_weights_from_the_model(tmp_path):
    cold = mlp_trainer(tmp_path, seed=0)
    train(cold)
    assert cold._build.source == "export" and cold.startup_seconds["export"] > 0
    assert any(p.is_dir() for p in tmp_path.iterdir())

    warm = mlp_trainer(tmp_path, seed=1)  # other initial weights, same code and shapes
    with no_export():  # (a patched module would change the key)
        warm_losses = train(warm)
    assert warm._build.source == "export cache"
    assert warm.startup_seconds["export"] == 0.0 and warm.startup_seconds["training_graph"] == 0.0
    assert warm.startup_seconds["export_cache_load"] > 0
    uncached = mlp_trainer(tmp_path, seed=1, export_cache=False)
    assert uncached._graphs is None or uncached._graphs.cache is None
    assert warm_losses == train(uncached)  # bitwise: the same graph, the model's own weights
    assert uncached._graphs.cache is None


@pytest.mark.parametrize("share", [True, False], ids=["parameters-shared", "parameters-copied"])
def test_graphs_from_the_cache_read_the_weights_from_the_module_without_aliasing_a_copy(tmp_path, share):
    """A cache hit takes the initial weights from the module as views: shared, the module's parameters
    are the trained buffers; copied, the trainer's state is its own and the module keeps its values."""
    train(mlp_trainer(tmp_path, seed=0))  # fills the cache
    warm = mlp_trainer(tmp_path, seed=1)
    warm._share_module_parameters = share
    initial = {n: p.detach().clone() for n, p in warm._torch_model.named_parameters()}
    with no_export():
        losses = train(warm)
    assert warm._build.source == "export cache"
    uncached = mlp_trainer(tmp_path, seed=1, export_cache=False)
    assert losses == train(uncached)  # bitwise
    trained = warm.state_dict(pytorch_format=True)
    assert bool(warm._training_session.state.adopted) == share
    for name, p in warm._torch_model.named_parameters():
        expected = trained[name] if share else initial[name]
        assert torch.equal(p.detach(), torch.as_tensor(expected)), name
    assert not all(torch.equal(initial[n], torch.as_tensor(trained[n])) for n in initial)  # it trained


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_corrupt_cache_entry_is_rebuilt(tmp_path, damage, caplog):
    reference = train(mlp_trainer(tmp_path))
    entries = [p for p in tmp_path.iterdir() if (p / "training.onnx").exists()]
    assert len(entries) == 1
    target = entries[0] / ("manifest.json" if damage == "manifest" else "training.onnx")
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="orttrainer"):
        trainer = mlp_trainer(tmp_path)
        assert train(trainer) == reference
    assert trainer._build.source == "export" and trainer.startup_seconds["export"] > 0
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    rebuilt = mlp_trainer(tmp_path)  # the rewritten entry is whole again
    train(rebuilt)
    assert rebuilt._build.source == "export cache"


def test_every_training_spec_field_is_in_the_key(tmp_path):
    """The key digests the whole TrainingSpec (no hand-kept list): changing any one field changes it,
    and changing only the learning rate does not."""
    import dataclasses

    trainer = mlp_trainer(tmp_path)
    spec, model = trainer._training_spec(), trainer._torch_model
    base = spec.fingerprint(model)
    others = {bool: lambda v: not v, int: lambda v: v + 1, tuple: lambda v: v + (("extra", ()),),
              type(None): lambda v: 2, torch.dtype: lambda v: torch.float16}
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name == "optim_config":
            other = optim.AdamConfig(lr=value.lr, alpha=0.5)
        elif field.name == "recompute":
            other = dataclasses.replace(value, attn_dropout=not value.attn_dropout)
        elif field.name == "dims":  # the parallel layout: ZeRO-1 partitions the optimizer graph
            other = dataclasses.replace(value, zero_stage=value.zero_stage + 1)
        elif field.name == "kernels":  # products on torch's bf16 kernels, for another host
            other = dataclasses.replace(value, compute="bfloat16", host="another host")
        elif callable(value):
            other = lambda logits, label: cross_entropy(logits, label) * 2  # noqa: E731
        else:
            other = others[type(value)](value)
        changed = dataclasses.replace(spec, **{field.name: other})
        assert changed.fingerprint(model) != base, field.name
    relearned = dataclasses.replace(spec, optim_config=optim.AdamConfig(lr=0.5))
    assert relearned.fingerprint(model) == base  # the learning rate is fed, not built in


def test_what_changes_the_graph_changes_the_key(tmp_path):
    base = cache_key(mlp_trainer(tmp_path))
    from orttrainer.engine.graph import training_graph
    with mock.patch.object(training_graph, "small_embedding_as_matmul", lambda model, shapes: None):
        assert cache_key(mlp_trainer(tmp_path)) != base  # a patched rewrite (tests, ablations)
    assert cache_key(mlp_trainer(tmp_path, seed=5)) == base  # weights are not part of it
    wider = training.make_trainer(lambda: MLP(hidden=32), MLP_DESC, optim.AdamConfig(lr=1e-2),
                                  loss_fn=cross_entropy, seed=0, utils={"export_cache_dir": str(tmp_path)})
    assert cache_key(wider) != base
    clipped = mlp_trainer(tmp_path, grad_norm_clip=False)
    assert cache_key(clipped) != base

    def scaled_loss(scale):
        return lambda logits, label: cross_entropy(logits, label) * scale

    keys = {cache_key(training.make_trainer(MLP, MLP_DESC, optim.AdamConfig(lr=1e-2), loss_fn=scaled_loss(s)))
            for s in (1.0, 2.0)}
    assert len(keys) == 2  # the closure's value is part of the loss function's code
    other_lr = training.make_trainer(MLP, MLP_DESC, optim.AdamConfig(lr=0.5), loss_fn=cross_entropy,
                                     utils={"export_cache_dir": str(tmp_path)})
    assert cache_key(other_lr) == base  # the learning rate is fed, not built in


def test_baked_sizes_are_learned_from_a_cached_graph_and_kept_in_the_cache(tmp_path):
    first, _ = attention_trainer(utils={"export_cache_dir": str(tmp_path)})
    first.train_step(*batch(20, 0))
    second, _ = attention_trainer(utils={"export_cache_dir": str(tmp_path)})
    with no_export():
        second.train_step(*batch(20, 0))
    assert second._build.source == "export cache" and second._graphs.known == {}
    second._graphs._export = second._factory.export  # the lifecycle took the patched one
    second.train_step(*batch(11, 1))  # compared with an export at 20 (none was kept: the graph was cached)
    assert second._build.source == "export" and second._graphs.known == {"seq": True}
    third, _ = attention_trainer(utils={"export_cache_dir": str(tmp_path)})
    third.train_step(*batch(20, 0))
    assert third._graphs.known == {"seq": True}


# ============================================================================ legacy session getters
@pytest.mark.parametrize("name", ["adam", "lamb", "sgd"])
def test_training_session_getters_return_the_legacy_layouts(name):
    config = {"adam": optim.AdamConfig(lr=1e-2), "lamb": optim.LambConfig(lr=1e-2), "sgd": optim.SGDConfig(lr=0.1)}
    trainer = training.make_trainer(MLP, MLP_DESC, config[name], loss_fn=cross_entropy, seed=0)
    train(trainer)
    session = trainer._training_session
    weights = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}

    model_state = session.get_model_state(include_mixed_precision_weights=False)
    assert set(model_state) == {"full_precision"} and set(model_state["full_precision"]) == weights
    expected = set(weights)
    if name != "sgd":
        expected |= {f"Moment_{i}_{w}" for i in (1, 2) for w in weights}
    if name == "adam":
        expected |= {f"Update_Count_{w}" for w in weights}
    if name == "lamb":
        expected |= {"Step"}
    state = session.get_state()
    assert set(state) == expected
    optimizer = session.get_optimizer_state()
    if name == "adam":
        assert set(optimizer) == weights
        assert all(set(v) == {"Moment_1", "Moment_2", "Update_Count"} for v in optimizer.values())
        assert optimizer["fc1.weight"]["Update_Count"].tolist() == [5]  # 4 updates, 1-based
    elif name == "lamb":
        assert set(optimizer) == weights | {"shared_optimizer_state"}
        assert optimizer["shared_optimizer_state"]["Step"].tolist() == [5]
    else:
        assert optimizer == {}
    assert session.get_partition_info_map() == {}
    for w in weights:
        np.testing.assert_array_equal(state[w], model_state["full_precision"][w])
        np.testing.assert_array_equal(state[w], trainer.state_dict()["model"]["full_precision"][w])

    # load_state writes get_state's layout back; checks come first.
    changed = {w: np.full_like(state[w], 0.5) for w in weights}
    session.load_state(changed)
    assert all((session.get_state()[w] == 0.5).all() for w in weights)
    with pytest.raises(RuntimeError, match="Unexpected state names"):
        session.load_state({"fc1.weight": state["fc1.weight"], "nope": state["fc1.bias"]}, strict=True)
    with pytest.raises(ValueError, match="fc2.bias"):
        session.load_state({"fc1.weight": state["fc1.weight"], "fc2.bias": np.zeros(7, np.float32)})
    assert (session.get_state()["fc1.weight"] == 0.5).all()  # a rejected load changed nothing


def test_zero1_partition_info_map():
    trainer = training.make_trainer(MLP, MLP_DESC, optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy, seed=0,
                                    distributed={"deepspeed_zero_optimization": {"stage": 1}})
    train(trainer)
    info = trainer._training_session.get_partition_info_map()
    assert set(info) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert info["fc1.weight"]["original_dim"] == [16, 6]  # lists of int, as the original's getter
    assert trainer.state_dict()["partition_info"].keys() == info.keys()


def test_state_dict_builds_from_the_session_getters():
    """As in the original (whose checkpoint tests mock these getters)."""
    trainer = training.make_trainer(MLP, MLP_DESC, optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy, seed=0)
    train(trainer)
    fake = mock.Mock()
    fake.get_model_state.return_value = {"full_precision": {"a": np.arange(5), "b": np.arange(7)}}
    fake.get_optimizer_state.return_value = {"a": {"Moment_1": np.arange(5), "Moment_2": np.arange(5)}}
    fake.get_partition_info_map.return_value = {}
    trainer._training_session = fake
    state = trainer.state_dict()
    np.testing.assert_array_equal(state["model"]["full_precision"]["a"], np.arange(5))
    np.testing.assert_array_equal(state["optimizer"]["a"]["Moment_1"], np.arange(5))
    fake.get_model_state.assert_called_with(include_mixed_precision_weights=False)
    assert torch.equal(trainer.state_dict(pytorch_format=True)["b"], torch.arange(7))


# ============================================================================ debug options
@pytest.mark.parametrize("key", ["model_after_graph_transforms_path", "model_with_gradient_graph_path",
                                 "model_with_training_graph_path",
                                 "model_with_training_graph_after_optimization_path"])
def test_unwritable_graph_save_path_warns_and_trains(tmp_path, key):
    path = str(tmp_path / "missing-folder" / "graph.onnx")
    trainer = training.make_trainer(MLP, MLP_DESC, optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy, seed=0,
                                    debug={"graph_save_paths": {key: path}})
    with pytest.warns(UserWarning, match="training continues"):
        losses = train(trainer)
    assert losses[-1] < losses[0]


def deterministic_run():
    """An embedding model big enough for the CPU GatherGrad's thread races (LAMB, tied 2000-row table)."""
    desc = {"inputs": GPT_DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", "seq", 2000])]}
    trainer = training.make_trainer(lambda: TinyGPT(vocab=2000, dim=64, max_len=40), desc,
                                    optim.LambConfig(lr=1e-2), loss_fn=cross_entropy, seed=0,
                                    debug={"deterministic_compute": True})
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 60, (8, 32), generator=g)  # few distinct ids: many repeated rows
        losses.append(trainer.train_step(ids, torch.roll(ids, -1, 1))[0])
    return torch.stack(losses), trainer._training_session.get_state()


@pytest.mark.slow
def test_deterministic_compute_runs_are_bitwise_equal():
    (losses_a, state_a), (losses_b, state_b) = deterministic_run(), deterministic_run()
    assert torch.equal(losses_a, losses_b)
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.slow
def test_deterministic_gather_grad_matches_torch():
    from test_engine_numerics import assert_same_training, make, run_reference

    model, desc, batches = make("gpt-gather")
    ref = copy.deepcopy(model)
    ref_losses = run_reference(ref, batches[:6], lambda p: torch.optim.SGD(p, lr=0.1))
    trainer = training.make_trainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy,
                                    debug={"deterministic_compute": True})
    losses = training.train(trainer, batches[:6])
    assert_same_training(ref, ref_losses, trainer, losses)
    ops = {n.op_type for n in trainer._training_session.graph.model.graph.node}
    assert "ScatterElements" in ops and "GatherGrad" not in ops


@pytest.mark.slow
def test_zero1_runtime_adopts_its_flat_buffers_across_lengths():
    """The distributed runtime's flat gradient/weight buffers are part of the shared state: a ZeRO-1
    trainer (one rank) across sequence lengths trains exactly like the plain one."""
    runs = []
    for extra in ({}, {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}}):
        trainer, _ = attention_trainer(gas=2, **extra)
        losses = training.train(trainer, (batch(seq, i) for i, seq in enumerate([20, 33, 20, 7, 7, 20])))
        runs.append((losses, trainer.state_dict(pytorch_format=True)))
    assert len(trainer._graphs.builds) == 3
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6)
    for name, value in runs[0][1].items():
        np.testing.assert_allclose(runs[1][1][name].numpy(), value.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)


class _MallInfo2(__import__("ctypes").Structure):
    _fields_ = [(n, __import__("ctypes").c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _malloc_held_mb():
    """Bytes glibc has handed out (heap in use + mmapped blocks), in MB."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def test_reference_export_does_not_keep_the_model_data_alive():
    """The lifecycle keeps a data-less copy of the first export to compare later exports with; the
    exported model's weights must be freed once the export itself is dropped."""
    import gc

    from onnx import helper, numpy_helper

    from orttrainer.engine.runtime.lifecycle import without_data

    def model():
        weight = numpy_helper.from_array(np.ones((4096, 4096), np.float32), "w")  # 64 MB
        shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape")
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [1, 4096])],
                                  [helper.make_tensor_value_info("y", 1, [1, 4096])], [weight, shape])
        return helper.make_model(graph)

    exported = model()
    gc.collect()
    before = _malloc_held_mb()
    stripped = without_data(exported, {"w"})
    del exported
    gc.collect()
    assert _malloc_held_mb() < before - 60, "the stripped copy kept the 64 MB weight alive"
    inits = {i.name: i for i in stripped.graph.initializer}
    assert list(inits["w"].dims) == [4096, 4096] and not inits["w"].raw_data and not inits["w"].float_data
    assert numpy_helper.to_array(inits["shape"]).tolist() == [2, 3]  # constants keep their values
    assert stripped.graph.node[0].op_type == "MatMul" and stripped.opset_import == model().opset_import
