"""Megatron tensor parallel (distributed.horizontal_parallel_size = 2) in real processes: 2 gloo ranks,
a free port, a timeout on every wait. The reference is one process training the uncut model on the same
batches; each rank's shards must equal the corresponding slices of its weights (cut here, in NumPy,
independently of engine/parallel/megatron.py)."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from helpers import tensor_parallel_worker as worker  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

SCENARIOS = [{"name": f"{kind}-{optim}", "kind": kind, "optim": optim}
             for kind in ("gpt2", "bert") for optim in ("adam", "lamb")]


@pytest.fixture(scope="module")
def two_ranks(tensor_parallel_launch):
    return tensor_parallel_launch  # conftest.py: one launch shared with test_tensor_parallel_checkpoint


def expected_shard(name, value, rank, h=2):
    """The slice of a one-process weight that rank `rank` of `h` holds: column-split weights by output
    features (GPT-2's c_attn as q|k|v, each cut), row-split by input features, everything else whole."""
    def cols(v, axis, stride=1):
        parts = np.split(v, stride, axis=axis)
        return np.concatenate([np.split(p, h, axis=axis)[rank] for p in parts], axis=axis)

    if ".attn.c_attn." in name:
        return cols(value, value.ndim - 1, 3)  # Conv1D weight [in, out]; bias [out]
    if ".mlp.c_fc." in name:
        return cols(value, value.ndim - 1)
    if name.endswith((".attn.c_proj.weight", ".mlp.c_proj.weight")):
        return cols(value, 0)
    columns = (".attention.self.query.", ".attention.self.key.", ".attention.self.value.", ".intermediate.dense.")
    if any(part in name for part in columns):
        return cols(value, 0)  # nn.Linear weight [out, in]; bias [out]
    if name.endswith(".output.dense.weight"):  # attention.output.dense and the MLP's output.dense
        return cols(value, 1)
    return value


def test_two_ranks_in_bf16_train_like_one_process_in_bf16(two_ranks):
    """Megatron's cut graph with every product in bf16 (its f/g PythonOps beside the TorchMatMul
    nodes): losses and gradient norms within bf16's rounding of one bf16 process. A row-parallel
    product's two halves are rounded to bf16 before they are all-reduced, where one process rounds
    their sum once: 2^-8 per product."""
    one = worker.reference("gpt2", "adam", bf16=True)
    assert one["trainer"].compute_dtype == torch.bfloat16
    for rank, result in enumerate(two_ranks):
        got = result["gpt2-adam-bf16"]
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=2.0 ** -6, err_msg=f"rank {rank} losses")
        np.testing.assert_allclose(got["norms"], one["norms"], rtol=2.0 ** -4, err_msg=f"rank {rank} norms")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_two_ranks_equal_one_process(two_ranks, scenario):
    one = worker.reference(scenario["kind"], scenario["optim"])  # shared with test_tensor_parallel_checkpoint
    reference, losses, norms = one["trainer"], one["losses"], one["norms"]
    assert len(losses) == len(norms) == worker.STEPS
    assert max(norms) > 1.0  # max_norm_clip (1.0) clips: the global norm over shards + replicas matters
    full = reference.state_dict(pytorch_format=True)
    cut = 0
    for rank, result in enumerate(two_ranks):
        got = result[scenario["name"]]
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, err_msg=f"rank {rank} losses")
        np.testing.assert_allclose(got["norms"], norms, rtol=1e-5, err_msg=f"rank {rank} gradient norms")
        assert set(got["weights"]) <= set(full)  # full adds tied names (GPT-2's lm_head.weight = wte)
        for name, shard in got["weights"].items():
            want = expected_shard(name, full[name].numpy(), rank)
            cut += want.shape != full[name].shape
            assert shard.shape == want.shape, name
            # atol: Adam turns float rounding on gradients that are 0 in exact arithmetic (GPT-2's key
            # bias: softmax ignores it) into updates of ~1e-6; the losses above hold at rtol 1e-5.
            np.testing.assert_allclose(shard, want, rtol=1e-5, atol=5e-6, err_msg=f"rank {rank} {name}")
    assert cut == 2 * 2 * (6 if scenario["kind"] == "gpt2" else 10)  # ranks x layers x cut tensors per layer


