"""The graph_transformer recompute options: the backward pass reads recomputed copies of forward
sub-graphs (engine/graph/recompute.py). Training must be bitwise what it is without them, and the copies must
be in the graph the session runs. (Their memory effect is measured in bench/studies/recompute_memory/recompute_memory.py.)"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.models import GPT_DESC, TinyGPT, cross_entropy
from helpers import training

from orttrainer import optim

STEPS = 10
LAYERS = 3


def batches(n=STEPS, batch=4, seq=12):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 50, (batch, seq), generator=g) for _ in range(n)]
    return [(x, torch.roll(x, -1, dims=1)) for x in ids]


def train(graph_transformer, tmp_path, name, **options):
    """10 Adam steps of a 3-layer TinyGPT with attention dropout; returns (losses, weights, the
    session's graph as it runs)."""
    path = str(tmp_path / f"{name}.onnx")
    opts = {"graph_transformer": graph_transformer,
            "debug": {"graph_save_paths": {"model_with_training_graph_after_optimization_path": path}}}
    opts.update(options)
    trainer = training.make_trainer(lambda: TinyGPT(layers=LAYERS, attn_dropout=0.1), GPT_DESC,
                                    optim.AdamConfig(lr=0.01), loss_fn=cross_entropy, seed=0, **opts)
    ort.set_seed(7)  # the dropout masks: the same draws in every run
    losses = training.train(trainer, batches())
    weights = {k: v.numpy().copy() for k, v in trainer.state_dict(pytorch_format=True).items()}
    return losses, weights, onnx.load(path).graph


def recomputed(graph):
    return [n for n in graph.node if n.name.endswith("_recompute")]


def block_of(node):
    """The block a node belongs to, by the exporter's scope in its name or its outputs' names."""
    text = " ".join([node.name, *node.output])
    return next((f"blocks.{i}" for i in range(LAYERS) if f"/blocks.{i}/" in text), None)


OPTIONS = {
    "gelu": {"gelu_recompute": True},
    "attn_dropout": {"attn_dropout_recompute": True},
    "layers": {"transformer_layer_recompute": True},
    "first_layer": {"transformer_layer_recompute": True, "number_recompute_layers": 1},
    "all": {"gelu_recompute": True, "attn_dropout_recompute": True, "transformer_layer_recompute": True},
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return train({}, tmp_path_factory.mktemp("baseline"), "baseline")


@pytest.mark.parametrize("option", list(OPTIONS))
def test_recompute_leaves_training_bitwise_unchanged(option, baseline, tmp_path):
    losses, weights, graph = train(OPTIONS[option], tmp_path, option)
    base_losses, base_weights, base_graph = baseline
    assert losses == base_losses
    assert base_losses[-1] < base_losses[0]  # it trains (with dropout active: masks drawn every step)
    for name, value in base_weights.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    assert not recomputed(base_graph)
    copies = recomputed(graph)
    ops = [n.op_type for n in copies]
    blocks = {block_of(n) for n in copies}
    if option == "gelu":
        assert ops == ["Gelu"] * LAYERS
    elif option == "attn_dropout":
        # Dropout is not re-run: its copy applies the forward's mask (DropoutGrad = x * mask / (1-p)).
        assert ops == ["DropoutGrad"] * LAYERS
    elif option == "first_layer":
        assert blocks == {"blocks.0"} and {"LayerNormalization", "Softmax", "DropoutGrad", "Gelu"} <= set(ops)
    else:  # every layer but the last (its activations are used at once)
        assert {"blocks.0", "blocks.1"} <= blocks and ops.count("Softmax") == 2
        last = sorted(n.op_type for n in copies if block_of(n) == "blocks.2")
        # ... where only the Gelu and attention-dropout options act
        assert last == (["DropoutGrad", "Gelu"] if option == "all" else [])


def test_recompute_under_gradient_accumulation_and_clipping(baseline, tmp_path):
    """Micro-steps run the same backward: accumulation with layer recompute equals accumulation without."""
    plain = train({}, tmp_path, "plain", batch={"gradient_accumulation_steps": 2})
    layers = train(OPTIONS["layers"], tmp_path, "layers", batch={"gradient_accumulation_steps": 2})
    assert plain[0] == layers[0]
    for name, value in plain[1].items():
        np.testing.assert_array_equal(layers[1][name], value, err_msg=name)
    assert recomputed(layers[2])


def test_no_layers_found_warns_and_trains(tmp_path, caplog):
    """A model without attention has no transformer layers: a warning, and training as without."""
    from helpers.models import MLP, MLP_DESC

    trainer = training.make_trainer(MLP, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy, seed=0,
                                    graph_transformer={"transformer_layer_recompute": True})
    with caplog.at_level("WARNING"):
        loss = trainer.train_step(torch.randn(8, 6), torch.randint(0, 4, (8,)))[0]
    assert torch.isfinite(loss)
    assert "found 0 transformer layer" in caplog.text


# onnxruntime's CUDA dropout fusions: (inputs of the fused node from a Dropout's [data, ratio, training_mode])
CUDA_DROPOUTS = {
    "BitmaskDropout": lambda data, ratio, mode: [data, ratio, mode],
    "BiasDropout": lambda data, ratio, mode: [data, "zero_bias", "", ratio, mode],
    "BiasSoftmaxDropout": lambda data, ratio, mode: [data, "zero_bias", ratio, mode],
}


def _optimized_training_graph(monkeypatch):
    """The graph recompute rewrites (onnxruntime's optimized training graph of a 3-layer TinyGPT with
    attention dropout) and the rewrite's other arguments, taken from one CPU train step."""
    import orttrainer.engine.graph.recompute as recompute_module

    seen = []
    real = recompute_module.apply_recompute

    def capture(model, *args):
        kept = onnx.ModelProto()
        kept.CopyFrom(model)
        seen.append((kept, args))
        return real(model, *args)

    monkeypatch.setattr(recompute_module, "apply_recompute", capture)
    trainer = training.make_trainer(lambda: TinyGPT(layers=LAYERS, attn_dropout=0.1), GPT_DESC,
                                    optim.AdamConfig(lr=0.01), loss_fn=cross_entropy, seed=0,
                                    graph_transformer=OPTIONS["all"])
    trainer.train_step(*batches(1)[0])
    assert len(seen) == 1
    return seen[0]


def test_random_nodes_are_never_recomputed(monkeypatch):
    """A synthetic graph: the optimized training graph with each forward Dropout replaced by one of the
    CUDA fusions (as a CUDA session's graph holds them). The rewrite must not copy them (a copy would
    draw a new mask): they stay single, and the copies read their stashed outputs through the gate."""
    from orttrainer.engine.graph.recompute import RecomputeOptions, apply_recompute, is_random

    model, (forward_tensors, loss, weights, _) = _optimized_training_graph(monkeypatch)
    fused = {}
    kinds = list(CUDA_DROPOUTS)
    dropouts = [n for n in model.graph.node if n.op_type == "Dropout" and n.output[0] in forward_tensors]
    assert len(dropouts) == LAYERS
    for i, node in enumerate(dropouts):
        kind = kinds[i % len(kinds)]
        inputs = CUDA_DROPOUTS[kind](*node.input)
        node.CopyFrom(onnx.helper.make_node(kind, inputs, list(node.output), name=node.name,
                                            domain="com.microsoft", seed=i))
        fused[node.output[0]] = kind
    done = apply_recompute(model, forward_tensors, loss, weights, RecomputeOptions(attn_dropout=True, gelu=True,
                                                                                    layers=0))
    nodes = model.graph.node
    assert done["layers"] == LAYERS - 1  # the layers around them are still recomputed
    for kind in kinds:  # one node each, as before the rewrite: nothing random was copied
        assert sum(n.op_type == kind for n in nodes) == 1
    copies = recomputed(model.graph)
    assert not [n for n in copies if is_random(n)]
    # the copies that need a random node's output read the stashed one, gated (Reshape to its own shape)
    producer = {o: n for n in nodes for o in n.output}
    stashed = {producer[i].input[0] for n in copies for i in n.input
               if i in producer and producer[i].op_type == "Reshape" and producer[i].input[0] in fused}
    assert stashed, "no copy reads a random node's output"
    assert is_random(onnx.helper.make_node("SomeCustomNoise", ["x"], ["y"], seed=3))
    assert not is_random(onnx.helper.make_node("Dropout", ["x"], ["y", "m"]))  # its copy reuses the mask
