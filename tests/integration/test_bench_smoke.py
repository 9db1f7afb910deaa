"""The benchmark (bench/train_bench/, run as bench/train_bench.py) and the studies the docs cite still run.

Smoke mode only (tiny models, a few steps): checks that every documented field is in the JSON and is
sane. No timing is asserted: the machine is shared and noisy.
"""

import importlib
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "train_bench.py")
SYSTEMS = ("orttrainer", "eager", "compile")
MIXED = ("orttrainer-mixed", "eager-bf16", "compile-bf16")
BF16_ROUNDING = 2**-8  # bf16 keeps 8 significant bits: one rounding is off by at most 2**-9 relative


def _run(script, *args, timeout=900):
    """`python SCRIPT ARGS` (SCRIPT a path, or "-m" and a module) from the repository root."""
    proc = subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert (
        proc.returncode == 0
    ), f"{script} failed:\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc.stdout


def _positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_model(result, memory, systems=SYSTEMS):
    assert result["model_flops_per_step"] > 0 and result["tokens_per_step"] > 0
    assert _positive(result["sgemm"]["peak_gflops"]) and _positive(result["sgemm"]["round_median_gflops"])
    sgemm = result["sgemm"]
    assert sgemm["peak_gflops"] == max(sgemm["torch_peak_gflops"], sgemm["mlas_best_gflops"])
    assert list(result["systems"]) == list(systems) == result["system_names"]
    for name in systems:
        system = result["systems"][name]
        refs = ("eager-bf16", "compile-bf16") if name in MIXED else ("eager", "compile")
        for key in (
            "median_s",
            "iqr_s",
            "tokens_per_s",
            *(f"speedup_vs_{ref}" for ref in refs),
            *(f"paired_speedup_vs_{ref}" for ref in refs),
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
        # Every system counts the OS threads it really kept busy (at least the stepping thread).
        assert system["threads"]["threads_running"] >= 1, system["threads"]
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
    stdout = _run(BENCH, "--model", "gpt", "--quick", "--scaling", "--mixed", "off", "--json", str(out))
    assert "| orttrainer [" in stdout and "scaling" in stdout
    report = json.loads(out.read_text())
    assert report["meta"]["quick"] is True and report["meta"]["torch"]
    host = report["meta"]["host"]
    assert host["usable_cpus"] >= 1 and host["torch_threads"] >= 1 and "affinity" in host
    _check_model(report["results"]["gpt"], memory=True)
    rows = report["scaling"]["rows"]
    # --quick sweeps two batch sizes at one seq (bench/train_bench/scaling.py): each point built, stepped and fitted.
    batch = rows[0]["batch"]
    assert len({r["seq"] for r in rows}) == 1 and [r["batch"] for r in rows] == [batch, 2 * batch]
    assert all(_positive(r["median_s"]) and _positive(r["tokens_per_s"]) for r in rows)
    assert len(rows[0]["step_times_s"]) == report["results"]["gpt"]["warmup_steps"] + 2  # quick: 2 sweep steps
    assert report["scaling"]["fit_batch_sweep"] is not None


def test_bench_quick_bert(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bert.json"
    _run(BENCH, "--model", "bert", "--quick", "--no-memory", "--steps", "2", "--mixed", "off", "--json", str(out))
    bert = json.loads(out.read_text())["results"]["bert"]
    _check_model(bert, memory=False)
    # MFU counts what each system performs: orttrainer's decoder runs on the labelled rows only
    systems = bert["systems"]
    assert systems["eager"]["flops_per_step"] == systems["compile"]["flops_per_step"] == bert["model_flops_per_step"]
    assert 0 < systems["orttrainer"]["flops_per_step"] < bert["model_flops_per_step"]


def test_bench_quick_gpt_mixed(tmp_path):
    """--mixed on: eager-bf16 and compile-bf16 (autocast bf16) and orttrainer-mixed train beside the fp32
    three; the report pairs fp32 with fp32 and mixed with bf16, records the bf16 roof and the dtype each
    system really computed in, and says so when orttrainer-mixed computed in fp32."""
    out = tmp_path / "gpt.json"
    stdout = _run(BENCH, "--model", "gpt", "--quick", "--mixed", "on", "--steps", "2", "--json", str(out))
    report = json.loads(out.read_text())
    meta, gpt = report["meta"], report["results"]["gpt"]
    assert meta["mixed_systems"].startswith("on")
    assert set(meta["bf16_flags"]) <= set(meta["host"]["kernel_flags"]) | {"amx_tile"}
    _check_model(gpt, memory=True, systems=SYSTEMS + MIXED)
    sgemm, systems = gpt["sgemm"], gpt["systems"]
    assert sgemm["bf16_peak_gflops"] == max(sgemm["bf16_best_before_gflops"], sgemm["bf16_best_after_gflops"]) > 0
    for name in SYSTEMS + MIXED:  # each precision's MFU against its own roof
        s = systems[name]
        roof = sgemm["bf16_peak_gflops"] if name in MIXED else sgemm["peak_gflops"]
        assert s["mfu_roof"] == ("bf16" if name in MIXED else "fp32")
        assert s["mfu"] == pytest.approx(s["flops_per_step"] / s["median_s"] / 1e9 / roof)
    assert [systems[n]["compute_dtype"]["dtype"] for n in ("eager", "compile", "eager-bf16", "compile-bf16")] \
        == ["float32", "float32", "bfloat16", "bfloat16"]
    # Autocast really ran (bf16 losses differ from fp32's), within bf16 rounding of the fp32 loss.
    eager, bf16 = systems["eager"]["losses"], systems["eager-bf16"]["losses"]
    assert systems["eager-bf16"]["max_loss_diff_vs_eager"] > 0
    assert bf16 == pytest.approx(eager, rel=4 * BF16_ROUNDING)
    assert systems["compile-bf16"]["losses"] == pytest.approx(bf16, rel=4 * BF16_ROUNDING)
    mixed = systems["orttrainer-mixed"]
    if mixed["compute_dtype"]["dtype"] == "float32":  # today's CPU trainer: the report must say so
        assert mixed["compute_dtype"]["low_precision_casts"] == {}
        assert mixed["max_loss_diff_vs_eager"] < 1e-3  # fp32 compute (a loss scale is a power of 2)
        assert "orttrainer-mixed computed in float32" in stdout
    else:
        assert mixed["losses"] == pytest.approx(bf16, rel=4 * BF16_ROUNDING)
    pairs = gpt["pairs"]
    assert list(pairs) == ["orttrainer/eager", "orttrainer/compile", "orttrainer-mixed/eager-bf16",
                           "orttrainer-mixed/compile-bf16"]
    for pair, p in pairs.items():
        ort_name, ref = pair.split("/")
        assert p["paired_speedup"] == systems[ort_name][f"paired_speedup_vs_{ref}"] > 0
        assert p["compute_dtypes"] == [systems[ort_name]["compute_dtype"]["dtype"],
                                       systems[ref]["compute_dtype"]["dtype"]]
    assert "| vs eager-bf16: all" in stdout and "| eager-bf16 [" in stdout and "Pairs (" in stdout


def test_mixed_systems_follow_the_cpu_flags():
    """--mixed auto offers the bf16 systems on CPUs with a bf16 matrix unit only (flags faked)."""
    systems = _bench_module("systems")
    fp32, every = SYSTEMS, SYSTEMS + MIXED
    assert systems.systems_for_host("auto", ["avx2", "avx512f"])[0] == fp32
    for flag in ("avx512_bf16", "amx_bf16"):
        names, why = systems.systems_for_host("auto", ["avx2", flag])
        assert names == every and flag in why
    assert systems.systems_for_host("on", ["avx2"])[0] == every
    assert systems.systems_for_host("off", ["amx_bf16"])[0] == fp32
    assert "--mixed on" in systems.systems_for_host("auto", [])[1]


def test_distributed_bench_runs_every_setting(tmp_path):
    """bench/studies/distributed_bench/distributed_bench.py: 1 process and 2 ranks (DP, ZeRO-1); ZeRO-1 keeps
    half the moments."""
    _run(os.path.join(ROOT, "bench", "studies", "distributed_bench", "distributed_bench.py"), "--model", "gpt", "--quick",
         "--out", str(tmp_path),
         timeout=600)
    rows = {row["setting"]: row for row in json.loads((tmp_path / "gpt.json").read_text())["rows"]}
    assert len(rows) == 4 and all(_positive(row["tokens_per_s"]) for row in rows.values())
    dp, zero = rows["2 ranks x 1 thread, DP"], rows["2 ranks x 1 thread, ZeRO-1"]
    for row in (dp, zero):
        assert 0 < row["communication_share"] < 1 and 0 < row["micro_share"] < 1
    assert zero["optimizer_state_mb"][0] == pytest.approx(dp["optimizer_state_mb"][0] / 2, rel=0.01)


def _bench_module(name):
    """bench/train_bench/<name>.py as bench.train_bench.<name> ("train_bench": its cli)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"bench.train_bench.{'cli' if name == 'train_bench' else name}")


def _fake_systems(threads, mfu, names=SYSTEMS):
    out = {}
    for name, n in zip(names, threads):
        out[name] = {"mfu": mfu.get(name, 0.5), "quiet": None, "threads": {"threads_running": n},
                     "speedup_vs_eager": 1.0, "speedup_vs_compile": 1.0}
    return out


def test_measurement_errors_flag_mfu_above_roof_and_thread_mismatch():
    tb = _bench_module("train_bench")
    assert tb.measurement_errors(_fake_systems((2, 2, 2), {})) == []
    errors = tb.measurement_errors(_fake_systems((2, 2, 2), {"orttrainer": 1.08}))
    assert len(errors) == 1 and "MFU 108%" in errors[0] and "roof" in errors[0]
    errors = tb.measurement_errors(_fake_systems((4, 2, 2), {}))
    assert len(errors) == 2 and all("threads differ: orttrainer 4" in e for e in errors)
    assert tb.thread_mismatch(_fake_systems((4, 2, 2), {}), "eager", "compile") is None
    # Mixed systems are paired with the bf16 ones only: orttrainer-mixed on 3 threads voids its two ratios.
    errors = tb.measurement_errors(_fake_systems((2, 2, 2, 3, 2, 2), {"eager-bf16": 1.2}, SYSTEMS + MIXED))
    assert len(errors) == 3 and "eager-bf16: MFU 120%" in errors[0]
    assert errors[1:] == [f"no ratio orttrainer-mixed vs {ref}: threads differ: orttrainer-mixed 3, {ref} 2"
                          for ref in ("eager-bf16", "compile-bf16")]


def test_thread_activity_counts_a_busy_thread():
    """The reference is the thread's own clock (time.thread_time), not the machine's load: under a
    heavy load the spinning thread can get under ACTIVE_SHARE of a core, and then must not count."""
    host = _bench_module("host")
    import threading
    import time

    activity = host.ThreadActivity()
    stop = time.perf_counter() + 0.3
    used = {}

    def spin():
        t0 = time.thread_time()
        while time.perf_counter() < stop:
            pass
        used[threading.get_native_id()] = time.thread_time() - t0

    with activity.measuring():
        worker = threading.Thread(target=spin)
        worker.start()
        spin()
        worker.join(timeout=60)
    main = threading.get_native_id()
    tick = 1 / os.sysconf("SC_CLK_TCK")  # /proc counts CPU time in clock ticks
    assert activity.cpu_s[main] == pytest.approx(used[main], abs=3 * tick + 0.1 * used[main]), (activity.cpu_s, used)
    # A thread that clearly had ACTIVE_SHARE of the interval is counted (the worker, ended before the
    # interval closed, may be gone from /proc).
    if used[main] > host.ACTIVE_SHARE * activity.wall_s + 3 * tick:
        assert activity.running() >= 1, (activity.cpu_s, used, activity.wall_s)
    facts = host.host_facts()
    assert facts["usable_cpus"] == len(os.sched_getaffinity(0)) and facts["torch_threads"] >= 1
    assert host.sgemm_mlas(128, 2) > 0 and host.sgemm_torch(128, 2) > 0


def test_real_size_runs_tiny(tmp_path):
    """bench/train_bench/real_size.py end to end on a 1-layer, 64-wide GPT-2: orttrainer and eager in fresh
    processes train the same model on the same batches, so their losses must agree (the reference);
    every phase and peak the docs quote is in the JSON."""
    out = tmp_path / "real_size.json"
    _run("-m", "bench.train_bench.real_size", "--model", "gpt2", "--layers", "1", "--hidden", "64",
         "--vocab", "512", "--batch", "2", "--seq", "16", "--steps", "1", "--out", str(out), timeout=600)
    result = json.loads(out.read_text())
    assert result["sizes"] == {"hidden": 64, "vocab": 512, "batch": 2, "seq": 16} and result["layers"] == 1
    ort, eager = result["results"]
    assert (ort["system"], eager["system"]) == ("ort", "eager")
    assert len(ort["losses"]) == len(eager["losses"]) == 2
    assert ort["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert ort["losses"][1] < ort["losses"][0]  # it trained
    for r in (ort, eager):
        assert _positive(r["first_step_s"]) and len(r["step_s"]) == 1
        assert r["peak_mb"] == max(r["startup_peak_mb"], r["steady_peak_mb"] or 0) and r["peak_mb"] > 0
    for r in (ort, eager):  # memory read from /proc and glibc only: no marks inside the trainer's start-up
        phases = r["phases"]
        assert list(phases) == ["baseline", "after_first_step", "end"]
        for phase in phases.values():
            assert phase["hwm_mb"] >= phase["rss_mb"] and phase["heap_mb"] >= phase["used_mb"] > 0
        assert phases["after_first_step"]["hwm_mb"] == pytest.approx(r["startup_peak_mb"], abs=1)


def test_scale_curve_quick_writes_every_point(tmp_path):
    """bench/train_bench/scale_curve.py --quick: every planned (point, system) ran through real_size and is in the
    JSON with its peaks; orttrainer and eager trained the same model on the same batches (losses agree);
    the PNG is written. No timing is asserted."""
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    stdout = _run("-m", "bench.train_bench.scale_curve", "--quick", "--jobs", "3", "--out", str(out),
                  "--png", str(png), timeout=300)
    assert "host:" in stdout
    report = json.loads(out.read_text())
    assert report["quick"] is True and len(report["load_start"]) == 3 and report["host_line"]
    points = report["points"]
    shapes = {(p["layers"], p["hidden"], p["seq"]) for p in points}
    assert shapes == {(1, 64, 16), (2, 64, 16), (1, 64, 32)}
    assert sum("params" in p["axes"] for p in points) == 2 and sum("seq" in p["axes"] for p in points) == 2
    for p in points:
        runs = {r["system"]: r for r in p["runs"]}
        assert set(runs) == {"ort", "eager"}, p
        for r in runs.values():
            assert r["status"] == "ok", r
            assert r["params_measured"] == p["params"]  # the script's own count matches the model's
            assert r["peak_mb"] > 0 and len(r["step_s"]) == 1 and len(r["load_at_end"]) == 3
        assert runs["ort"]["losses"] == pytest.approx(runs["eager"]["losses"], rel=1e-5)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(f"| {p['label']} |" in stdout for p in points)  # the docs' table, one row per point


def test_scale_curve_skips_what_does_not_fit(tmp_path):
    """A point whose estimated peak exceeds the machine less --reserve-gib is not started: skipped with the
    reason printed and kept in the JSON (here every point: the reserve is larger than any machine)."""
    out = tmp_path / "scale.json"
    stdout = _run("-m", "bench.train_bench.scale_curve", "--quick", "--reserve-gib", "100000",
                  "--out", str(out), "--png", str(tmp_path / "scale.png"), timeout=120)
    points = json.loads(out.read_text())["points"]
    assert len(points) == 3 and stdout.count("skip ") == 3
    for p in points:
        assert [r["status"] for r in p["runs"]] == ["skipped", "skipped"]
        assert "estimated peak" in p["runs"][0]["reason"] and "--reserve-gib" in p["runs"][0]["reason"]


def test_host_kind_names_the_result_files(tmp_path):
    """Result JSONs are named <benchmark>-<host kind>-<UTC date>.json; the kind comes from /proc/cpuinfo's
    vendor and flags (AMX before AVX-512 before AVX2); a name taken gets -b, -c, ..."""
    host = _bench_module("host")
    assert host.host_kind("GenuineIntel", {"avx2", "avx512f", "amx_bf16"}) == "intel-amx"
    assert host.host_kind("GenuineIntel", {"avx2", "avx512f"}) == "intel-avx512"
    assert host.host_kind("AuthenticAMD", {"avx2", "avx512f", "avx512_bf16"}) == "amd-avx512"
    assert host.host_kind("AuthenticAMD", {"avx2", "fma"}) == "amd-avx2"
    facts = {"host_kind": "amd-avx2"}
    first = host.result_path("train_bench", facts, folder=str(tmp_path))
    assert os.path.basename(first).startswith("train_bench-amd-avx2-20") and first.endswith(".json")
    open(first, "w").close()
    assert host.result_path("train_bench", facts, folder=str(tmp_path)) == first[:-5] + "-b.json"
