"""Tools users run (docs/performance.md): the benchmark package train_bench/ and the studies/. Not part of
the installed orttrainer package; run from the repository root."""
