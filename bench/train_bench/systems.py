"""Benchmark workloads and the systems that train them (orttrainer, eager torch, torch.compile, each
also in mixed precision), and the FLOP counts of one step. Used by train_bench.py and the other tools
in bench/."""

import contextlib
import time
import warnings

import torch

from . import models as bm

SYSTEMS = ("orttrainer", "eager", "compile")  # fp32 compute
# Mixed precision: the torch systems under torch.autocast("cpu", torch.bfloat16) (fp32 master weights
# and Adam, as above); orttrainer with mixed_precision.enabled=True, computing in whatever its
# compute_dtype 'auto' resolves to on this host (compute_dtype() says which).
MIXED_SYSTEMS = ("orttrainer-mixed", "eager-bf16", "compile-bf16")
ALL_SYSTEMS = SYSTEMS + MIXED_SYSTEMS
# What each orttrainer system is compared with: fp32 with fp32, mixed with bf16.
BASELINES = {"orttrainer": ("eager", "compile"), "orttrainer-mixed": ("eager-bf16", "compile-bf16")}
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with bf16 matrix units
LR = 1e-4
SGEMM_N = 2048  # --quick: 1024


# =========================================================================== workloads
def make_workload(name, args, batch=None, seq=None):
    quick = args.quick
    if name == "gpt":
        cfg = bm.GPTConfig(attention=args.attention)
        if quick:
            cfg = bm.GPTConfig(
                vocab=512, hidden=64, layers=2, heads=2, max_positions=64, attention=args.attention
            )
        return bm.GPTWorkload(batch=batch or (4 if quick else 8), seq=seq or (32 if quick else 128), cfg=cfg,
                              ort_outputs=args.ort_outputs)
    if name == "bert":
        size = bm.BertSize(vocab=args.bert_vocab)
        if quick:
            size = bm.BertSize(vocab=1024, hidden=64, layers=2, heads=2, intermediate=128, max_positions=64)
        return bm.BertWorkload(
            batch=batch or (4 if quick else 8), seq=seq or (32 if quick else 128), size=size,
            ort_outputs=args.ort_outputs,
        )
    raise ValueError(name)


def is_mixed(name):
    return name in MIXED_SYSTEMS


def baselines_of(name):
    """The torch systems a system's ratios are taken against: its own precision's eager and compile."""
    return BASELINES["orttrainer-mixed" if is_mixed(name) else "orttrainer"]


def systems_for_host(mixed, kernel_flags):
    """The systems a run trains: the fp32 three, and the mixed three when `mixed` is "on", or "auto" on
    a host whose CPU flags include a bf16 matrix unit (elsewhere torch's bf16 matmul is emulated and
    the mixed systems would measure that emulation). Returns (systems, why)."""
    units = [f for f in BF16_FLAGS if f in kernel_flags]
    if mixed == "off":
        return SYSTEMS, "off (--mixed off)"
    if mixed == "on":
        return ALL_SYSTEMS, f"on (--mixed on; bf16 flags: {'/'.join(units) or 'none'})"
    if units:
        return ALL_SYSTEMS, f"on (the CPU has {'/'.join(units)})"
    return SYSTEMS, f"off (no {' or '.join(BF16_FLAGS)} in /proc/cpuinfo; --mixed on forces them)"


# =========================================================================== systems
class System:
    """One trainer under test: `first_step(batch)` (timed as start-up), then `step(batch)` -> loss."""

    name = ""

    def startup(self):
        return {}


class ORTSystem(System):
    name = "orttrainer"

    def __init__(self, workload, model, session_options=None, mixed=False):
        from orttrainer import ORTTrainer, ORTTrainerOptions, optim

        self.name = "orttrainer-mixed" if mixed else "orttrainer"
        # Start-up is measured cold: bench/startup_cache.py measures what the export cache saves.
        opts = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
        if mixed:
            opts["mixed_precision"] = {"enabled": True}  # compute_dtype 'auto', the legacy switch
        if session_options is not None:
            opts["session_options"] = session_options
        model, model_desc, loss_fn = workload.ort_trainer_args(model)
        self.trainer = ORTTrainer(model, model_desc, optim.AdamConfig(lr=LR), loss_fn=loss_fn,
                                  options=ORTTrainerOptions(opts))
        self._first_wall = None

    def step(self, batch):
        outputs = self.trainer.train_step(*batch)  # the loss alone, or (loss, logits) with --ort-outputs all
        return (outputs[0] if isinstance(outputs, (list, tuple)) else outputs).item()

    def first_step(self, batch):
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = self.step(batch)
        self._first_wall = time.perf_counter() - started
        return loss

    def startup(self):
        s = dict(self.trainer.startup_seconds)
        parts = {
            "export_s": s.get("export"),
            "training_graph_s": s.get("training_graph"),
            "session_s": s.get("session"),
            "first_step_s": s.get("first_step"),
        }
        known = sum(v for v in parts.values() if v is not None)
        parts["other_s"] = self._first_wall - known  # sample run for output types, postprocess, checks
        parts["total_s"] = self._first_wall
        return parts

    def compute_dtype(self):
        """What the trainer really computes in: the dtype its compute_dtype option resolved to, checked
        against its training graph -- which kernel computes each matrix product (TorchMatMul in bf16 on
        a CPU with bf16 units), and the Casts to fp16/bf16 an autocast export puts before them."""
        from onnx import TensorProto

        resolved = self.trainer.compute_dtype
        graph = self.trainer.training_model.graph
        low = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
        casts = {}
        for node in (n for n in graph.node if n.op_type == "Cast"):
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to in low:
                casts[low[to]] = casts.get(low[to], 0) + 1
        kernels = self.trainer.matmul_kernels
        if kernels["torch_bfloat16"]:
            dtype = "bfloat16"
        else:
            dtype = max(casts, key=casts.get) if casts else "float32"
        return {
            "dtype": dtype,
            "resolved_option": str(resolved or torch.float32).replace("torch.", ""),
            "matmul_kernels": kernels,
            "low_precision_casts": casts,
            "how": "mixed_precision.compute_dtype as the trainer resolved it, the kernel of each matrix "
            "product (ORTTrainer.matmul_kernels) and the Casts to fp16/bf16 of its training graph",
        }


