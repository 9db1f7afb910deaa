"""`orttrainer plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: loss, learning rate and throughput
against the step, from each run's metrics.jsonl, several runs overlaid (see docs/recipes.md).

Bad input (a folder without metrics.jsonl, a run that logged nothing) prints one line and exits 2.
"""

import sys


def register(subparsers):
    parser = subparsers.add_parser("plot", help="plot the curves of one or more runs (PNG)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", metavar="FILE.png",
                        help="default: RUN_DIR/curves.png for one run, curves.png here for several")
    parser.set_defaults(func=run)


def run(args):
    from pathlib import Path

    from orttrainer.run.report.plots import CURVES_FILE, PlotError, plot_runs

    out = args.out or (str(Path(args.runs[0]) / CURVES_FILE) if len(args.runs) == 1 else CURVES_FILE)
    try:
        plot_runs(args.runs, out)
    except (PlotError, OSError) as exc:
        print(f"orttrainer plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
