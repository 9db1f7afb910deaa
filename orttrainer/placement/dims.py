"""The parallel layout the distributed options ask for, checked before any process group exists.

world_size = data × horizontal (tensor parallel, optionally with ZeRO-1) or data × pipeline; Adasum
over a power-of-two world. Option arithmetic only: no torch, no collectives, nothing imported from
the runtimes -- they and the process group's setup read these rules from here.
"""


def is_power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


def unsupported(distributed_options):
    """A message for each requested kind of parallelism, or combination, that cannot run (empty: fine)."""
    d = distributed_options
    problems = []
    h = d.horizontal_parallel_size
    if h > 1 and d.world_size % h:  # tensor x data parallel (x ZeRO-1); the options check this too
        problems.append(
            f"world_size={d.world_size} is not data_parallel_size={d.data_parallel_size} x "
            f"horizontal_parallel_size={h}: tensor parallel needs world_size == data x horizontal "
            "(horizontal groups of consecutive ranks, data groups strided)")
    if d.pipeline_parallel.pipeline_parallel_size > 1:
        problems += pipeline_unsupported(d)
    problems += adasum_unsupported(d)
    pure_data_parallel = h == 1 and d.pipeline_parallel.pipeline_parallel_size == 1
    if pure_data_parallel and d.data_parallel_size not in (1, d.world_size):
        problems.append(
            f"distributed.data_parallel_size={d.data_parallel_size} with world_size={d.world_size}: only pure "
            "data parallelism runs, so data_parallel_size must equal world_size (or be left at 1)")
    return problems


def pipeline_unsupported(d):
    """What pipeline parallel (engine/parallel/pipeline_stage.py) does not run with yet (messages; empty: fine)."""
    p = d.pipeline_parallel.pipeline_parallel_size
    problems = []
    if d.world_size % p:
        problems.append(f"distributed.world_size={d.world_size} is not data_parallel_size x pipeline_parallel_size "
                        f"(= {d.world_size // p or 1} x {p}): launch a multiple of pipeline_parallel_size={p} ranks")
    for flag, what in ((d.deepspeed_zero_optimization.stage > 0, "deepspeed_zero_optimization.stage > 0"),
                       (d.enable_adasum, "distributed.enable_adasum"),
                       (d.horizontal_parallel_size > 1, "distributed.horizontal_parallel_size > 1")):
        if flag:
            problems.append(f"{what} with pipeline_parallel_size={p} is not built")
    return problems


def adasum_unsupported(d):
    """Option combinations Adasum (engine/parallel/adasum.py) cannot run (messages; empty: fine)."""
    problems = []
    if not d.enable_adasum:
        return problems
    if not is_power_of_two(d.world_size):
        problems.append(
            f"distributed.enable_adasum=True with distributed.world_size={d.world_size}: Adasum combines the "
            "ranks in pairs by recursive halving, so world_size must be a power of two (1, 2, 4, 8, ...); "
            "run a power-of-two number of ranks or turn enable_adasum off")
    if d.deepspeed_zero_optimization.stage > 0:
        problems.append(
            f"distributed.enable_adasum=True with deepspeed_zero_optimization.stage="
            f"{d.deepspeed_zero_optimization.stage}: Adasum needs every weight's whole update on every rank, "
            "ZeRO-1 updates only the rank's own segment; use one or the other")
    return problems
