"""The benchmark: orttrainer against PyTorch eager and torch.compile (docs/performance.md).

`python bench/train_bench.py` (or `python -m bench.train_bench`) runs cli.main; its parts: models (the
workloads), systems (what each system runs, FLOP counts), measure (clocks, RSS, the quiet gate), host
(CPU, threads, the matmul roof, the host kind results are named after), scaling (--scaling), report
(the tables, --render); real_size and scale_curve (`python -m bench.train_bench.real_size`, `...scale_curve`)
measure GPT-2 small and BERT-base, and memory against size, one fresh process per system.
"""
