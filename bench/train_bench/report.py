"""Output of the benchmark: the progress log, the tables printed from a result, and --render of an
existing JSON report."""

import json
import os
import sys
import time

from . import host
from .measure import thread_mismatch, threads_running
from .systems import baselines_of, is_mixed


_T0 = time.perf_counter()


def log(msg):
    lead = msg[: len(msg) - len(msg.lstrip("\n"))]
    print(f"{lead}[{time.perf_counter() - _T0:6.1f}s] {msg.lstrip()}", file=sys.stderr, flush=True)


def fmt_g(x):
    return "n/a" if x is None else f"{x / 1e9:.2f} G"


def _others_during_steps(series):
    """Time-weighted mean of 'cores used by other processes' over measured steps: [(times, others)]."""
    total = sum(t for times, _ in series for t in times)
    busy = sum(t * o for times, others in series for t, o in zip(times, others))
    return busy / total if total else None


def table(result):
    out = result["systems"]
    names = list(out)  # the fp32 systems, then the mixed ones where they ran
    w = result["warmup_steps"]
    others = _others_during_steps(
        [(out[s]["step_times_s"][w:], out[s]["other_cores_per_step"][w:]) for s in names]
    )
    thr = result.get("quiet_threshold_cores")
    model_flops = result["model_flops_per_step"]
    lines = [
        f"\n## {result['model']}: {result['tokens_per_step']} tokens/step, "
        f"{result['model_flops_per_step'] / 1e9:.2f} GFLOP/step (model FLOPs"
        + "".join(f"; {s} performs {out[s]['flops_per_step'] / 1e9:.2f}" for s in names
                  if out[s].get("flops_per_step", model_flops) != model_flops)
        + "); "
        f"matmul roof {result['sgemm']['peak_gflops']:.1f} GFLOP/s "
        f"(sgemm best: torch {_num(result['sgemm'].get('torch_peak_gflops'), '{:.1f}')}, "
        f"onnxruntime MLAS {_num(result['sgemm'].get('mlas_best_gflops'), '{:.1f}')}; "
        f"torch median in the rounds {result['sgemm']['round_median_gflops']:.1f})"
        + (f"; bf16 matmul roof {result['sgemm']['bf16_peak_gflops']:.1f} GFLOP/s (torch bf16, the mixed "
           "systems' MFU)" if result["sgemm"].get("bf16_peak_gflops") else "")
        + "; "
        f"{result['measured_steps']} interleaved steps after {result['warmup_steps']} warm-up, "
        f"{result['quiet_rounds']} rounds fully quiet; other processes used {_num(others, '{:.2f}')} of "
        f"{os.cpu_count()} cores on average during the measured steps (load avg "
        f"{result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f})",
        "",
        f"Engine: orttrainer/ sha {result.get('engine_sources_sha256')}"
        + (
            f" (commit {result['git_commit'][:8]}{'+dirty' if result.get('engine_dirty') else ''})"
            if result.get("git_commit")
            else ""
        )
        + ". "
        f"Quiet = steps during which other processes used < {thr} cores; the run waited "
        f"{result.get('waited_for_quiet_s', 0):.0f} s in all for quiet moments before rounds.",
        "",
    ]
    def ratios(sname, ref):
        s, q = out[sname], out[sname].get("quiet") or {}
        void = thread_mismatch(out, sname, ref)
        if void:
            return f"n/a ({void})"
        return " / ".join([
            f"{s[f'speedup_vs_{ref}']:.2f}x",
            _num(q.get(f"speedup_vs_{ref}"), "{:.2f}x"),
            _num(s.get(f"quiet_paired_speedup_vs_{ref}"), "{:.2f}x"),
        ])

    # One table per precision: fp32 systems against fp32 eager/compile, mixed against the bf16 ones.
    for family in (False, True):
        members = [s for s in names if is_mixed(s) == family]
        if not members:
            continue
        refs = baselines_of(members[0])
        if family:
            lines += ["", "Mixed precision (MFU against the bf16 roof; the dtype each system computed in "
                      "is in brackets):", ""]
        header = (
            "| system | median step, all (ms) | median step, quiet (ms) [n] | tokens/s (quiet) "
            + "".join(f"| vs {ref}: all / quiet / paired-quiet " for ref in refs)
            + "| MFU: all / quiet | peak RSS steady (MB) | peak RSS incl. start-up (MB) | solo median (ms) "
            "| start-up (s) |"
        )
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        for sname in members:
            lines.append(_row(result, sname, refs, ratios))
    lines += [f"**MEASUREMENT ERROR: {e}**" for e in result.get("errors", [])]
    pairs = result.get("pairs") or {}
    if pairs:
        cells = [f"{pair} " + (f"n/a ({p['threads_differ']})" if p.get("threads_differ")
                               else f"{p['paired_speedup']:.2f}x") + f" ({' vs '.join(p['compute_dtypes'])})"
                 for pair, p in pairs.items()]
        lines += ["", "Pairs (paired median of step-time ratios, >1: orttrainer faster; compute dtypes): "
                  + "; ".join(cells)]
        dtype = (out.get("orttrainer-mixed") or {}).get("compute_dtype") or {}
        if dtype and dtype.get("dtype") == "float32":
            lines.append(
                "orttrainer-mixed computed in float32 (mixed_precision.compute_dtype resolved to "
                f"{dtype.get('resolved_option')}; no fp16/bf16 Casts in its training graph): its ratios to "
                "the bf16 systems compare fp32 compute with bf16 compute.")
    kernels = [(s, (out[s].get("compute_dtype") or {}).get("matmul_kernels")) for s in names]
    kernels = [f"{s} " + ", ".join(f"{k} {v}" for k, v in counts.items()) for s, counts in kernels if counts]
    if kernels:
        lines.append("Matrix products per kernel (ORTTrainer.matmul_kernels): " + "; ".join(kernels))
    st = out["orttrainer"]["startup"]
    parts = ", ".join(
        f"{k[:-2]} {v:.2f}" for k, v in st.items() if v is not None and k.endswith("_s") and k != "total_s"
    )
    busy = [out[s]["startup"].get("other_processes_cores") for s in names]
    lines += [
        "",
        f"Start-up (s): orttrainer {parts} = {st['total_s']:.2f}; "
        f"torch.compile compile (first step) {out['compile']['startup']['compile_s']:.2f}; "
        f"eager first step {out['eager']['startup']['first_step_s']:.2f}"
        + (
            " (other processes used " + " / ".join(_num(b, "{:.2f}") for b in busy) + " cores meanwhile)"
            if any(b is not None for b in busy)
            else ""
        ),
    ]
    lines.append(
        "Max |loss - eager loss| over all steps: "
        + ", ".join(f"{s} {out[s]['max_loss_diff_vs_eager']:.2e}" for s in names if s != "eager")
        + "".join(f"; {s} vs eager-bf16 {out[s]['max_loss_diff_vs_eager-bf16']:.2e}" for s in names
                  if s != "eager-bf16" and "max_loss_diff_vs_eager-bf16" in out[s])
    )
    if all("baseline_rss_mb" in (out[s].get("memory") or {}) for s in names):
        lines.append(
            "RSS before training (imports + model + batches), per child: "
            + ", ".join(f"{s} {out[s]['memory']['baseline_rss_mb']:.0f} MB" for s in names)
        )
    return "\n".join(lines)


