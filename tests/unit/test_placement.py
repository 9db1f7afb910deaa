"""The one placement decision (placement/device.py) and the CUDA path that depends on it, checked on the
CPU: which device, providers, provider options and process-group backend each configuration gets, per
LOCAL_RANK; that torch's stream is drained before every onnxruntime run; that missing gradients of custom
autograd Functions are made on the tensor's device. No GPU ran any of this (docs/engine.md, "CUDA path").

`cuda_ready` is patched where a GPU is pretended: the decision, not CUDA itself, is what runs here.
"""

import copy

import onnxruntime as ort
import pytest
import torch
from helpers.models import MLP, MLP_DESC, mlp_loss

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.placement import device as placement
from orttrainer.engine.pyop import python_op
from orttrainer.run.ranks import Ranks
from orttrainer.run.recipe.spec import RecipeError


@pytest.fixture
def gpu(monkeypatch):
    """Pretend torch and onnxruntime see a GPU; no launcher environment."""
    monkeypatch.setattr(placement, "cuda_ready", lambda: True)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def options(**extra):
    return ORTTrainerOptions(extra)


def test_cpu_placement():
    p = placement.resolve("cpu")
    assert (p.device, p.providers, p.provider_options, p.backend, p.fallback) == (
        torch.device("cpu"), ("CPUExecutionProvider",), ({},), "gloo", False)


def test_cuda_options_from_device_options(gpu):
    p = placement.from_options(options(device={"id": "cuda:1", "mem_limit": 2 << 30}))
    assert p.device == torch.device("cuda", 1) and p.backend == "nccl"
    assert p.providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    # device id and memory limit; no user_compute_stream: the runs synchronize torch's stream instead
    # (docs/ort-notes.md, "CUDA streams"), which also covers torch's default stream (handle 0).
    assert p.provider_options == ({"device_id": 1, "gpu_mem_limit": 2 << 30}, {})
    assert placement.from_options(options(device={"id": "cuda"})).provider_options[0] == {"device_id": 0}


def test_cuda_provider_options_move_the_device(gpu):
    given = {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested", "device_id": "2"}}
    opts = options(device={"id": "cuda"}, provider_options=copy.deepcopy(given))
    p = placement.from_options(opts)
    assert p.device == torch.device("cuda", 2) and p.backend == "nccl"
    assert p.providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert p.provider_options[0] == {"arena_extend_strategy": "kSameAsRequested", "device_id": 2}
    assert opts._validated_opts["provider_options"] == given  # the user's dicts are not written to
    # without device_id in them, the provider gets the device of options.device.id
    p = placement.from_options(options(device={"id": "cuda:3"},
                                       provider_options={"CUDAExecutionProvider": {"gpu_mem_limit": "1024"}}))
    assert p.device == torch.device("cuda", 3)
    assert p.provider_options[0] == {"gpu_mem_limit": "1024", "device_id": 3}


def test_cuda_provider_options_conflicts_and_no_gpu(monkeypatch, gpu):
    with pytest.raises(ValueError, match=r"'cuda:1'.*device_id'\] is 0"):
        placement.from_options(options(device={"id": "cuda:1"},
                                       provider_options={"CUDAExecutionProvider": {"device_id": 0}}))
    with pytest.raises(ValueError, match="must be a GPU index"):
        placement.resolve("cuda", provider_options={"CUDAExecutionProvider": {"device_id": "first"}})
    monkeypatch.setattr(placement, "cuda_ready", lambda: False)
    with pytest.raises(RuntimeError, match="provider_options name CUDAExecutionProvider but no CUDA device"):
        placement.resolve("cuda", provider_options={"CUDAExecutionProvider": {}})
    # other providers: the state stays on the CPU
    p = placement.resolve("cuda", provider_options={"CPUExecutionProvider": {"arena_extend_strategy": "x"}})
    assert p.device == torch.device("cpu") and p.backend == "gloo"


def test_trainer_delegates_to_the_placement(gpu):
    trainer = ORTTrainer(MLP(), copy.deepcopy(MLP_DESC), optim.SGDConfig(), loss_fn=mlp_loss,
                         options=options(provider_options={"CUDAExecutionProvider": {"device_id": 1}}))
    providers, provider_options, device = trainer._providers()
    assert device == torch.device("cuda", 1) and providers[0] == "CUDAExecutionProvider"
    assert provider_options[0] == {"device_id": 1}
    assert trainer._session_device_type() == "cuda"


@pytest.mark.parametrize("local_rank", [0, 1])
def test_each_local_rank_takes_its_own_gpu(monkeypatch, gpu, local_rank):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    opts = options(device={"id": "cuda"},
                   distributed={"world_size": 2, "world_rank": local_rank, "local_rank": local_rank})
    p = placement.from_options(opts)
    assert p.device == torch.device("cuda", local_rank) and p.backend == "nccl"
    assert p.provider_options[0] == {"device_id": local_rank}
    # the runner decides the same for the same rank, before the trainer exists
    ranks = Ranks(rank=local_rank, world_size=2, local_rank=local_rank)
    assert ranks.placement({"device": {"id": "cuda"}}) == p


def test_local_rank_must_agree_with_the_launcher(monkeypatch, gpu):
    monkeypatch.setenv("LOCAL_RANK", "1")
    opts = options(device={"id": "cuda"}, distributed={"world_size": 2, "world_rank": 1, "local_rank": 0})
    with pytest.raises(RuntimeError, match=r"local_rank=0 but the launcher's LOCAL_RANK is 1"):
        placement.from_options(opts)
    assert placement.device_type(opts) == "cpu"  # no error at construction: the session raises it


def test_explicit_index_in_a_recipe_of_several_local_ranks_is_an_error(monkeypatch, gpu):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match="'cuda:0' puts all 2 ranks of this host on one GPU"):
        Ranks(rank=1, world_size=2, local_rank=1).placement({"device": {"id": "cuda:0"}})


