"""The custom-op library of the engine's own kernels: built, loaded and checked once per process.

`com.orttrainer::TorchMatMul` (torch_matmul.cc) is one matrix product of the training graph -- what a
MatMul, Gemm or FusedMatMul node computes -- run by torch's kernels (MKL's sgemm, or oneDNN's bfloat16
GEMM on a CPU with bf16 units) from inside the one onnxruntime session, its output in the session's
own memory plan. onnxruntime's CPU provider has no bfloat16 matmul at all on x86, so bf16 compute
needs it; in fp32 it is the faster kernel on some hosts (docs/performance.md, "Matmul kernels").

`com.orttrainer::Adam` (adam.cc) is onnxruntime's AdamOptimizer update that honours its apply flag
and may write over its inputs: the trainer updates weights and moments in place even where a step
may be discarded (mixed precision's non-finite steps), on the session's threads.

    problem()                  "" when the library is built here and TorchMatMul passed its self-test,
                               else why not
    adam_problem()             the same for Adam (its own self-test, against AdamOptimizer)
    register(session_options)  sessions made with these options know both ops (call a problem() first)
    uses(model)                whether a graph holds nodes of the library

The library is compiled from source with torch.utils.cpp_extension (torch's own flags and C++ ABI;
~15 s with g++ 12 on 2 cores) into $ORTTRAINER_KERNEL_DIR, else <user cache dir>/orttrainer/kernels,
in a folder named by a digest of the sources and the torch and onnxruntime versions, so it is built
once per install and loaded by later processes. No compiler, a failed build or a failed self-test
make the problem say why; callers then keep onnxruntime's own kernels, with one warning.
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

from orttrainer.engine.graph.builder import MS_DOMAIN
from orttrainer.engine.graph.optimizer_graph import LIBRARY_ADAM as ADAM_OP
from orttrainer.engine.graph.torch_matmul import COMPUTE, DOMAIN, OP  # the op's name and attributes
from orttrainer.placement.process_state import PROCESS, keep_module_names

KERNEL_DIR_ENV = "ORTTRAINER_KERNEL_DIR"
_HERE = Path(__file__).parent
_SOURCES = ("library.cc", "torch_matmul.cc", "adam.cc")
_HEADERS = ("ort_api.h",)
_NAME = "orttrainer_kernels"
_BUILT = "built"  # written once the library loaded: a folder without it holds no finished build

# The library loaded, its check and the options it was registered on: process-wide (PROCESS).
keep_module_names(__name__, _path="kernel_library", _problem="torch_matmul_problem",
                  _adam_problem="adam_problem", _registered="kernel_library_options")


def problem():
    """"" when TorchMatMul nodes can run in this process, else the reason (checked once)."""
    if PROCESS.torch_matmul_problem is None:
        try:
            PROCESS.kernel_library = _build_or_load()
            PROCESS.torch_matmul_problem = _self_test(PROCESS.kernel_library)
        except Exception as exc:  # noqa: BLE001 -- any failure means: keep onnxruntime's kernels
            PROCESS.torch_matmul_problem = (f"the kernel library could not be built or loaded: "
                                            f"{type(exc).__name__}: {exc}")
    return PROCESS.torch_matmul_problem


def adam_problem():
    """"" when Adam nodes can run in this process, else the reason (checked once)."""
    if PROCESS.adam_problem is None:
        if PROCESS.kernel_library is None:
            problem()
        if PROCESS.kernel_library is None:
            PROCESS.adam_problem = PROCESS.torch_matmul_problem
        else:
            try:
                PROCESS.adam_problem = _adam_self_test(PROCESS.kernel_library)
            except Exception as exc:  # noqa: BLE001 -- any failure means: keep AdamOptimizer
                PROCESS.adam_problem = f"Adam's self-test failed: {type(exc).__name__}: {exc}"
    return PROCESS.adam_problem


def register(session_options):
    """Make TorchMatMul known to sessions made with `session_options`."""
    problem()
    if PROCESS.kernel_library is None:
        raise RuntimeError(f"This graph holds nodes of the engine's kernel library, but {problem()}")
    if any(o is session_options for o in PROCESS.kernel_library_options):
        return
    session_options.register_custom_ops_library(PROCESS.kernel_library)
    PROCESS.kernel_library_options.append(session_options)


def uses(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN for n in model.graph.node)


def kernel_dir() -> Path:
    if os.environ.get(KERNEL_DIR_ENV):
        return Path(os.environ[KERNEL_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orttrainer" / "kernels"


def digest():
    """What the built library depends on: its sources and the torch and onnxruntime versions."""
    parts = [(_HERE / name).read_bytes() for name in _SOURCES + _HEADERS]
    parts += [torch.__version__.encode(), ort.__version__.encode()]
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
        # No contraction into FMAs: Adam repeats AdamOptimizer's fp32 operations one by one.
        # No errno from sqrt: its loops vectorize.
        flags = ["-O3", "-std=c++20", "-ffp-contract=off", "-fno-math-errno"]
        path = cpp_extension.load(_NAME, [str(_HERE / name) for name in _SOURCES], extra_cflags=flags,
                                  build_directory=str(folder), is_python_module=False, verbose=False)
    (folder / _BUILT).write_text(f"{torch.__version__} {ort.__version__}\n")
    return str(path)


def _self_test_session(path, name, nodes, inputs, outputs):
    """A CPU session of `nodes` with the library at `path` registered."""
    graph = helper.make_graph(nodes, name, inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.register_custom_ops_library(path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


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
    session = _self_test_session(path, "torch_matmul_self_test", nodes, inputs, outputs)
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


# (elements, weight_decay_mode, do_bias_correction, lambda, update count): both decay rules, with and
# without bias correction and decay, one-chunk and several-chunk tensors (run on several threads).
_ADAM_CASES = (
    (1000, 0, 1, 0.0, 1),
    (70001, 0, 1, 0.01, 3),
    (70001, 1, 1, 0.01, 5),
    (7, 1, 0, 0.0, 1),
    (7, 0, 0, 0.02, 2),
)
_ADAM_ROUNDINGS = 16  # fp32 roundings allowed, in units of the terms' magnitudes (see _adam_scale)
_ADAM_STATE = ("count", "m1", "m2", "w")  # the outputs, in AdamOptimizer's order


def _value_info(name, dtype, shape):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def _adam_self_test(path):
    """Each case of _ADAM_CASES through onnxruntime's AdamOptimizer and through Adam four ways in one
    session: apply true / false, outputs in their own buffers / bound to the inputs' (in place).
    Applied: AdamOptimizer's values within fp32 rounding and the count advanced; skipped: the inputs'
    values and count, and in place nothing written. "" when all hold, else what differed.

    Not bit for bit: the moments are, but AdamOptimizer's Eigen takes its square root from an
    approximate reciprocal square root and a Newton step (EIGEN_FAST_MATH), Adam the exact one, so
    the weights differ in the last bits of the step (~0.03% of elements)."""
    rng = np.random.default_rng(0)
    ways = [(apply, aliased) for apply in (True, False) for aliased in (True, False)]
    nodes, inputs, outputs, feeds, aliases = [], [], [], {}, {}
    for index, (n, mode, corrects, decay, count) in enumerate(_ADAM_CASES):
        attrs = dict(alpha=0.9, beta=0.999, epsilon=1e-6, do_bias_correction=corrects, weight_decay_mode=mode,
                     **{"lambda": decay})
        values = {"lr": np.array([1e-3], np.float32), "count": np.array([count], np.int64),
                  "w": rng.standard_normal(n).astype(np.float32),
                  "g": rng.standard_normal(n).astype(np.float32),
                  "m1": 0.1 * rng.standard_normal(n).astype(np.float32),
                  "m2": np.abs(0.1 * rng.standard_normal(n)).astype(np.float32)}
        for way in [None] + ways:
            names = [f"{name}{index}{way or ''}" for name in values]
            node_inputs = names if way is None else names + [f"apply{index}{way}"]
            for name, value in zip(node_inputs, list(values.values()) + [np.array([way and way[0]])]):
                feeds[name] = value.copy()
                inputs.append(_value_info(name, value.dtype, value.shape))
            results = [f"{name}{index}{way or ''}.out" for name in _ADAM_STATE]
            if way is None:
                nodes.append(helper.make_node("AdamOptimizer", node_inputs, results, domain=MS_DOMAIN,
                                              max_norm_clip=1.0, **attrs))
            else:
                nodes.append(helper.make_node(ADAM_OP, node_inputs, results, domain=DOMAIN, **attrs))
            for name, result in zip(_ADAM_STATE, results):
                outputs.append(_value_info(result, values[name].dtype, values[name].shape))
                if way is not None and way[1] and name != "count":
                    aliases[result] = f"{name}{index}{way}"
    session = _self_test_session(path, "adam_self_test", nodes, inputs, outputs)
    bound = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in feeds.items()}
    binding = session.io_binding()
    for name, value in bound.items():
        binding.bind_ortvalue_input(name, value)
    for output in outputs:
        if output.name in aliases:
            binding.bind_ortvalue_output(output.name, bound[aliases[output.name]])
        else:
            binding.bind_output(output.name)
    session.run_with_iobinding(binding)
    results = dict(zip([o.name for o in outputs], [v.numpy() for v in binding.get_outputs()]))
    for index, (_, mode, corrects, decay, count) in enumerate(_ADAM_CASES):
        scales = _adam_scale({name: feeds[f"{name}{index}"] for name in ("lr", "w", "g", "m1", "m2")},
                             mode, corrects, decay, count)
        for apply, aliased in ways:
            way = (apply, aliased)
            if results[f"count{index}{way}.out"][0] != (count + 1 if apply else count):
                return f"Adam's self-test case {index} {way}: the update count is wrong"
            for name in ("w", "m1", "m2"):
                got = bound[f"{name}{index}{way}"].numpy() if aliased else results[f"{name}{index}{way}.out"]
                if not apply:
                    if not np.array_equal(got, feeds[f"{name}{index}"]):
                        return f"Adam's self-test case {index} {way}: a skipped step changed {name}"
                    continue
                want = results[f"{name}{index}.out"]
                if not np.all(np.abs(got - want) <= _ADAM_ROUNDINGS * 2.0 ** -24 * scales[name]):
                    return (f"Adam's self-test case {index} {way}: {name} differs from AdamOptimizer's by "
                            f"{np.abs(got - want).max():.3g}")
            if not aliased and not np.array_equal(bound[f"w{index}{way}"].numpy(), feeds[f"w{index}"]):
                return f"Adam's self-test case {index} {way}: it wrote into its input W"
    return ""


def _adam_scale(v, mode, corrects, decay, count, alpha=0.9, beta=0.999, epsilon=1e-6):
    """{w, m1, m2: the magnitudes of the terms each update sums} (float64): an fp32 rounding of any
    step moves a result by at most 2^-24 of them."""
    g, m1, m2, w, lr = (v[k].astype(np.float64) for k in ("g", "m1", "m2", "w", "lr"))
    new_m1, new_m2 = alpha * m1 + (1 - alpha) * g, beta * m2 + (1 - beta) * g * g
    alpha_c, beta_c = (1 - alpha ** count, 1 - beta ** count) if corrects else (1.0, 1.0)
    if mode == 0:
        step = lr * (np.abs(new_m1 / alpha_c) / (np.sqrt(new_m2 / beta_c) + epsilon) + np.abs(decay * w))
    else:
        size = lr * np.sqrt(beta_c) / alpha_c
        direction = size * np.abs(new_m1) / (np.sqrt(new_m2) + epsilon)
        step = direction + lr * decay * (np.abs(w) + direction)
    return {"w": np.abs(w) + step, "m1": np.abs(alpha * m1) + np.abs((1 - alpha) * g),
            "m2": beta * m2 + (1 - beta) * g * g}
