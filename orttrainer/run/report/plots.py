"""Curves of one or more runs from their metrics.jsonl: `orttrainer plot` and each run's curves.png.

Panels against the step: train loss (lines) with eval loss (markers), learning rate, throughput
(tokens/s). Several runs share the panels, one colour each, named by their folder in the legend.
The last record of a step wins, so a run resumed after a crash plots as one continuous curve.
"""

import io
from pathlib import Path

from orttrainer.run.report.reporter import METRICS_FILE, read_metrics, write_durably

CURVES_FILE = "curves.png"


class PlotError(Exception):
    """A run folder that cannot be plotted, or no matplotlib; the message is one line."""


def read_curves(folder):
    """{"train": {step: record}, "eval": {step: record}} of a run folder's metrics.jsonl."""
    path = Path(folder) / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{folder}: no {METRICS_FILE} (not a run folder, or the run logged no step yet)")
    curves = {"train": {}, "eval": {}}
    for record in read_metrics(path):
        kind = record.get("kind")
        if kind in curves and isinstance(record.get("step"), int):
            curves[kind][record["step"]] = record
    if not curves["train"] and not curves["eval"]:
        raise PlotError(f"{folder}: {METRICS_FILE} holds no train or eval record")
    return curves


def _series(records, key):
    steps = sorted(s for s, r in records.items() if isinstance(r.get(key), (int, float)))
    return steps, [records[s][key] for s in steps]


def plot_runs(folders, out):
    """Draw the curves of `folders` into the PNG file `out`; PlotError on bad input."""
    runs = [(Path(folder).resolve().name, read_curves(folder)) for folder in folders]
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    try:
        for index, (name, curves) in enumerate(runs):
            colour = f"C{index % 10}"
            train, evaluation = curves["train"], curves["eval"]
            axes[0].plot(*_series(train, "loss"), color=colour, label=f"{name} train")
            steps, values = _series(evaluation, "eval_loss")
            if steps:
                axes[0].plot(steps, values, "o--", color=colour, label=f"{name} eval")
            axes[1].plot(*_series(train, "lr"), color=colour, label=name)
            axes[2].plot(*_series(train, "tokens_per_s"), color=colour, label=name)
        for ax, title in zip(axes, ("loss", "learning rate", "throughput (tokens/s)")):
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        fig.tight_layout()
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80)
        write_durably(out, png.getvalue())  # never through a link at `out`
    finally:
        plt.close(fig)
    return out