def test_heads_not_divisible_is_a_clear_error(two_ranks):
    for result in two_ranks:  # its scenario (gpt2, heads=1) is the launch's last
        raised = result["odd"]["raised"]
        assert raised and "1 attention heads are not divisible by horizontal_parallel_size=2" in raised, \
            raised


def test_world_size_must_be_data_times_horizontal():
    from orttrainer import ORTTrainerOptions

    named = r"data_parallel_size \(3\).*horizontal_parallel_size \(2\).*world_size \(4\)"
    with pytest.raises(ValueError, match=named):
        ORTTrainerOptions({"distributed": {"world_size": 4, "world_rank": 0, "data_parallel_size": 3,
                                           "horizontal_parallel_size": 2}})


def test_unmatched_model_names_the_block():
    import onnx
    from onnx import helper, numpy_helper

    from orttrainer.engine.parallel import megatron

    # A GPT-2-named block whose c_fc weight is read by a scaled Gemm (alpha=2), no plain linear: the
    # matcher must say which block.
    w1, w2 = np.ones([4, 8], np.float32), np.ones([8, 4], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "h.0.mlp.c_fc.weight"], ["a"], alpha=2.0),
         helper.make_node("MatMul", ["a", "h.0.mlp.c_proj.weight"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w1, "h.0.mlp.c_fc.weight"),
         numpy_helper.from_array(w2, "h.0.mlp.c_proj.weight")])
    model = helper.make_model(graph)
    named = r"h\.0\.mlp\.c_fc .. h\.0\.mlp\.c_proj.*not read by a plain MatMul or Gemm"
    with pytest.raises(megatron.TensorParallelError, match=named):
        megatron.cut(model, 0, 2, ["h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"])
    with pytest.raises(megatron.TensorParallelError, match="found no transformer block"):
        megatron.cut(model, 0, 2, [])


def test_reshape_sizes_divided_by_position_not_value():
    """The tests/bench GPT block (qkv -> proj, fc -> out) is matched, and with a fixed batch equal to the
    head count and a sequence equal to the width only the head count and width entries are divided:
    [4, 16, 4, 4] -> [4, 16, 2, 4] and [4, 16, 16] -> [4, 16, 8] (a cut by value would halve all)."""
    import torch
    from helpers.models import TinyGPT

    from orttrainer.engine.export import torch_export as _export
    from orttrainer.engine.parallel import megatron

    torch.manual_seed(0)
    model = TinyGPT(vocab=50, dim=16, heads=4, layers=1).eval()
    ids = torch.zeros(4, 16, dtype=torch.long)  # batch == heads, seq == width; static shapes
    exported = _export.export(model, [ids], ["input_ids"], ["logits"], {}, 17)
    trainable = [name for name, _ in model.named_parameters()]
    cuts = megatron.cut(exported, 0, 2, trainable)
    assert {"blocks.0.qkv.weight", "blocks.0.proj.weight", "blocks.0.fc.weight", "blocks.0.out.weight"} <= set(cuts)
    assert cuts["blocks.0.qkv.weight"].stride == 3
    from onnx import numpy_helper

    values = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    producer = {o: n for n in exported.graph.node for o in n.output}
    for node in exported.graph.node:
        if node.op_type == "Constant":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    def constant(name):  # a constant, a constant through Unsqueeze, or a Concat of those
        node = producer.get(name)
        if name in values:
            return values[name].reshape(-1)
        if node is not None and node.op_type in ("Unsqueeze", "Concat"):
            inputs = node.input[:1] if node.op_type == "Unsqueeze" else node.input
            return np.concatenate([constant(i) for i in inputs])
        raise AssertionError(f"{name} is not a constant (static shapes were exported)")

    shapes = [[int(v) for v in constant(n.input[1])] for n in exported.graph.node if n.op_type == "Reshape"]
    assert [4, 16, 2, 4] in shapes and [4, 16, 8] in shapes, shapes
    assert not any(s[:2] != [4, 16] for s in shapes if len(s) in (3, 4)), shapes
