"""Which matmul kernel is fastest on this host, per shape class of a GPT training step, and what it
costs to reach torch's kernels from inside an onnxruntime session (docs/notes/matmul-kernels-plan.md;
docs/ort-notes.md, "Matmuls on torch's kernels").

    python bench/studies/matmul_kernels/matmul_kernels.py [--part rates|pythonop|hold|all] [--threads 2] [--reps 5] [--quick]
                                   [--json OUT]

rates     GFLOP/s of onnxruntime's MLAS (a one-node MatMul / FusedMatMul session, run with IOBinding
          into a bound output, `threads` intra-op threads) against torch.matmul fp32 (into `out=`),
          torch bf16 on bf16 operands (what a graph computing in bf16 would run), and torch bf16 from
          fp32 operands with the casts in and out (what one bf16 node in an fp32 graph would cost), for
          the products of a GPT step at d256 (b8 x s128, h4) and d768 (b4 x s256, h12), vocab 8192:
          forward X.W, the backward's data gradient dY.W^T and weight gradient X^T.dY, and attention's
          batched products.
pythonop  per call: a plain MatMul node against the same product computed by torch inside the session
          through the engine's PythonOp runner (engine/pyop/python_op.py): in PythonOp's forward, and in a
          PythonOp/PythonOpGrad pair (the form engine/graph/torch_gelu_gradient.py uses), small and GPT-sized.
hold      whether onnxruntime keeps a torch-allocated output (PythonOp's, PythonOpGrad's) until the run
          ends: a chain of products, each read by the next node only; the holder count of each earlier
          product's storage (torch._C._storage_Use_Count) inside every later call, against the count
          once the run has returned.
"""

import argparse
import json
import os
import sys
import time
import weakref

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, ROOT)

from orttrainer.engine.pyop import python_op  # noqa: E402
from orttrainer.engine.pyop import runner_check  # noqa: E402

GPTS = {"d256": dict(d=256, heads=4, batch=8, seq=128), "d768": dict(d=768, heads=12, batch=4, seq=256)}
VOCAB = 8192


def shape_classes(name, d, heads, batch, seq):
    """(class, (batch dims), M, K, N, transA, transB) for one GPT step's products."""
    m, dh, bh = batch * seq, d // heads, batch * heads
    rows = []
    for layer, (k, n) in {"qkv": (d, 3 * d), "fc1": (d, 4 * d), "fc2": (4 * d, d), "head": (d, VOCAB)}.items():
        rows.append((f"{name} {layer} fwd X.W", (), m, k, n, 0, 0))
        rows.append((f"{name} {layer} dgrad dY.W^T", (), m, n, k, 0, 1))
        rows.append((f"{name} {layer} wgrad X^T.dY", (), k, m, n, 1, 0))
    rows.append((f"{name} attn scores Q.K^T (and dP)", (bh,), seq, dh, seq, 0, 1))
    rows.append((f"{name} attn context P.V (and dQ)", (bh,), seq, seq, dh, 0, 0))
    rows.append((f"{name} attn dV=P^T.dO (and dK)", (bh,), seq, seq, dh, 1, 0))
    return rows


def operands(batch, m, k, n, ta, tb, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*batch, *((k, m) if ta else (m, k)), generator=g).to(dtype)
    b = torch.randn(*batch, *((n, k) if tb else (k, n)), generator=g).to(dtype)
    return a, b


def _t(x, flag):
    return x.transpose(-1, -2) if flag else x