def test_backend_follows_the_resolved_device_not_torch_alone(monkeypatch):
    # torch sees a GPU but onnxruntime has no CUDA provider: the trainer runs on the CPU, so gloo.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    monkeypatch.setenv("LOCAL_RANK", "1")
    p = Ranks(rank=1, world_size=2, local_rank=1).placement({"device": {"id": "cuda"}})
    assert p.device == torch.device("cpu") and p.backend == "gloo" and p.fallback
    with pytest.raises(RecipeError, match="'cuda:1' but no CUDA device is usable"):
        Ranks(rank=1, world_size=2, local_rank=1).placement({"device": {"id": "cuda:1"}})
    assert placement.backend_for("cuda:1") == "nccl" and placement.backend_for("cpu") == "gloo"


def test_wait_for_torch_synchronizes_the_current_stream_of_a_cuda_device(monkeypatch):
    synced = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            synced.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    placement.wait_for_torch(torch.device("cpu"))
    placement.wait_for_torch(torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1)]


def test_every_run_waits_for_torch_first(monkeypatch, cpu_options):
    """The stream ordering is wired in: before each onnxruntime run, torch's work on the device is waited
    for (on the CPU a no-op; on CUDA the synchronize checked above)."""
    import orttrainer.engine.runtime.session as session_module

    events = []
    monkeypatch.setattr(session_module.placement, "wait_for_torch", lambda device: events.append(("wait", device)))
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), copy.deepcopy(MLP_DESC), optim.SGDConfig(), loss_fn=mlp_loss,
                         options=cpu_options())
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    trainer.train_step(x, y)
    session = trainer._training_session.session  # the Runtime's onnxruntime session
    run = session.run_with_iobinding
    session.run_with_iobinding = lambda *a: (events.append(("run", None)), run(*a))[1]
    events.clear()
    trainer.train_step(x, y)
    trainer.eval_step(x, y)
    assert events == [("wait", torch.device("cpu")), ("run", None)] * 2


class HalfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x * 2, y + 1

    @staticmethod
    def backward(ctx, gx, gy):
        HalfGrad.seen = (gx.device, gy.device)
        return gx, None  # no gradient for y: made as zeros


def test_missing_gradients_are_made_on_the_tensors_device(monkeypatch):
    """The zeros follow the device the forward's tensors were on. A 'meta' device stands for a GPU: the
    metadata a CUDA session would record is put in, and the zeros must come out on it."""
    name = python_op._register_function(HalfGrad)
    x, y = torch.ones(2, 3), torch.ones(3)
    out = python_op._run_forward(name, [1, 1], [True, True], 0, [x, y])
    ctx = out[0]
    assert [m[2] for m in ctx._inputs] == [torch.device("cpu")] * 2
    meta = torch.device("meta")
    ctx._inputs[1] = ctx._inputs[1][:2] + (meta,)  # y: the input and the output without a gradient
    ctx._outputs[1] = ctx._outputs[1][:2] + (meta,)
    ctx.needs_input_grad = (True, True)
    monkeypatch.setattr(python_op.dlpack, "to_dlpack", lambda t: t)  # meta tensors have no dlpack
    grads = python_op._run_backward(name, [1, 1], [False, True, True], 0, [ctx, torch.full((2, 3), 1.0), None])
    assert HalfGrad.seen == (torch.device("cpu"), meta)  # the missing output gradient: zeros on meta
    assert grads[0].device == torch.device("cpu") and torch.equal(grads[0], torch.ones(2, 3))
    assert grads[1].device == meta and grads[1].shape == (3,)  # the missing input gradient too
