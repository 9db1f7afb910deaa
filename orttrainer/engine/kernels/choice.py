"""Which kernels a training graph runs on: for each matrix product onnxruntime's MLAS or torch's, and
for Adam's update onnxruntime's AdamOptimizer or the kernel library's Adam.

    Kernels.of(compute_dtype, device_type)   what a trainer asks for (part of its export cache key)
    apply(model, kernels)                    rewrites the graph's products accordingly
    adam_on_library(kernels)                 whether the graph's Adam updates are the library's

bfloat16 (mixed precision on a CPU with bf16 units): every fp32 product moves to torch, computing in
bf16 -- onnxruntime has no bf16 matmul on the CPU. float32: each product goes to whichever kernel this
host measured faster for its shape class ("fastest", the default), or all to one of them
($ORTTRAINER_FP32_MATMULS = "mlas" | "torch"; benchmarks and checks use these).

A shape class is the node's op, attributes and operand shapes, symbolic sizes (batch, sequence) taken
as NOMINAL_SYMBOL_SIZE each: a graph serves every batch size, and which kernel is faster depends on
the host and the product's static sizes far more than on the row count (a class whose operands do not
fit together at those sizes stays on MLAS, unmeasured). Each class is timed once per host -- MLAS's
node and TorchMatMul, each alone in a session, best of a few runs -- and kept in
<kernel dir>/choices-<cpu identity>-<library digest>.json; torch must be MARGIN faster to be chosen,
so a tie stays on MLAS. Where the TorchMatMul library cannot run here, everything stays on MLAS (one
warning).

Adam: the library's (engine/kernels/adam.cc) by default on the CPU -- AdamOptimizer's arithmetic,
run on the session's threads, skipping a discarded step itself so that mixed precision updates in
place too; $ORTTRAINER_ADAM = "onnxruntime" keeps AdamOptimizer (benchmarks and checks use it), as
does a library that cannot run here (one warning).
"""

import dataclasses
import functools
import json
import os
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from orttrainer.engine.graph import torch_matmul
from orttrainer.engine.kernels import library
from orttrainer.placement import cpu

FP32_ENV = "ORTTRAINER_FP32_MATMULS"
FP32_CHOICES = ("fastest", "mlas", "torch")
ADAM_ENV = "ORTTRAINER_ADAM"
ADAM_CHOICES = ("orttrainer", "onnxruntime")
NOMINAL_SYMBOL_SIZE = 16
MARGIN = 1.05
MIN_FLOPS = 1 << 22  # smaller products cost the call, not the kernel: they stay on MLAS, unmeasured
_RUNS = 3


@dataclasses.dataclass(frozen=True)
class Kernels:
    compute: str = "float32"  # "bfloat16": every product on torch's bf16 GEMM
    fp32: str = "mlas"        # for float32 compute: "fastest" (per class), "mlas" or "torch"
    host: str = ""            # cpu.identity() of the host the choice is made for
    adam: str = "onnxruntime"  # "orttrainer": Adam updates on the library's Adam

    @classmethod
    def of(cls, compute_dtype, device_type):
        if device_type == "cuda":
            return cls()  # the session's own CUDA kernels
        adam = _env_choice(ADAM_ENV, ADAM_CHOICES)
        if compute_dtype == torch.bfloat16:
            return cls("bfloat16", host=cpu.identity(), adam=adam)
        return cls(fp32=_env_choice(FP32_ENV, FP32_CHOICES), host=cpu.identity(), adam=adam)

    def cache_key(self):
        """The choice and whether this process can run the library's kernels it asks for: a graph
        cached by a process where they ran holds their nodes, one where they fell back does not."""
        key = dataclasses.asdict(self)
        if self.compute == "bfloat16" or self.fp32 != "mlas":
            key["products_on_library"] = library.problem() == ""
        if self.adam == "orttrainer":
            key["adam_on_library"] = library.adam_problem() == ""
        return key


def _env_choice(name, choices):
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"${name} is {value!r}; use one of {', '.join(choices)} (unset: {choices[0]})")
    return value


