"""Adasum (distributed.enable_adasum) in real processes (gloo, a free port, a timeout on every wait).

The reference is independent of the code under test: each rank's update d_r comes from a one-process
trainer (no Adasum, no collectives) on that rank's data alone, and the updates are combined here in
NumPy (float64) by the formula, in the recursive-halving order ((0,1),(2,3)) → (01, 23).
"""

import numpy as np
import pytest
import torch
from helpers.distributed_worker import batch, launch, make_trainer, rank_slice, train, weights
from helpers.models import MLP

from helpers import adasum_worker

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did


def np_adasum(a, b):
    """The formula; a zero vector's coefficient is 1 (adasum(0, b) = b), and a result that cancels to
    below 2^-16 of its terms' size (float32 rounding noise) is exactly zero."""
    a64, b64 = a.ravel(), b.ravel()
    dot, aa, bb = np.dot(a64, b64), np.dot(a64, a64), np.dot(b64, b64)
    ca = 1.0 - dot / (2.0 * aa) if aa > 0 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb > 0 else 1.0
    result = a * ca + b * cb
    if np.linalg.norm(result) <= 2.0 ** -16 * (abs(ca) * np.sqrt(aa) + abs(cb) * np.sqrt(bb)):
        return np.zeros_like(result)
    return result


def np_tree(updates):
    """Per tensor: pairs (0,1), (2,3), ..., then pairs of those, down to one."""
    level = [{k: np.asarray(v, np.float64) for k, v in u.items()} for u in updates]
    while len(level) > 1:
        level = [{k: np_adasum(level[i][k], level[i + 1][k]) for k in level[i]} for i in range(0, len(level), 2)]
    return level[0]


# float32's unit roundoff: one rounding of x is within U·|x|.
U = 2.0 ** -24
# The trainer's and the reference's update of one rank differ by at most RHO of its size: the same
# optimizer graph on the same gradients, whose fp32 kernels may still sum in another order on another
# host or thread count (Adam: moments, bias corrections, sqrt, divide; a few roundings of U each).
RHO = 2.0 ** -20


def np_tree_with_error(updates, weights):
    """(combined, bound) per tensor: the float64 combination of `np_tree`, and a bound on how far the
    trainer's float32 combination of its own updates may be from it, propagated through the tree.

    A rank's update d = fl(w + u) - w carries RHO·|d| from its optimizer and one unit in the last place
    of w (2U·|w|: the two updates may round w + u to neighbouring floats). A combination
    c = ca·a + cb·b (in float32, the coefficients in float64 rounded to float32) adds the propagated
    errors |ca|·e_a + |cb|·e_b, the coefficients' own error from the perturbed dot products and norms
    (|δca| ≤ (‖e_a‖‖b‖ + ‖a‖‖e_b‖)/(2‖a‖²) + ‖b‖‖e_a‖/‖a‖², using |a·b| ≤ ‖a‖‖b‖), and three roundings
    relative to the TERMS, 3U·(|ca·a| + |cb·b|): where a and b cancel, the result is far smaller than
    the terms and an error relative to the result alone does not hold."""
    level = []
    for u in updates:
        d = {k: np.asarray(v, np.float64) for k, v in u.items()}
        level.append({k: (d[k], RHO * np.abs(d[k]) + 2 * U * np.abs(np.asarray(weights[k], np.float64)))
                      for k in d})
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level), 2):
            pair = {}
            for k in level[i]:
                (a, ea), (b, eb) = level[i][k], level[i + 1][k]
                na, nb, nea, neb = (np.linalg.norm(x) for x in (a, b, ea, eb))
                dot, aa, bb = np.dot(a.ravel(), b.ravel()), na * na, nb * nb
                ca = 1.0 - dot / (2.0 * aa) if aa > 0 else 1.0
                cb = 1.0 - dot / (2.0 * bb) if bb > 0 else 1.0
                dca = (nea * nb + na * neb) / (2.0 * aa) + nb * nea / aa if aa > 0 else 0.0
                dcb = (neb * na + nb * nea) / (2.0 * bb) + na * neb / bb if bb > 0 else 0.0
                terms = np.abs(ca * a) + np.abs(cb * b)
                error = abs(ca) * ea + abs(cb) * eb + dca * np.abs(a) + dcb * np.abs(b) + 3 * U * terms
                pair[k] = (np_adasum(a, b), error)
            nxt.append(pair)
        level = nxt
    return {k: v[0] for k, v in level[0].items()}, {k: v[1] for k, v in level[0].items()}


