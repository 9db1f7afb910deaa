"""The TorchMatMul custom-op library: built, loaded and checked once per process.

`com.orttrainer::TorchMatMul` (torch_matmul.cc) is one matrix product of the training graph -- what a
MatMul, Gemm or FusedMatMul node computes -- run by torch's kernels (MKL's sgemm, or oneDNN's bfloat16
GEMM on a CPU with bf16 units) from inside the one onnxruntime session, its output in the session's
own memory plan. onnxruntime's CPU provider has no bfloat16 matmul at all on x86, so bf16 compute
needs it; in fp32 it is the faster kernel on some hosts (docs/performance.md, "Matmul kernels").

    problem()                  "" when the library is built here and passed its self-test, else why not
    register(session_options)  sessions made with these options know the op (call problem() first)
    uses(model)                whether a graph holds TorchMatMul nodes

The library is compiled from source with torch.utils.cpp_extension (torch's own flags and C++ ABI;
~10 s with g++ 12 on 2 cores) into $ORTTRAINER_KERNEL_DIR, else <user cache dir>/orttrainer/kernels,
in a folder named by a digest of the source and the torch and onnxruntime versions, so it is built
once per install and loaded by later processes. No compiler, a failed build or a failed self-test
make problem() say why; callers then keep onnxruntime's own kernels, with one warning.
"""

import hashlib
import os
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from orttrainer.engine.graph.torch_matmul import COMPUTE, DOMAIN, OP  # the op's name and attributes
from orttrainer.placement.process_state import PROCESS, keep_module_names

KERNEL_DIR_ENV = "ORTTRAINER_KERNEL_DIR"
_SOURCE = Path(__file__).with_name("torch_matmul.cc")
_NAME = "orttrainer_torch_matmul"
_BUILT = "built"  # written once the library loaded: a folder without it holds no finished build

# The library loaded, its check and the options it was registered on: process-wide (PROCESS).
keep_module_names(__name__, _path="torch_matmul_library", _problem="torch_matmul_problem",
                  _registered="torch_matmul_options")


def problem():
    """"" when TorchMatMul nodes can run in this process, else the reason (checked once)."""
    if PROCESS.torch_matmul_problem is None:
        try:
            PROCESS.torch_matmul_library = _build_or_load()
            PROCESS.torch_matmul_problem = _self_test(PROCESS.torch_matmul_library)
        except Exception as exc:  # noqa: BLE001 -- any failure means: keep onnxruntime's kernels
            PROCESS.torch_matmul_problem = (f"the TorchMatMul library could not be built or loaded: "
                                            f"{type(exc).__name__}: {exc}")
    return PROCESS.torch_matmul_problem


def register(session_options):
    """Make TorchMatMul known to sessions made with `session_options`."""
    reason = problem()
    if reason:
        raise RuntimeError(f"This graph computes matrix products with torch's kernels, but {reason}")
    if any(o is session_options for o in PROCESS.torch_matmul_options):
        return
    session_options.register_custom_ops_library(PROCESS.torch_matmul_library)
    PROCESS.torch_matmul_options.append(session_options)


def uses(model: onnx.ModelProto) -> bool:
    return any(n.op_type == OP and n.domain == DOMAIN for n in model.graph.node)