def best_seconds(fn, reps):
    time.sleep(0.05)  # let a previous session's intra-op threads stop spinning
    fn()
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def session(nodes, inputs, outputs, threads, domain_ms=True, spin=True):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opsets = [helper.make_opsetid("", 14)] + ([helper.make_opsetid("com.microsoft", 1)] if domain_ms else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if not spin:  # onnxruntime's threads spin after a run by default, on the cores torch is about to use
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def mlas_runner(batch, m, k, n, ta, tb, threads):
    """A one-node MLAS session (FusedMatMul when a side is transposed, as onnxruntime's TransposeMatMul
    fusion leaves the backward's products) run with IOBinding into a bound output."""
    a, b = operands(batch, m, k, n, ta, tb)
    info = lambda name, t: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(t.shape))  # noqa: E731
    out = np.empty((*batch, m, n), np.float32)
    if ta or tb:
        node = helper.make_node("FusedMatMul", ["a", "b"], ["c"], domain="com.microsoft", transA=ta, transB=tb)
    else:
        node = helper.make_node("MatMul", ["a", "b"], ["c"])
    sess = session([node], [info("a", a), info("b", b)], [info("c", torch.from_numpy(out))], threads, spin=False)
    binding = sess.io_binding()
    kept = (a.numpy(), b.numpy(), ort.OrtValue.ortvalue_from_numpy(out), out)  # bound by address
    binding.bind_cpu_input("a", kept[0])
    binding.bind_cpu_input("b", kept[1])
    binding.bind_ortvalue_output("c", kept[2])
    return lambda: (sess.run_with_iobinding(binding), kept)


def rates(args):
    torch.set_num_threads(args.threads)
    rows = []
    for name, gpt in GPTS.items():
        classes = shape_classes(name, **gpt)
        if args.quick:  # the smoke test: the attention classes of the small GPT (batched, transposed)
            classes = [c for c in classes if "attn" in c[0]] if name == "d256" else []
        for label, batch, m, k, n, ta, tb in classes:
            flops = 2 * m * k * n * int(np.prod(batch or (1,)))
            a, b = operands(batch, m, k, n, ta, tb)
            a16, b16 = a.bfloat16(), b.bfloat16()
            out, out16 = torch.empty(*batch, m, n), torch.empty(*batch, m, n, dtype=torch.bfloat16)

            def bf16_with_casts():
                torch.matmul(_t(a, ta).bfloat16(), _t(b, tb).bfloat16()).float()

            kernels = {
                "mlas_fp32": mlas_runner(batch, m, k, n, ta, tb, args.threads),
                "torch_fp32": lambda: torch.matmul(_t(a, ta), _t(b, tb), out=out),
                "torch_bf16": lambda: torch.matmul(_t(a16, ta), _t(b16, tb), out=out16),
                "torch_bf16_with_casts": bf16_with_casts,
            }
            rate = {k_: flops / best_seconds(fn, args.reps) / 1e9 for k_, fn in kernels.items()}
            fp32_winner = max(("mlas_fp32", "torch_fp32"), key=rate.get)
            rows.append({"class": label, "batch": list(batch), "m": m, "k": k, "n": n, "transA": ta, "transB": tb,
                         "gflop": flops / 1e9, "gflops": rate, "fp32_winner": fp32_winner,
                         "torch_over_mlas_fp32": rate["torch_fp32"] / rate["mlas_fp32"],
                         "bf16_over_best_fp32": rate["torch_bf16"] / rate[fp32_winner]})
            r = rows[-1]
            print(f"| {label} | {'x'.join(map(str, batch)) + ' x ' if batch else ''}{m}x{k}x{n} "
                  + " | ".join(f"{rate[k_]:.0f}" for k_ in kernels)
                  + f" | {fp32_winner} | {r['torch_over_mlas_fp32']:.2f} | {r['bf16_over_best_fp32']:.2f} |",
                  flush=True)
    return rows


# --------------------------------------------------------------------------- torch inside the session
class ForwardMatMul(torch.autograd.Function):
    """PythonOp's forward computes A.B (torch's allocation becomes the node's output)."""

    @staticmethod
    def forward(ctx, a, b):
        _note_call()
        return _made_here(torch.matmul(a, b))

    @staticmethod
    def backward(ctx, dy):
        return None, None


class PairMatMul(torch.autograd.Function):
    """The GELU form: PythonOp only registers ctx; PythonOpGrad(ctx, A, B) computes A.B (square B, so
    that the product has A's shape, which the runner checks a gradient against)."""

    @staticmethod
    def forward(ctx, a, b):
        # Two outputs: the runner hands backward one incoming gradient per forward output.
        return a.new_empty([0]), a.new_empty([0])

    @staticmethod
    def backward(ctx, a, b):
        _note_call()
        return _made_here(torch.matmul(a, b)), None