def _row(result, sname, refs, ratios):
    s = result["systems"][sname]
    q = s.get("quiet") or {}
    m = s.get("memory") or {}
    label = sname
    if sname.startswith("compile"):
        label = f"torch.compile{sname[len('compile'):]} ({result['compile_backend']})"
    label += f" [{threads_running(s) if threads_running(s) is not None else 'n/a'} threads]"
    if is_mixed(sname):
        label += f" [{(s.get('compute_dtype') or {}).get('dtype', '?')}]"
    cells = [
        label,
        f"{s['median_s'] * 1e3:.1f}",
        f"{q['median_s'] * 1e3:.1f} [{q['n']}]" if q else "n/a",
        _num(q.get("tokens_per_s"), "{:.0f}"),
        *(ratios(sname, ref) for ref in refs),
        f"{s['mfu'] * 100:.1f}% / " + _num(q.get("mfu"), "{:.1f}%", 100),
        _num(m.get("steady_peak_rss_mb"), "{:.0f}"),
        _num(m.get("peak_rss_mb"), "{:.0f}"),
        _num(m.get("solo_median_s"), "{:.1f}", 1e3),
        f"{s['startup']['total_s']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _num(value, spec, scale=1.0):
    return "n/a" if value is None else spec.format(value * scale)


def scaling_table(scaling):
    basis = "quiet steps" if scaling.get("basis") == "quiet_median_s" else "all steps (too few quiet ones)"
    others = _others_during_steps([(r["step_times_s"], r["other_cores_per_step"]) for r in scaling["rows"]])
    lines = [
        f"\n## scaling: orttrainer, GPT (sizes interleaved step by step; other processes used "
        f"{_num(others, '{:.2f}')} cores on average during the steps; "
        f"step = median over {basis})",
        "",
        "| batch | seq | tokens | step (ms) | median, all steps (ms) | quiet steps | tokens/s | GFLOP/step "
        "| ms per GFLOP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in scaling["rows"]:
        lines.append(
            f"| {r['batch']} | {r['seq']} | {r['tokens']} | {r['step_s'] * 1e3:.1f} "
            f"| {r['median_s'] * 1e3:.1f} | {r['quiet_n']} | {r['tokens_per_s']:.0f} "
            f"| {r['model_flops'] / 1e9:.2f} | {r['ms_per_gflop']:.2f} |"
        )
    lines.append("")
    for key, what in (("fit_batch_sweep", "batch sweep"), ("fit_seq_sweep", "seq sweep")):
        fit = scaling.get(key)
        if fit:
            lines.append(
                f"Least-squares fit, {what}: step = {fit['fixed_s'] * 1e3:.1f} ms + "
                f"{fit['per_token_us']:.1f} us x tokens "
                f"(fixed part = {fit['fixed_share_at_middle'] * 100:.0f}% "
                f"of the middle point)"
            )
    fit = scaling.get("fit_all_vs_model_flops")
    if fit:
        lines.append(
            f"Least-squares fit, all points: step = {fit['fixed_s'] * 1e3:.1f} ms + "
            f"{fit['s_per_gflop'] * 1e3:.2f} ms x model GFLOP"
        )
    return "\n".join(lines)


def render(path):
    """Print the tables of an existing JSON report."""
    with open(path) as f:
        report = json.load(f)
    _print_report(report, [table(r) for r in report["results"].values()]
                  + ([scaling_table(report["scaling"])] if "scaling" in report else []), path)


def _print_report(report, tables, path):
    meta = report["meta"]
    print(
        f"# {meta['command']}  ({meta['time']}, "
        + (host.host_line(meta["host"]) if meta.get("host") else f"{meta['cpu']}, {meta['cpus']} CPUs")
        + f", torch {meta['torch']}, "
        f"onnxruntime {meta['onnxruntime']}, "
        f"engine {meta['git_commit'][:8] if meta['git_commit'] else '?'}"
        f"{'+dirty' if meta['engine_dirty'] else ''} sha {meta['engine_sources_sha256']})"
    )
    if meta.get("mixed_systems"):
        print(f"Mixed-precision systems: {meta['mixed_systems']}; bf16 CPU flags: "
              f"{'/'.join(meta.get('bf16_flags') or []) or 'none'}")
    print("\n".join(tables))
    print(f"\nJSON: {os.path.relpath(path, os.getcwd())}")
