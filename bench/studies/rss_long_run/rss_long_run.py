"""Resident memory of a long `orttrainer train` run: does anything grow per step?

Runs the tiny BERT recipe at test sizes (hidden 64, seq 64, batch 8) for --steps optimizer steps
through the recipe loop (metrics.jsonl line every step, progress bar on, a checkpoint every 500
steps, rotation) and samples the process's RSS every 50 steps. Prints the samples and the growth per
1000 steps from the end of warm-up (the first 10% of steps) and over the second half.

    .venv/bin/python bench/studies/rss_long_run/rss_long_run.py --steps 3000
"""

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class FakeTerminal(io.StringIO):
    """The progress bar only draws on a terminal; keep its output from growing in memory."""

    def isatty(self):
        return True

    def write(self, text):
        self.seek(0)
        self.truncate()
        return super().write(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--data-cache", default=str(ROOT / "runs" / "data-bench-rss"))
    args = parser.parse_args()

    from orttrainer.run import loop
    from orttrainer.run.recipe.spec import load_recipe

    samples = []
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"data.cache_dir={args.data_cache}", "data.corpus_max_mb=0.25", "data.vocab_size=1024",
                     "model.config.hidden_size=64", "model.config.intermediate_size=128", "data.batch_size=8",
                     "data.seq_length=64", "data.bert.max_predictions_per_seq=10", "data.bert.dupe_factor=1",
                     "trainer.batch.gradient_accumulation_steps=1", f"run.max_steps={args.steps}",
                     "run.log_every=1", "run.eval_every=0", "run.save_every=500", "run.save_total_limit=2",
                     "run.progress_bar=true"]
        recipe = load_recipe(ROOT / "recipes" / "bert-pretrain-tiny.yaml", overrides, out)
        started = time.perf_counter()

        def sample(run):
            if run.calls % 50 == 0:
                samples.append((run.calls, rss_mb()))

        code = loop.train(recipe, on_micro_step=sample, stream=FakeTerminal())
        seconds = time.perf_counter() - started
    if code != 0:
        sys.exit(f"run failed with status {code}")
    for step, mb in samples[:: max(1, len(samples) // 12)]:
        print(f"step {step:>6}: RSS {mb:7.1f} MB")
    warm = next((s for s in samples if s[0] >= args.steps // 10), samples[0])
    half = next((s for s in samples if s[0] >= args.steps // 2), samples[0])
    end = samples[-1]

    def per_1000(start):
        return (end[1] - start[1]) / max(1, end[0] - start[0]) * 1000

    print(f"{args.steps} steps in {seconds:.0f} s; RSS {warm[1]:.1f} MB at step {warm[0]}, {half[1]:.1f} MB at step "
          f"{half[0]}, {end[1]:.1f} MB at step {end[0]}")
    print(f"growth per 1000 steps: {per_1000(warm):+.2f} MB from step {warm[0]} (the first checkpoint saves "
          f"included), {per_1000(half):+.2f} MB over the second half")

if __name__ == "__main__":
    main()
