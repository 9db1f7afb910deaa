"""The benchmark (bench/train_bench.py) and the step profiler (bench/profile_ort.py) still run.

Smoke mode only (tiny models, a few steps): checks that every documented field is in the JSON and is
sane. No timing is asserted: the machine is shared and noisy.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "train_bench.py")
PROFILE = os.path.join(ROOT, "bench", "profile_ort.py")
SYSTEMS = ("orttrainer", "eager", "compile")


def _run(script, *args, timeout=900):
    proc = subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert (
        proc.returncode == 0
    ), f"{script} failed:\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc.stdout


def _positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_model(result, memory):
    assert result["model_flops_per_step"] > 0 and result["tokens_per_step"] > 0
    assert _positive(result["sgemm"]["peak_gflops"]) and _positive(result["sgemm"]["round_median_gflops"])
    for name in SYSTEMS:
        system = result["systems"][name]
        for key in (
            "median_s",
            "iqr_s",
            "tokens_per_s",
            "speedup_vs_eager",
            "speedup_vs_compile",
            "mfu",
            "mfu_vs_round_median_sgemm",
            "achieved_gflops",
        ):
            assert key in system and math.isfinite(system[key]), (name, key)
        assert (
            _positive(system["median_s"]) and _positive(system["tokens_per_s"]) and _positive(system["mfu"])
        )
        assert len(system["step_times_s"]) == result["warmup_steps"] + result["measured_steps"]
        assert all(math.isfinite(loss) for loss in system["losses"])
        assert _positive(system["startup"]["total_s"])
        if memory:
            mem = system["memory"]
            assert "error" not in mem, mem
            for key in ("baseline_rss_mb", "peak_rss_mb", "steady_peak_rss_mb", "solo_median_s"):
                assert _positive(mem[key]), (name, key, mem)
            assert mem["peak_rss_mb"] >= mem["steady_peak_rss_mb"] * 0.999
    startup = result["systems"]["orttrainer"]["startup"]
    for key in ("export_s", "training_graph_s", "session_s", "first_step_s", "other_s", "total_s"):
        assert key in startup and startup[key] is not None, key
    assert _positive(result["systems"]["compile"]["startup"]["compile_s"])
    assert result["systems"]["eager"]["speedup_vs_eager"] == pytest.approx(1.0)
    # Same weights, batches and optimizer: the GPT model has no dropout, so the three agree closely.
    if result["model"] == "gpt":
        for name in ("orttrainer", "compile"):
            assert result["systems"][name]["max_loss_diff_vs_eager"] < 1e-3, name


def test_bench_quick_gpt_with_scaling(tmp_path):
    out = tmp_path / "gpt.json"
    stdout = _run(BENCH, "--model", "gpt", "--quick", "--scaling", "--json", str(out))
    assert "| orttrainer |" in stdout and "scaling" in stdout
    report = json.loads(out.read_text())
    assert report["meta"]["quick"] is True and report["meta"]["torch"]
    _check_model(report["results"]["gpt"], memory=True)
    rows = report["scaling"]["rows"]
    assert len(rows) == 5 and all(_positive(r["median_s"]) and _positive(r["tokens_per_s"]) for r in rows)
    assert report["scaling"]["fit_batch_sweep"] is not None


def test_bench_quick_bert(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bert.json"
    _run(BENCH, "--model", "bert", "--quick", "--no-memory", "--steps", "2", "--json", str(out))
    _check_model(json.loads(out.read_text())["results"]["bert"], memory=False)


def test_profile_quick_gpt(tmp_path):
    out = tmp_path / "profile.json"
    stdout = _run(PROFILE, "--quick", "--json", str(out))
    assert "Top 15 op types" in stdout
    result = json.loads(out.read_text())
    clocks = result["clocks"]
    for key in (
        "train_step_ms",
        "runtime_run_ms",
        "run_with_iobinding_ms",
        "profile_model_run_ms",
        "kernel_sum_ms",
        "unprofiled_train_step_ms",
    ):
        assert _positive(clocks[key]), key
    assert clocks["train_step_ms"] >= clocks["runtime_run_ms"] >= clocks["run_with_iobinding_ms"]
    assert result["op_types"] and result["nodes"]
    assert abs(sum(o["share"] for o in result["op_types"]) - 1) < 1e-6


def test_gelu_grad_kernels_runs_and_agrees():
    out = _run(os.path.join(ROOT, "bench", "gelu_grad_kernels.py"), "--reps", "1", timeout=120)
    diffs = [float(line.split("max |diff|")[1]) for line in out.splitlines() if "max |diff|" in line]
    assert len(diffs) == 4 and max(diffs) < 1e-5, out


def test_gradient_kernels_runs_and_agrees():
    out = _run(os.path.join(ROOT, "bench", "gradient_kernels.py"), "--reps", "1", timeout=300)
    diffs = [float(line.split("max |diff|")[1]) for line in out.splitlines() if "max |diff|" in line]
    assert len(diffs) == 6 and max(diffs) < 1e-3, out


def test_memory_probe_runs():
    out = _run(os.path.join(ROOT, "bench", "memory_probe.py"), "--model", "gpt", "--steps", "1", timeout=300)
    assert "after export" in out and "after 1 steady steps" in out, out


def test_liveness_counts_the_described_logits():
    """bench/liveness.py: a described logits output stays alive through the peak; the loss alone does not."""
    peaks = {}
    for outputs in ("loss", "all"):
        out = _run(os.path.join(ROOT, "bench", "liveness.py"), "--model", "gpt", "--quick", "--ort-outputs",
                   outputs, timeout=300)
        peaks[outputs] = float(re.search(r"peak of live tensors ([\d.]+) MB", out).group(1))
        assert ("logits" in out) == (outputs == "all"), out
    assert peaks["all"] >= peaks["loss"], peaks


def test_distributed_bench_runs_every_setting(tmp_path):
    """bench/distributed_bench.py: 1 process and 2 ranks (DP, ZeRO-1); ZeRO-1 keeps half the moments."""
    _run(os.path.join(ROOT, "bench", "distributed_bench.py"), "--model", "gpt", "--quick", "--out", str(tmp_path),
         timeout=600)
    rows = {row["setting"]: row for row in json.loads((tmp_path / "gpt.json").read_text())["rows"]}
    assert len(rows) == 4 and all(_positive(row["tokens_per_s"]) for row in rows.values())
    dp, zero = rows["2 ranks x 1 thread, DP"], rows["2 ranks x 1 thread, ZeRO-1"]
    for row in (dp, zero):
        assert 0 < row["communication_share"] < 1 and 0 < row["micro_share"] < 1
    assert zero["optimizer_state_mb"][0] == pytest.approx(dp["optimizer_state_mb"][0] / 2, rel=0.01)