def kernel_dir() -> Path:
    if os.environ.get(KERNEL_DIR_ENV):
        return Path(os.environ[KERNEL_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orttrainer" / "kernels"


def digest():
    """What the built library depends on: its source and the torch and onnxruntime versions."""
    parts = [_SOURCE.read_bytes(), torch.__version__.encode(), ort.__version__.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build_or_load():
    folder = kernel_dir() / digest()
    library = folder / f"{_NAME}.so"
    if (folder / _BUILT).exists() and library.exists():
        torch.ops.load_library(str(library))  # with torch's own libraries, which it links against
        return str(library)
    folder.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cpp_extension's notes on compiler versions
        path = cpp_extension.load(_NAME, [str(_SOURCE)], extra_cflags=["-O2", "-std=c++20"],
                                  build_directory=str(folder), is_python_module=False, verbose=False)
    (folder / _BUILT).write_text(f"{torch.__version__} {ort.__version__}\n")
    return str(path)


# (A shape, B shape, transA, transB, alpha, beta, C shape): transposes, batch broadcasting, a weight
# shared by a batch, 1-wide and batch-1 dims, a Gemm's bias; products split over threads by batch
# (same-rank operands) and by rows (130 rows: blocks of unequal size), with a per-row bias.
_CASES = (
    ((5, 7), (7, 3), 0, 0, 1.0, 1.0, None),
    ((7, 5), (3, 7), 1, 1, 0.5, 1.0, None),
    ((2, 3, 5, 7), (7, 4), 0, 0, 1.0, 1.0, None),
    ((2, 1, 5, 7), (3, 4, 7), 0, 1, 1.0, 1.0, None),
    ((1, 7), (7, 1), 0, 0, 1.0, 1.0, None),
    ((1, 5, 7), (1, 5, 3), 1, 0, 1.0, 1.0, None),
    ((5, 7), (7, 3), 0, 0, 2.0, 0.5, (3,)),
    ((3, 2, 5, 7), (3, 2, 7, 4), 0, 0, 1.0, 1.0, None),
    ((7, 130), (3, 7), 1, 1, 1.0, 1.0, None),
    ((130, 7), (7, 3), 0, 0, 0.5, 2.0, (130, 3)),
)


def _self_test(path):
    """Each case of _CASES in fp32 and bf16 through one session, against float64 products: fp32
    within fp32 rounding; bf16 within bf16 rounding of the operands, and rounded to bf16 (so it did
    compute in bf16). "" when all agree, else what differed."""
    rng = np.random.default_rng(0)
    nodes, inputs, outputs, feeds, expected = [], [], [], {}, {}
    for index, (sa, sb, ta, tb, alpha, beta, sc) in enumerate(_CASES):
        a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
        c = rng.standard_normal(sc).astype(np.float32) if sc else None
        names = [f"a{index}", f"b{index}"] + ([f"c{index}"] if sc else [])
        for name, value in zip(names, (a, b, c)):
            feeds[name] = value
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, value.shape))
        op_a, op_b = (np.swapaxes(a, -1, -2) if ta else a), (np.swapaxes(b, -1, -2) if tb else b)
        for compute in COMPUTE:
            y = f"y{index}_{compute}"
            nodes.append(helper.make_node(OP, names, [y], domain=DOMAIN, transA=ta, transB=tb, alpha=alpha,
                                          beta=beta, compute=COMPUTE[compute]))
            outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, None))
            exact = alpha * np.matmul(op_a.astype(np.float64), op_b.astype(np.float64))
            scale = abs(alpha) * np.matmul(np.abs(op_a).astype(np.float64), np.abs(op_b).astype(np.float64))
            if c is not None:
                exact, scale = exact + beta * c, scale + abs(beta) * np.abs(c)
            expected[y] = (compute, exact, scale, op_a.shape[-1])
    graph = helper.make_graph(nodes, "torch_matmul_self_test", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.register_custom_ops_library(path)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    results = dict(zip([o.name for o in outputs], session.run(None, feeds)))
    for name, (compute, exact, scale, k) in expected.items():
        got = results[name]
        if got.shape != exact.shape:
            return f"the self-test's {name} has shape {got.shape}, expected {exact.shape}"
        # fp32: k products and sums of rounding 2^-24 each. bf16: operands rounded by 2^-8 each, the
        # product once more by 2^-8 (then the fp32 alpha/bias), plus fp32 accumulation.
        unit = 2.0 ** -24 if compute == "float32" else 3 * 2.0 ** -8
        bound = (k + 2) * 2.0 ** -24 * scale + unit * scale + 1e-30
        if not np.all(np.abs(got - exact) <= bound):
            return (f"the self-test's {name} ({compute}) differs from the exact product by "
                    f"{np.abs(got - exact).max():.3g} (bound {bound.max():.3g})")
    bf16_product = results["y0_bfloat16"]  # alpha 1, no bias: the product as bf16 gave it
    if not np.array_equal(bf16_product, torch.from_numpy(bf16_product).bfloat16().float().numpy()):
        return "the self-test's bfloat16 product is not rounded to bfloat16: it did not compute in bfloat16"
    return ""
