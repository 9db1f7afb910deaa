"""`run.export_at_end: hf` of a 2-rank ZeRO-1 run (torchrun, gloo; the session's shared launch,
conftest.py::two_rank_bert_run) and `ckpt export` of its checkpoint folder: the rank files are merged,
and the Hugging Face model gives the logits of a one-process trainer that loads both rank files itself."""

import shutil

import pytest

pytest.importorskip("transformers")

from test_export import check_hf, ckpt  # noqa: E402

from orttrainer import _checkpoint_storage  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did


def test_zero1_two_rank_run_exports_merged_weights(two_rank_bert_run, tmp_path, capsys):
    out, output = two_rank_bert_run
    folder = out / "checkpoint-6"
    assert (folder / "checkpoint.rank1.ortcp").is_file() and "exported checkpoint-6" in output
    options = _checkpoint_storage.load(folder / models.CHECKPOINT_FILE, key="trainer_options")
    assert int(options["zero_stage"]) == 1 and int(options["world_size"]) == 2
    check_hf(folder, out / "export-hf")

    code, printed, _ = ckpt(capsys, "export", folder, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0 and "checkpoint.rank1.ortcp" in printed  # both rank files were read
    check_hf(folder, tmp_path / "hf")
    copy = shutil.copytree(folder, tmp_path / "checkpoint-6")  # the shared run stays whole
    (copy / "checkpoint.rank1.ortcp").unlink()
    code, _, err = ckpt(capsys, "export", copy / models.CHECKPOINT_FILE, "--format", "hf", "--out", tmp_path / "x")
    assert code == 2 and err.count("\n") == 1 and "checkpoint.rank1.ortcp is missing" in err