TRACE = [False]
_calls = []  # during a traced run: one entry per call, then "returned" once the run returned
_freed = {}  # product index -> the call count when its memory was freed


def _note_call():
    if TRACE[0]:
        _calls.append(len(_calls))


def _made_here(y):
    """`y` copied into memory whose release is observed: a numpy array (torch.from_numpy keeps it
    alive until the last tensor on it goes), with a finalizer that notes how many calls had started."""
    if not TRACE[0]:
        return y
    index, buffer = len(_calls) - 1, np.empty(tuple(y.shape), np.float32)
    weakref.finalize(buffer, lambda: _freed.setdefault(index, len(_calls)))
    tracked = torch.from_numpy(buffer)
    tracked.copy_(y)
    return tracked


def _fp(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def forward_nodes(func, a, b, y, i):
    return [helper.make_node(
        "PythonOp", [a, b], [f"ctx{i}", y], domain="com.microsoft", func_name=func, input_convention="dd",
        input_tensor_types=[TensorProto.FLOAT] * 2, input_tensor_ranks=[2, 2], input_requires_grads=[0, 0],
        output_tensor_types=[TensorProto.FLOAT], output_tensor_ranks=[2], training_mode=1, safe_run_mode=0)]


def pair_nodes(func, a, b, y, i):
    two = [TensorProto.FLOAT] * 2
    return [
        helper.make_node("PythonOp", [a, b], [f"ctx{i}", f"e{i}", f"f{i}"], domain="com.microsoft",
                         func_name=func, input_convention="dd", input_tensor_types=two, input_tensor_ranks=[2, 2],
                         input_requires_grads=[1, 0], output_tensor_types=two, output_tensor_ranks=[1, 1],
                         training_mode=1, safe_run_mode=0),
        helper.make_node("PythonOpGrad", [f"ctx{i}", a, b], [y, f"u{i}"], domain="com.microsoft", func_name=func,
                         input_tensor_types=two, input_tensor_ranks=[2, 2], output_convention="dd",
                         output_tensor_types=two, output_tensor_ranks=[2, 2], output_tensor_requires_grads=[1, 0],
                         safe_run_mode=0),
    ]


def chain_session(make, func, m, k, n, count, threads, spin=True):
    """`count` products in a chain: y_i = y_{i-1} . w (y_0 = x); only the last one is a graph output."""
    nodes = []
    for i in range(count):
        nodes += make(func, "x" if i == 0 else f"y{i - 1}", "w", f"y{i}", i)
    return session(nodes, [_fp("x", [m, k]), _fp("w", [k, n])], [_fp(f"y{count - 1}", [m, n])], threads, spin=spin)


def run_feeds(sess, feeds):
    with python_op.function_errors():
        return sess.run(None, feeds)


def pythonop_overhead(args):
    problem = runner_check.problem()
    if problem:
        raise SystemExit(f"the engine's PythonOp runners are disabled here: {problem}")
    python_op._install_runners()
    fwd, pair = python_op._register_function(ForwardMatMul), python_op._register_function(PairMatMul)
    rows = []
    shapes = {"tiny 16x16x16": (16, 16, 16), "small 64x64x64": (64, 64, 64),
              "d256 proj 1024x256x256": (1024, 256, 256), "d768 proj 1024x768x768": (1024, 768, 768)}
    if args.quick:
        shapes = dict(list(shapes.items())[:2])
    for label, (m, k, n) in shapes.items():
        x, w = np.random.default_rng(0).standard_normal((m, k), np.float32), np.random.default_rng(1).standard_normal(
            (k, n), np.float32)
        feeds = {"x": x, "w": w}
        times = {}
        xt, wt = torch.from_numpy(x), torch.from_numpy(w)
        for torch_threads in (1, args.threads):
            torch.set_num_threads(torch_threads)
            times[f"torch_direct_t{torch_threads}"] = best_seconds(lambda: torch.matmul(xt, wt), args.reps * 4)
        for spin in (True, False):  # spinning: onnxruntime's default, what the trainer's sessions do
            tag = "" if spin else "_nospin"
            plain = session([helper.make_node("MatMul", ["x", "w"], ["y0"])], [_fp("x", [m, k]), _fp("w", [k, n])],
                            [_fp("y0", [m, n])], args.threads, domain_ms=False, spin=spin)
            times[f"mlas_node{tag}"] = best_seconds(lambda: plain.run(None, feeds), args.reps * 4)
            for torch_threads in (1, args.threads):
                torch.set_num_threads(torch_threads)
                for form, make, func in (("pythonop_fwd", forward_nodes, fwd), ("pair", pair_nodes, pair)):
                    sess = chain_session(make, func, m, k, n, 1, args.threads, spin=spin)
                    expected = x @ w
                    got = run_feeds(sess, feeds)[0]
                    assert np.allclose(got, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max()), form
                    times[f"{form}_t{torch_threads}{tag}"] = best_seconds(lambda: run_feeds(sess, feeds),
                                                                         args.reps * 4)
        torch.set_num_threads(args.threads)
        row = {"shape": label, "m": m, "k": k, "n": n, "gflop": 2 * m * k * n / 1e9, "best_ms":
               {key: t * 1e3 for key, t in times.items()}}
        rows.append(row)
        print(f"| {label} | " + " | ".join(f"{key} {t * 1e3:.3f}" for key, t in times.items()) + " |", flush=True)
    return rows


def hold(args):
    """In a chain of 8 products (each read by the next node only), when each product's memory is freed:
    product j (made in call j) is read by call j + 1 only, so onnxruntime could free it before call
    j + 2. A count of 8 = freed in or after the last call, 9 = after the run returned."""
    python_op._install_runners()
    fwd, pair = python_op._register_function(ForwardMatMul), python_op._register_function(PairMatMul)
    n, count, out = 256, 8, {}
    feeds = {"x": np.full((n, n), 1.0 / n, np.float32), "w": np.eye(n, dtype=np.float32)}
    for form, make, func in (("PythonOp output", forward_nodes, fwd), ("PythonOpGrad output", pair_nodes, pair)):
        sess = chain_session(make, func, n, n, n, count, args.threads)
        run_feeds(sess, feeds)  # warm
        _calls.clear()
        _freed.clear()
        TRACE[0] = True
        result = run_feeds(sess, feeds)
        calls = len(_calls)
        _calls.append("returned")  # a product freed from here on was freed after the run
        TRACE[0] = False
        freed = {j: _freed.get(j) for j in range(calls)}  # None: still alive (the run's output, numpy)
        del result
        held = [j for j in range(calls - 2) if freed[j] is not None and freed[j] >= calls]
        out[form] = {"calls": calls, "calls_started_when_freed": freed, "held_to_run_end": held}
        print(f"{form}: calls started when product j was freed (j=0..{calls - 1}): "
              + ", ".join(str(freed[j]) for j in range(calls))
              + f"; held to the run's end although no longer read: {len(held)} of {calls - 2}", flush=True)
        del sess
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["rates", "pythonop", "hold", "all"], default="all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smoke run: a few small shape classes")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "matmul_kernels.json"))
    args = p.parse_args(argv)
    ort.set_default_logger_severity(3)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    report = {"threads": args.threads, "torch": torch.__version__, "onnxruntime": ort.__version__,
              "loadavg_start": load, "onnx": onnx.__version__}
    if args.part in ("rates", "all"):
        print("| class | shape | mlas_fp32 | torch_fp32 | torch_bf16 | torch_bf16_with_casts | fp32 winner "
              "| torch/MLAS fp32 | bf16/best fp32 |\n|---|---|---|---|---|---|---|---|---|")
        report["rates"] = rates(args)
    if args.part in ("pythonop", "all"):
        report["pythonop"] = pythonop_overhead(args)
    if args.part in ("hold", "all"):
        report["hold"] = hold(args)
    with open("/proc/loadavg") as f:
        report["loadavg_end"] = f.read().split()[:3]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"load {' '.join(load)} -> {' '.join(report['loadavg_end'])}; JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