def ranks_ok(results):
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "error" not in result, f"rank {rank}: {result['error']}"
    return results


def test_reference_formula_facts():
    """The NumPy reference itself: equal vectors give the vector, orthogonal ones their sum, zero b."""
    a = np.array([1.0, 2.0, -3.0])
    np.testing.assert_allclose(np_adasum(a, a), a)
    np.testing.assert_allclose(np_adasum(np.array([1.0, 0.0]), np.array([0.0, 2.0])), [1.0, 2.0])
    np.testing.assert_allclose(np_adasum(np.zeros(3), a), a)
    np.testing.assert_allclose(np_adasum(np.zeros(3), np.zeros(3)), np.zeros(3))
    assert not np_adasum(a, -a * (1 + 1e-7)).any()  # cancelled: zero, not amplified noise


def test_coefficients_match_the_formula():
    from orttrainer.engine.parallel.adasum import coefficients

    rng = np.random.default_rng(0)
    for a, b in [(rng.normal(size=5), rng.normal(size=5)), (np.zeros(5), rng.normal(size=5)),
                 (rng.normal(size=5), np.zeros(5)), (np.ones(5), -np.ones(5)), (np.ones(5), np.ones(5))]:
        ca, cb = coefficients(float(a @ b), float(a @ a), float(b @ b))
        np.testing.assert_allclose(ca * a + cb * b, np_adasum(a, b), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------- the combination alone
@pytest.fixture(scope="module")
def combined(four_ranks):
    """4 ranks, flat (1 rank per node) and the NCCL layout run on gloo (2 nodes of 2 ranks)."""
    return [result["combine"] for result in four_ranks]


def seeded_updates(world):
    return [{n: adasum_worker.update(r, s, n).numpy() for n, s in adasum_worker.SHAPES.items()}
            for r in range(world)]


def test_combination_equals_numpy_reference(combined):
    updates = seeded_updates(4)
    expected = np_tree(updates)
    for rank, result in enumerate(combined):
        assert result[1]["padding_zero"]
        for name, value in result[1]["combined"].items():
            np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
            assert torch.equal(value, combined[0][1]["combined"][name]), f"rank {rank} differs in {name}"
    assert not expected["all_zero"].any()


def test_hierarchical_groups_on_gloo(combined):
    """2 nodes of 2 ranks: nodes sum, Adasum runs across nodes among the ranks of one local rank
    ({0, 2} and {1, 3}): a 2-party Adasum, where rank 0's zero tensor gives rank 2's alone."""
    assert [r[2]["node_sum"] for r in combined] == [1.0, 1.0, 5.0, 5.0]
    updates = seeded_updates(4)
    for rank, result in enumerate(combined):
        expected = np_tree([updates[rank % 2], updates[rank % 2 + 2]])
        for name, value in result[2]["combined"].items():
            np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(combined[0][2]["combined"]["zero"].numpy(), updates[2]["zero"], rtol=1e-6)


# ---------------------------------------------------------------------- the trainer
SCENARIOS = [
    dict(name="sgd", optim="sgd", adasum=True, per_step=True, steps=5),
    dict(name="adam", optim="adam", adasum=True, per_step=True, steps=5),
    # allreduce_post_accumulation=False is moot: nothing is reduced before the update.
    dict(name="adam-gas2-clip", optim="adam", gas=2, clip=True, post=False, adasum=True, per_step=True, steps=2),
    dict(name="adam-mixed", optim="adam", mixed=True, clip=True, adasum=True, per_step=True, steps=2),
    dict(name="sgd-poison", optim="sgd", adasum=True, per_step=True, steps=3, poison=(1, 1)),
    dict(name="adam-mixed-poison", optim="adam", mixed=True, adasum=True, per_step=True, steps=3, poison=(1, 1)),
    dict(name="adam-save", optim="adam", adasum=True, save=True, resume_saved=True),
    dict(name="adam-broken", optim="adam", adasum=True, per_step=True, steps=3, break_combined=(0, 1)),
    dict(name="adam-mixed-broken", optim="adam", mixed=True, adasum=True, per_step=True, steps=3,
         break_combined=(0, 1)),
]
BY_NAME = {s["name"]: s for s in SCENARIOS}
REFERENCED = ["sgd", "adam", "adam-gas2-clip", "adam-mixed"]


@pytest.fixture(scope="module")
def two_ranks(two_rank_launch):
    return ranks_ok(two_rank_launch)  # SCENARIOS run in the session's shared 2-rank launch (conftest.py)


# Ranks 0-2 of the 4-rank launch first start as a 3-rank job (WORLD_SIZE=3), which must be refused.
THREE = dict(name="three", optim="sgd", adasum=True, refused_world_size=3)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    # Starting ranks is the slow part: one launch for the trainers and the combination alone.
    scenarios = [THREE, BY_NAME["sgd"], BY_NAME["adam"], dict(name="combine", combine=True, local_sizes=(1, 2))]
    results, _ = launch(4, scenarios, tmp_path_factory.mktemp("adasum4"), timeout=300)
    return ranks_ok(results)


def initial_weights():
    torch.manual_seed(0)  # make_trainer's seed for rank 0, whose weights every rank starts from
    return {k: v.detach().clone() for k, v in MLP().state_dict().items()}


def reference_first_step(scenario, world):
    """w0, the combined update by the formula (float64) with its error bound, and the ranks' updates:
    each rank's update comes from a one-process trainer on that rank's data alone."""
    w0 = initial_weights()
    updates = []
    for rank in range(world):
        alone = make_trainer(dict(scenario, adasum=False))  # one process, this rank's data only
        train(alone, scenario, rank, world, steps=1)
        updates.append({k: (v - w0[k]).numpy() for k, v in weights(alone).items()})
    combined, error = np_tree_with_error(updates, {k: v.numpy() for k, v in w0.items()})
    return w0, combined, error, updates


def check_first_step(results, scenario, world):
    w0, combined, error, updates = reference_first_step(scenario, world)
    assert any(not np.allclose(updates[0][k], updates[1][k]) for k in w0)  # the ranks' updates differ
    for rank, result in enumerate(results):
        w1 = result[scenario["name"]]["per_step"][0]
        for k in w0:
            got = w1[k].double().numpy() - w0[k].double().numpy()
            # the combination's bound, plus the rounding of w0 + combined to float32
            bound = error[k] + 2 * U * np.abs(w1[k].double().numpy()) + 1e-12
            assert (np.abs(got - combined[k]) <= bound).all(), (rank, k, np.abs(got - combined[k]).max())


@pytest.mark.parametrize("name", REFERENCED)
def test_two_ranks_first_step_equals_reference(two_ranks, name):
    check_first_step(two_ranks, BY_NAME[name], 2)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_four_ranks_first_step_equals_reference(four_ranks, name):
    check_first_step(four_ranks, BY_NAME[name], 4)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_weights_identical_on_all_ranks_every_step(two_ranks, four_ranks, world, name):
    results = {2: two_ranks, 4: four_ranks}[world]
    per_step = [r[name]["per_step"] for r in results]
    assert len(per_step[0]) == 5
    for step in range(5):
        assert not torch.equal(per_step[0][step]["fc1.weight"], (per_step[0][step - 1] if step else
                                                                initial_weights())["fc1.weight"])
        for rank in range(1, world):
            for k, v in per_step[0][step].items():
                assert torch.equal(per_step[rank][step][k], v), (step, rank, k)
    if name == "adam":  # the moments are each rank's own
        moments = [r[name]["state_dict"]["optimizer"]["fc1.weight"]["Moment_1"] for r in results]
        assert not np.array_equal(moments[0], moments[1])


@pytest.mark.parametrize("name", ["sgd-poison", "adam-mixed-poison"])
def test_non_finite_gradient_on_one_rank_skips_the_step_everywhere(two_ranks, name):
    for rank, result in enumerate(two_ranks):
        per_step = result[name]["per_step"]
        for k, v in per_step[1].items():
            assert torch.equal(v, per_step[0][k]), (rank, k)  # step 1 (rank 1's inf) skipped
            assert torch.isfinite(per_step[2][k]).all()
            assert torch.equal(per_step[2][k], two_ranks[0][name]["per_step"][2][k])
        assert not torch.equal(per_step[2]["fc1.weight"], per_step[1]["fc1.weight"])  # step 2 ran
    if name == "adam-mixed-poison":
        info = [r[name]["state_dict"]["train_step_info"] for r in two_ranks]
        assert info[0] == info[1] and info[0]["optimization_step"] == 2


@pytest.mark.parametrize("name", ["adam-broken", "adam-mixed-broken"])
def test_non_finite_combined_update_on_one_rank_leaves_weights_everywhere(two_ranks, name):
    """A NaN put into rank 0's combined update at step 1: both ranks skip it (agreed)."""
    for rank, result in enumerate(two_ranks):
        per_step = result[name]["per_step"]
        for k, v in per_step[1].items():
            assert torch.equal(v, per_step[0][k]), (rank, k)
            assert torch.equal(per_step[2][k], two_ranks[0][name]["per_step"][2][k])
        assert not torch.equal(per_step[2]["fc1.weight"], per_step[1]["fc1.weight"])
        # The moments (updated in place) keep the step, and one warning says so.
        warned = [w for w in result[name]["warnings"] if "combined update was not finite" in w]
        assert len(warned) == 1, result[name]["warnings"]
        if name == "adam-mixed-broken":  # the loss scaler sees a skipped step
            assert result[name]["state_dict"]["train_step_info"]["optimization_step"] == 2


def test_checkpoint_save_and_resume_on_two_ranks(two_ranks):
    """Each rank saves its file (equal weights, its own moments) and resumes from it: the resumed
    run continues like the uninterrupted one, bitwise."""
    for rank, result in enumerate(two_ranks):
        r = result["adam-save"]
        assert r["resumed_losses"] == r["losses_after"], rank
        for k, v in r["weights_after"].items():
            assert torch.equal(r["resumed_weights"][k], v), (rank, k)
            assert torch.equal(v, two_ranks[0]["adam-save"]["weights_after"][k])


def test_non_power_of_two_world_is_an_error_naming_it(four_ranks):
    """Every rank of a 3-rank job refuses to start (in the 4-rank launch, before its process group)."""
    assert four_ranks[3]["three"] is None
    for result in [r["three"] for r in four_ranks[:3]]:
        assert result["error"] is not None, "a 3-rank Adasum job started"
        assert "NotImplementedError" in result["error"]
        assert "enable_adasum=True with distributed.world_size=3" in result["error"]
        assert "power of two" in result["error"]


def test_zero1_with_adasum_is_an_error():
    with pytest.raises(NotImplementedError, match=r"enable_adasum=True with deepspeed_zero_optimization.stage=1"):
        make_trainer(dict(optim="sgd", adasum=True, zero=1), rank=0, world_size=2)


def test_one_process_adasum_is_plain_training():
    plain, adasum = make_trainer(dict(optim="adam")), make_trainer(dict(optim="adam", adasum=True))
    for trainer in (plain, adasum):
        for step in range(2):
            trainer.train_step(*rank_slice(batch(step, 0), 0, 1))
    for k, v in weights(plain).items():
        assert torch.equal(weights(adasum)[k], v), k
