"""`trainer._training_session` is the state path (docs/legacy-api.md §3.1, §3.2), through a real trainer.

state_dict() reads only the session's getters (get_model_state, get_optimizer_state,
get_partition_info_map) and load_state_dict() writes only through its load_state, so a substituted
session sees every read and write; the StateLayout maps legacy names to buffers, ZeRO-1 segments too.
"""

import numpy as np
import pytest
import torch
from helpers import training
from helpers.models import MLP, MLP_DESC, cross_entropy

from orttrainer import optim
from orttrainer.state.layout import StateLayout
from orttrainer.engine.parallel.data_parallel import FlatLayout

MLP_WEIGHTS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def make_trainer(seed=0, optimizer=optim.AdamConfig, zero=False):
    extra = {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}} if zero else {}
    return training.make_trainer(MLP, MLP_DESC, optimizer(lr=1e-2), loss_fn=cross_entropy, seed=seed, **extra)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)


def train(trainer, start, stop):
    training.train(trainer, (batch(i) for i in range(start, stop)))


class RecordingSession:
    """Stands in for trainer._training_session: the legacy getters and load_state, recorded, over
    the real session (whatever else the trainer asks goes to the real one)."""

    def __init__(self, real):
        self.real, self.calls, self.loaded = real, [], []

    def get_model_state(self, include_mixed_precision_weights=False):
        self.calls.append("get_model_state")
        return self.real.get_model_state(include_mixed_precision_weights)

    def get_optimizer_state(self):
        self.calls.append("get_optimizer_state")
        return self.real.get_optimizer_state()

    def get_partition_info_map(self):
        self.calls.append("get_partition_info_map")
        return self.real.get_partition_info_map()

    def load_state(self, state, strict=False):
        self.loaded.append({k: np.array(v, copy=True) for k, v in state.items()})
        return self.real.load_state(state, strict)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_state_dict_reads_the_substituted_session():
    trainer = make_trainer()
    train(trainer, 0, 2)
    fake = RecordingSession(trainer._training_session)
    # The substitute's values, not the buffers', must come back.
    fake.get_optimizer_state = lambda: {"fc1.bias": {"Moment_1": np.full(16, 7.0, np.float32)}}
    trainer._training_session = fake
    state = trainer.state_dict()
    assert fake.calls == ["get_model_state"]  # no partition info asked without ZeRO
    assert state["optimizer"] == {"fc1.bias": {"Moment_1": pytest.approx(np.full(16, 7.0))}}
    expected = dict(trainer._torch_model.named_parameters())
    for name in MLP_WEIGHTS:  # the torch module trains the same tensors in place: an independent reader
        np.testing.assert_array_equal(state["model"]["full_precision"][name], expected[name].detach().numpy())


def test_load_state_dict_writes_through_the_substituted_session():
    source = make_trainer(seed=1)
    train(source, 0, 3)
    saved = source.state_dict()
    target = make_trainer(seed=2)
    train(target, 0, 1)
    fake = RecordingSession(target._training_session)
    target._training_session = fake
    target.load_state_dict(saved)
    assert len(fake.loaded) == 1
    loaded = fake.loaded[0]
    expected_names = set(MLP_WEIGHTS) | {f"{m}_{w}" for w in MLP_WEIGHTS for m in ("Moment_1", "Moment_2", "Update_Count")}
    assert set(loaded) == expected_names
    for w in MLP_WEIGHTS:
        np.testing.assert_array_equal(loaded[w], saved["model"]["full_precision"][w])
        np.testing.assert_array_equal(loaded[f"Moment_2_{w}"], saved["optimizer"][w]["Moment_2"])
    # The next steps equal the source's: the load reached the buffers the session trains.
    train(source, 3, 5)
    train(target, 3, 5)
    for w in MLP_WEIGHTS:
        np.testing.assert_allclose(target.state_dict()["model"]["full_precision"][w],
                                   source.state_dict()["model"]["full_precision"][w], rtol=0, atol=0)


def test_rejected_load_never_reaches_the_session():
    trainer = make_trainer()
    train(trainer, 0, 1)
    bad = trainer.state_dict()
    bad["optimizer"]["fc2.bias"]["Moment_1"] = np.zeros(5, np.float32)  # fc2.bias has 4 elements
    fake = RecordingSession(trainer._training_session)
    trainer._training_session = fake
    before = trainer.state_dict()
    with pytest.raises(ValueError, match="Moment_1_fc2.bias"):
        trainer.load_state_dict(bad)
    assert fake.loaded == []
    after = trainer.state_dict()
    np.testing.assert_array_equal(after["model"]["full_precision"]["fc1.weight"],
                                  before["model"]["full_precision"]["fc1.weight"])


def test_zero1_partition_info_comes_from_the_session():
    trainer = make_trainer(zero=True)
    train(trainer, 0, 2)
    fake = RecordingSession(trainer._training_session)
    trainer._training_session = fake
    state = trainer.state_dict()
    assert "get_partition_info_map" in fake.calls
    shapes = {n: list(p.shape) for n, p in trainer._torch_model.named_parameters()}
    assert {w: list(i["original_dim"]) for w, i in state["partition_info"].items()} == shapes
    # One rank keeps every weight's moments as one flat segment.
    for w in MLP_WEIGHTS:
        assert state["optimizer"][w]["Moment_1"].shape == (int(np.prod(shapes[w])),)
    # ... which a trainer without ZeRO loads back into whole-weight moments.
    plain = make_trainer(seed=5)
    train(plain, 0, 1)
    plain.load_state_dict(state, strict=False)
    got = plain.state_dict()["optimizer"]
    for w in MLP_WEIGHTS:
        np.testing.assert_array_equal(got[w]["Moment_1"], state["optimizer"][w]["Moment_1"].reshape(shapes[w]))
    # An empty partition map is still reported under ZeRO (the legacy layout).
    fake.get_partition_info_map = lambda: {}
    assert trainer.state_dict()["partition_info"] == {}


def test_layout_cuts_a_whole_moment_to_this_ranks_segment():
    shapes = {"w": (4, 3), "b": (5,)}
    flat = FlatLayout(shapes, 2)
    for rank in (0, 1):
        segments = {s.weight: s for s in flat.segments(rank)}
        layout = StateLayout("AdamOptimizer", ["w", "b"], ["w", "b"] + [f"Moment_1_{w}" for w in segments],
                             segments)
        whole = np.arange(12, dtype=np.float32).reshape(4, 3)
        if "w" in segments:
            s = segments["w"]
            got = layout.own_part("w", "Moment_1_w", whole, 12, (s.size,), (0, 1), (rank, 2))
            np.testing.assert_array_equal(got, whole.reshape(-1)[s.start:s.stop])
            # The other rank's segment of w (its size differs here) is refused, and so is this
            # rank's size when another rank saved it.
            with pytest.raises(ValueError, match="load_checkpoint"):
                layout.own_part("w", "Moment_1_w", np.zeros(12 - s.size, np.float32), 12, (s.size,),
                                (1 - rank, 2), (rank, 2))
            with pytest.raises(ValueError, match=f"keeps elements {s.start}:{s.stop}"):
                layout.own_part("w", "Moment_1_w", np.zeros(s.size, np.float32), 12, (s.size,), (1 - rank, 2),
                                (rank, 2))
            np.testing.assert_array_equal(  # this rank's own segment, from this rank, is taken as is
                layout.own_part("w", "Moment_1_w", np.ones(s.size, np.float32), 12, (s.size,), (rank, 2),
                                (rank, 2)), np.ones(s.size))
        assert layout.buffer_name("b", "Moment_1") == ("Moment_1_b" if "b" in segments else None)
