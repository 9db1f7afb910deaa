"""Python API misuse that used to train wrongly or end in a raw onnxruntime error: each is a ValueError
naming the output or input, what it holds and what was expected (orttrainer/engine/runtime/input_checks.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from orttrainer import ORTTrainer, optim


def mlp_trainer(make_mlp, desc, cpu_options, loss_fn=lambda out, y: F.cross_entropy(out, y)):
    return ORTTrainer(make_mlp(), desc, optim.SGDConfig(lr=0.1), loss_fn=loss_fn, options=cpu_options())


def test_a_per_example_loss_is_refused(make_mlp, mlp_desc, cpu_options, make_batch):
    trainer = mlp_trainer(make_mlp, mlp_desc, cpu_options, lambda out, y: F.cross_entropy(out, y, reduction="none"))
    with pytest.raises(ValueError, match=r"Output 'loss' \(the loss\) from loss_fn has shape \[8\]; a loss must "
                                         r"be one number"):
        trainer.train_step(*make_batch())


def test_output_shapes_are_checked_against_model_desc(make_mlp, mlp_desc, cpu_options, make_batch):
    desc = copy.deepcopy(mlp_desc)
    desc["outputs"][1] = ("logits", ["batch", 5])
    with pytest.raises(ValueError, match=r"Output 'logits' from the model has size 4 on axis 1 .* fixes it to 5"):
        mlp_trainer(make_mlp, desc, cpu_options).train_step(*make_batch())
    desc["outputs"][1] = ("logits", ["batch"])
    with pytest.raises(ValueError, match=r"Output 'logits' from the model has shape \[8, 4\] \(2 dims\)"):
        mlp_trainer(make_mlp, desc, cpu_options).train_step(*make_batch())


@pytest.mark.parametrize("label", [-3, 4, 9])
def test_labels_out_of_range_name_the_input(make_mlp, mlp_desc, cpu_options, make_batch, label):
    trainer = mlp_trainer(make_mlp, mlp_desc, cpu_options)
    x, y = make_batch()
    trainer.train_step(x, y)  # the first step exports with good labels; torch would catch bad ones there
    with pytest.raises(ValueError, match=rf"Input 'y' holds {label}; it is a class label of the loss, so its "
                                         r"values must be in \[0, 4\) \(or -100, which the loss ignores\)"):
        trainer.train_step(x, torch.full_like(y, label))
    trainer.train_step(x, torch.full_like(y, -100))  # ignore_index stays allowed


class Embedder(torch.nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.table = torch.nn.Embedding(rows, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids, label):
        return F.cross_entropy(self.head(self.table(ids)).mean(1), label)


@pytest.mark.parametrize("rows", [10, 100])  # 10: rewritten as a one-hot product, 100: Gather
@pytest.mark.parametrize("bad", [-1, "rows"])
def test_token_ids_past_the_table_name_the_input(cpu_options, rows, bad):
    desc = {"inputs": [("ids", ["batch", 5]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    torch.manual_seed(0)
    trainer = ORTTrainer(Embedder(rows), desc, optim.SGDConfig(lr=0.1), options=cpu_options())
    ids, label = torch.randint(0, rows, (4, 5)), torch.randint(0, 3, (4,))
    trainer.train_step(ids, label)
    ids[1, 2] = rows if bad == "rows" else bad
    expected = rf"Input 'ids' holds {ids[1, 2].item()}; it is a row index of weight 'table.weight', so its values " \
               rf"must be in \[0, {rows}\)"
    with pytest.raises(ValueError, match=expected):
        trainer.train_step(ids, label)
    with pytest.raises(ValueError, match=expected):
        trainer.eval_step(ids, label)


def test_a_step_that_fails_to_run_is_not_counted(make_mlp, mlp_desc, cpu_options, make_batch, monkeypatch):
    """StepAccounting counts a step only once the session has run it: a failed run leaves the step
    counters (and so the accumulation window) where they were, and training goes on as without it."""
    def make():
        options = cpu_options({"batch": {"gradient_accumulation_steps": 2}})
        return ORTTrainer(make_mlp(), copy.deepcopy(mlp_desc), optim.SGDConfig(lr=0.1),
                          loss_fn=lambda out, y: F.cross_entropy(out, y), options=options)

    failing, reference = make(), make()
    batches = [make_batch(seed=i) for i in range(5)]
    failing.train_step(*batches[0])
    reference.train_step(*batches[0])

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(failing._training_session.runtime, "train", broken)
    with pytest.raises(RuntimeError, match="failed to run the train step: injected"):
        failing.train_step(*batches[1])
    info = failing._train_step_info
    assert (info.step, info.optimization_step) == (1, 0)
    monkeypatch.undo()
    for batch in batches[1:]:
        torch.testing.assert_close(failing.train_step(*batch)[0], reference.train_step(*batch)[0], rtol=1e-6, atol=0)
    assert (info.step, info.optimization_step) == (5, 2)


class WideHead(torch.nn.Module):
    """A 64 x 40 head (2560 elements: above the size whose values shape inference is not given)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 40)

    def forward(self, x, label):
        return F.cross_entropy(self.head(torch.relu(self.body(x))), label)


def test_label_range_is_inferred_without_the_weight_values(cpu_options, monkeypatch):
    """The class count comes from shape inference over a model whose large initializers are data-less
    (issue 20: the full model made the first step's memory peak); it must still be found (40 here)."""
    import onnx

    given = []
    infer = onnx.shape_inference.infer_shapes

    def recording(model, *args, **kwargs):
        given.append({i.name: len(i.raw_data) + 4 * len(i.float_data) for i in model.graph.initializer})
        return infer(model, *args, **kwargs)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", recording)
    desc = {"inputs": [("x", ["batch", 64]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    torch.manual_seed(0)
    trainer = ORTTrainer(WideHead(), desc, optim.SGDConfig(lr=0.1), options=cpu_options())
    x, label = torch.randn(4, 64), torch.randint(0, 40, (4,))
    trainer.train_step(x, label)
    with pytest.raises(ValueError, match=r"Input 'label' holds 40; it is a class label of the loss, so its values "
                                         r"must be in \[0, 40\)"):
        trainer.train_step(x, torch.full_like(label, 40))
    weights = {"body.weight", "head.weight"}
    checked = [sizes for sizes in given if weights <= set(sizes)]
    assert checked, "shape inference never saw the forward model"
    assert all(sizes[w] == 0 for sizes in checked for w in weights), checked