def apply(model, kernels: Kernels):
    """Rewrite `model`'s products for `kernels`; returns how many moved to torch."""
    if kernels.compute == "float32" and kernels.fp32 == "mlas":
        return 0
    reason = library.problem()
    if reason:
        _warn_once(reason)
        return 0
    if kernels.compute == "bfloat16":
        return torch_matmul.matmuls_on_torch(model, "bfloat16")
    if kernels.fp32 == "torch":
        return torch_matmul.matmuls_on_torch(model, "float32")
    shapes = _shapes(model.graph)
    choices = _Choices(kernels.host)
    return torch_matmul.matmuls_on_torch(model, "float32",
                                         wanted=lambda node: choices.torch_wins(node, shapes))


def adam_on_library(kernels: Kernels):
    """Whether the graph's Adam updates run on the library's Adam (else onnxruntime's AdamOptimizer)."""
    if kernels.adam != "orttrainer":
        return False
    reason = library.adam_problem()
    if reason:
        _warn_once(reason, "Adam updates stay on onnxruntime's AdamOptimizer (mixed precision keeps second "
                           "copies of the weights and moments)")
        return False
    return True


@functools.lru_cache(maxsize=None)
def _warn_once(reason, fallback="Matrix products stay on onnxruntime's fp32 kernels"):
    warnings.warn(f"{fallback}: {reason}", RuntimeWarning, stacklevel=3)


def _shapes(graph):
    """{tensor: [size, ...]} where the graph records a shape; symbolic sizes are NOMINAL_SYMBOL_SIZE."""
    shapes = {i.name: list(i.dims) for i in graph.initializer}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = info.type.tensor_type
        if t.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else NOMINAL_SYMBOL_SIZE
                                 for d in t.shape.dim]
    return shapes


def class_of(node, shapes):
    """The shape class of a product node (a JSON-able key), or None where an operand's shape is unknown."""
    operands = [name for name in node.input if name]
    if any(name not in shapes for name in operands):
        return None
    attrs = sorted((a.name, helper.get_attribute_value(a)) for a in node.attribute)
    return json.dumps([node.domain, node.op_type, attrs, [shapes[name] for name in operands]])


def _flops(attrs, operand_shapes):
    """2·(elements of op(A))·N of a product, N the columns of op(B)."""
    attrs = dict(attrs)
    a, b = operand_shapes[0], operand_shapes[1]
    if not a or not b:
        return 0
    columns = b[-2] if attrs.get("transB", 0) and len(b) >= 2 else b[-1]
    return 2 * int(np.prod(a)) * int(columns)


class _Choices:
    """The host's measured classes, read from and written to its choices file."""

    def __init__(self, host):
        self.path = library.kernel_dir() / f"choices-{host}-{library.digest()}.json"
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}

    def torch_wins(self, node, shapes):
        key = class_of(node, shapes)
        if key is None:
            return False
        _, _, attrs, operand_shapes = json.loads(key)
        if _flops(attrs, operand_shapes) < MIN_FLOPS:
            return False
        if key not in self.known:
            try:
                self.known[key] = _measure(node, operand_shapes)
            except Exception:  # noqa: BLE001 -- e.g. nominal sizes that do not fit together: MLAS, unmeasured
                self.known[key] = {"mlas": 0.0, "torch": float("inf"), "unmeasurable": True}
            self._save()
        seconds = self.known[key]
        return seconds["torch"] * MARGIN < seconds["mlas"]

    def _save(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temp = self.path.with_suffix(f".tmp-{os.getpid()}")
            temp.write_text(json.dumps(self.known, indent=0))
            os.replace(temp, self.path)
        except OSError:
            pass  # measured again by the next process


def _measure(node, operand_shapes):
    """{"mlas": s, "torch": s}: the best of _RUNS runs of the node alone, and of its TorchMatMul."""
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(operand_shapes)}
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, value.shape)
              for name, value in feeds.items()]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    product = helper.make_node(node.op_type, list(feeds), ["y"], domain=node.domain)
    product.attribute.extend(node.attribute)
    seconds = {}
    for kernel in ("mlas", "torch"):
        graph = helper.make_graph([product], "product", inputs, [output])
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 8
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if kernel == "torch":
            torch_matmul.matmuls_on_torch(model, "float32")
            library.register(options)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        best = float("inf")
        for _ in range(_RUNS):
            start = time.perf_counter()
            session.run(None, feeds)
            best = min(best, time.perf_counter() - start)
        seconds[kernel] = best
    return seconds
