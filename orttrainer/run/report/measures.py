"""Watching a run: TensorBoard scalars (`run.report_to`), model FLOPs per token, the measured matmul
rate that MFU is taken against, and the process's peak memory.

MFU = tokens/s x FLOPs per token / (ranks x measured fp32 matmul rate of one rank). FLOPs per token
(forward + backward) = 6 N + 12 L T d: N the weights of the matmuls every token goes through (Linear
and GPT-2 Conv1D weights, the output head tied to the word embeddings included; lookup tables and
biases are not matmuls), L layers, T = data.seq_length, d the hidden width (attention scores Q K^T
and their product with V: 2 x 2 T d per token and layer forward, twice that backward, the causal half
not discounted). Heads that only see the [CLS] token (pooler, NSP, classifier) are counted per token
too, a small overcount (docs/recipes.md).
"""

import os
import time
import warnings

TB_FOLDER = "tb"
REPORTERS = ("tensorboard",)


def run_key_problems(run):
    """Recipe lines about the `run` keys of this module that the schema cannot check."""
    steps = run["profile_steps"]
    if steps is not None and not 1 <= steps[0] <= steps[1] <= run["max_steps"]:
        return [f"run.profile_steps: got {steps}; expected [from, to] with 1 <= from <= to <= run.max_steps "
                f"({run['max_steps']})"]
    return []


def matmul_weights(model):
    """N: elements of the weights of every Linear / Conv1D (GPT-2's) module, each tensor once."""
    seen, total = set(), 0
    for module in model.modules():
        if type(module).__name__ in ("Linear", "Conv1D"):
            weight = module.weight
            if id(weight) not in seen:
                seen.add(id(weight))
                total += weight.numel()
    return total


def flops_per_token(model, seq_length):
    """Training FLOPs per token (forward + backward): 6 N + 12 L T d (module docstring)."""
    config = model.config
    layers = getattr(config, "n_layer", None) or config.num_hidden_layers
    width = getattr(config, "n_embd", None) or config.hidden_size
    return 6 * matmul_weights(model) + 12 * layers * seq_length * width


def matmul_gflops(threads, n=768, reps=5):
    """The fp32 matmul roof of one rank (GFLOP/s): the better of torch's and onnxruntime's best rate for
    an n x n product on `threads` threads (~0.2 s on 2 cores). The training graph's products run in
    onnxruntime (MLAS), which on a host with AVX-512 reaches twice torch's rate: a roof from torch alone
    would overstate MFU there."""
    threads = max(1, threads)
    return max(torch_matmul_gflops(n, reps, threads), onnxruntime_matmul_gflops(n, reps, threads))


def _best_rate(run, n, reps):
    """Best rate of an n x n x n matmul `run` over `reps` timed calls, after one warm-up call."""
    run()
    best = 0.0
    for _ in range(reps):
        started = time.perf_counter()
        run()
        best = max(best, 2 * n**3 / (time.perf_counter() - started) / 1e9)
    return best


def torch_matmul_gflops(n, reps, threads=None):
    """Best torch.matmul rate (GFLOP/s) on n x n fp32; `threads` None: torch's configured threads."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        return _best_rate(lambda: torch.matmul(a, b), n, reps)
    finally:
        torch.set_num_threads(before)


def onnxruntime_matmul_gflops(n, reps, threads=0):
    """Best onnxruntime MatMul rate (GFLOP/s, MLAS) on n x n fp32 in a session with the trainer's own
    options; `threads` 0: onnxruntime's default intra-op threads, as the trainer's sessions use."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from orttrainer.placement.device import default_session_options

    square = [n, n]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul",
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, square) for x in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, square)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # what this onnxruntime reads (onnx's default is newer)
    options = default_session_options()  # the process-wide arena, as the trainer's sessions use
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {x: np.random.default_rng(0).standard_normal(square, dtype=np.float32) for x in "ab"}
    return _best_rate(lambda: session.run(None, feeds), n, reps)


def run_threads():
    """The intra-op threads the run's onnxruntime sessions use (orttrainer._utils' choice)."""
    from orttrainer import _utils

    threads = _utils.intra_op_threads_per_rank()
    if threads:
        return threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def peak_rss_mb():
    """This process's peak resident memory (VmHWM of /proc/self/status) in MiB; None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Board:
    """TensorBoard event files under `folder` (torch.utils.tensorboard's SummaryWriter).

    `resume_step`: the step of the checkpoint a resumed run starts from; the writer's purge_step
    makes TensorBoard drop the events a crashed run wrote after it, so re-run steps replace them.
    A fresh run removes the folder's old event files (only those). Without the tensorboard package: one warning, None.
    """

    @staticmethod
    def open(folder, resume_step=None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            warnings.warn(f"run.report_to: tensorboard is not installed ({exc}); no TensorBoard events are "
                          "written, metrics.jsonl has every value (pip install tensorboard)", stacklevel=2)
            return None
        if resume_step is None:
            from orttrainer.run.run_folder import remove_tb_events

            remove_tb_events(folder)
        board = Board()
        purge = None if resume_step is None else resume_step + 1
        board.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        return board

    def scalars(self, prefix, record, step):
        for key, value in record.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and key not in ("kind", "step"):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()
