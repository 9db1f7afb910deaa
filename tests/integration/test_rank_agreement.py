"""Ranks started with different recipes stop at start-up, naming the first key that differs.

Real processes through the real CLI: two `orttrainer train` processes joined by torchrun's
environment variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each given its own --set values, as a
user launching ranks by hand (or on two machines) with different command lines would.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "bert-pretrain-tiny.yaml"
TIMEOUT = 180


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_ranks(folder, per_rank):
    """Start rank 0 and rank 1 in `folder` with their own extra --set values; returns the processes."""
    port = free_port()
    procs = []
    for rank, extra in enumerate(per_rank):
        argv = [sys.executable, "-m", "orttrainer", "train", str(RECIPE), "--output-dir", str(folder / "run"),
                "--set", f"data.cache_dir={folder / 'data'}", "--set", "run.max_steps=2"]
        for item in extra:
            argv += ["--set", item]
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "ORTTRAINER_DIST_TIMEOUT": "60"}
        procs.append(subprocess.Popen(argv, env=env, cwd=folder, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


CASES = [
    ("trainer.optimizer.lr", ("0.001", "0.002"), ("0.001", "0.002")),
    ("data.batch_size", ("8", "4"), ("8", "4")),
    ("data.seq_length", ("64", "32"), ("64", "32")),
]


@pytest.fixture(scope="module")
def refused_pairs(tmp_path_factory):
    """{key: (folder, [(exit status, stderr) per rank])}: the three pairs start side by side (each its
    own port and folder): their time is start-up and rendezvous, not compute, so they overlap."""
    started = {}
    try:
        for key, values, _ in CASES:
            folder = tmp_path_factory.mktemp(key.replace(".", "_"))
            started[key] = folder, start_two_ranks(folder, [[f"{key}={values[0]}"], [f"{key}={values[1]}"]])
        results = {}
        for key, (folder, procs) in started.items():
            errs = [proc.communicate(timeout=TIMEOUT)[1] for proc in procs]
            results[key] = folder, [(proc.returncode, err) for proc, err in zip(procs, errs)]
    finally:
        for _, procs in started.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    return results


@pytest.mark.parametrize("key, values, shown", CASES)
def test_ranks_with_different_settings_stop_naming_the_key(refused_pairs, key, values, shown):
    folder, results = refused_pairs[key]
    expected = f"orttrainer train: error: {key}: rank 0 has {shown[0]} but rank 1 has {shown[1]}"
    for rank, (code, err) in enumerate(results):
        assert code == 2, (rank, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines and lines[-1].startswith(expected), (rank, err)
    assert not (folder / "data").exists()  # stopped before building anything