class TorchSystem(System):
    def __init__(self, workload, model, compiled, backend="inductor", bf16=False):
        self.name = ("compile" if compiled else "eager") + ("-bf16" if bf16 else "")
        self.bf16 = bf16
        self.model = model
        self.loss_module = workload.loss_module(model)
        if compiled:
            self.loss_module = torch.compile(self.loss_module, backend=backend)  # default mode
        self.optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        self._first_wall = None

    def step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        # The forward under autocast, the backward outside it (as torch's AMP recipe does): weights,
        # gradients and Adam stay fp32; autocast's cast of each weight to bf16 is part of the step.
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext():
            loss = self.loss_module(*batch)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def first_step(self, batch):
        started = time.perf_counter()
        loss = self.step(batch)
        self._first_wall = time.perf_counter() - started
        return loss

    def startup(self):
        if self.name == "compile":
            return {"compile_s": self._first_wall, "total_s": self._first_wall}
        return {"first_step_s": self._first_wall, "total_s": self._first_wall}

    def compute_dtype(self):
        return {"dtype": "bfloat16" if self.bf16 else "float32",
                "how": "torch.autocast('cpu', torch.bfloat16) around the forward" if self.bf16 else "fp32"}


def make_system(name, workload, model, session_options=None, backend="inductor"):
    model.train()
    if name in ("orttrainer", "orttrainer-mixed"):
        return ORTSystem(workload, model, session_options=session_options, mixed=is_mixed(name))
    if name not in ALL_SYSTEMS:
        raise ValueError(f"unknown system {name!r}; one of {', '.join(ALL_SYSTEMS)}")
    return TorchSystem(workload, model, compiled=name.startswith("compile"), backend=backend,
                       bf16=is_mixed(name))


# =========================================================================== measurements
def sgemm_once(a, b):
    started = time.perf_counter()
    torch.matmul(a, b)
    return 2 * a.shape[0] ** 3 / (time.perf_counter() - started) / 1e9


def sgemm_best(n, reps, dtype=torch.float32):
    """Best torch.matmul rate (GFLOP/s) on n x n operands of `dtype` (bfloat16: the bf16 roof, fp32
    accumulation inside oneDNN's kernel, as autocast's matmuls run)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)  # warm
    return max(sgemm_once(a, b) for _ in range(reps))


def count_flops(workload):
    """Model FLOPs of one training step (forward + backward), counted on eager PyTorch.

    FlopCounterMode counts matmul-class ops exactly (mm/addmm/bmm/baddbmm/conv, 2 FLOPs per MAC; the
    backward's two matmuls per forward matmul included). CPU flash attention is not in its registry,
    so SDPA is forced to the math kernel here: the attention matmuls are counted over the full
    seq x seq score matrix (the causal half is not discounted). Element-wise work (LayerNorm, GELU,
    softmax, Adam) is not counted: "model FLOPs" are matmul FLOPs.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = workload.make_model()
    loss_module = workload.loss_module(model)
    batch = workload.batches(1)[0]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_module(*batch).backward()
    counts = counter.get_flop_counts()
    by_op = {str(op): int(n) for op, n in counts["Global"].items()}
    by_module = {name: int(sum(ops.values())) for name, ops in counts.items() if name != "Global"}
    return int(counter.get_total_flops()), by_op, by_module


MLM_DECODER = "cls.predictions.decoder"  # BertForPreTraining's vocabulary projection


def executed_flops(sname, system, workload, model_flops, by_module, batches):
    """The matmul FLOPs `sname` really performs per step: the model's, except where orttrainer runs the
    masked-LM decoder on the labelled rows only (engine/graph/sparse_prediction.py: K labelled rows plus one),
    which divides that product's FLOPs (forward and both gradients) by rows / (K + 1). An MFU from the
    model's count would credit orttrainer with work it skips (BERT: above the roof)."""
    if not sname.startswith("orttrainer") or workload.name != "bert":
        return model_flops
    graph = system.trainer.training_model.graph
    if not any(n.name.startswith("sparse_mlm") for n in graph.node):
        return model_flops
    decoder = next(v for name, v in by_module.items() if name.endswith(MLM_DECODER))
    kept = [(int((b[3] != -100).sum()) + 1) / b[3].numel() for b in batches]  # b[3]: the MLM labels
    return model_flops - decoder + decoder * sum(kept) / len(kept)


def analytic_flops(workload):
    """Cross-check of count_flops for the GPT model (documented formula, see docs/performance.md)."""
    if workload.name != "gpt":
        return None
    c, b, t = workload.cfg, workload.batch, workload.seq
    d, L, V = c.hidden, c.layers, c.vocab
    matmul_params = L * 12 * d * d + d * V  # qkv 3d², proj d², MLP 8d² per layer; tied head dV
    return 6 * matmul_params * b * t + 12 * L * b * t * t * d
