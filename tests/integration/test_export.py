"""`orttrainer ckpt export` and `run.export_at_end` on checkpoints the tiny recipes write.

The reference is the trainer itself: a fresh ORTTrainer of the run's model config loads the
checkpoint files (its own load_checkpoint) and runs eval_step; the Hugging Face folder loaded with
`from_pretrained` (offline) and the ONNX model run by an onnxruntime InferenceSession must give the
same logits on a batch `AutoTokenizer.from_pretrained(DIR)` encodes.
"""

import functools
import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
import torch  # noqa: E402

from orttrainer import ORTTrainer, ORTTrainerOptions, _checkpoint_storage  # noqa: E402
from orttrainer.cli import main  # noqa: E402
from orttrainer.run import model_export as export
from orttrainer.run import hf_models as models  # noqa: E402
from orttrainer.run.recipe.spec import recipe_from_yaml  # noqa: E402

TEXTS = (["the quick brown fox", "import os and sys, then print the list of files in the folder"],
         ["jumps over", "a lazy dog"])
AUTO = {"bert-pretraining": "AutoModelForPreTraining", "gpt2": "AutoModelForCausalLM",
        "bert-classification": "AutoModelForSequenceClassification"}
CLASS = {"bert-pretraining": "BertForPreTraining", "gpt2": "GPT2LMHeadModel",
         "bert-classification": "BertForSequenceClassification"}


def ckpt(capsys, *argv):
    code = main(["ckpt", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *fragments):
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@functools.lru_cache(maxsize=None)
def reference_trainer(folder):
    """An fp32 ORTTrainer of the checkpoint's model config, random init, then load_checkpoint (one per
    checkpoint folder: eval_step changes nothing, so tests may share it)."""
    model_json = json.loads((folder / models.MODEL_JSON).read_text())
    kind = model_json["kind"]
    config = models.config_class(kind)(**{k: v for k, v in model_json["config"].items()
                                           if k not in ("_name_or_path", "transformers_version")})
    torch.manual_seed(12345)
    recipe = recipe_from_yaml((folder / "recipe.yaml").read_text())
    trainer = ORTTrainer(models.model_class(kind)(config), models.model_desc(kind, config), recipe.optimizer_config(),
                         options=ORTTrainerOptions({"device": {"id": "cpu"},
                                                    "_internal_use": {"onnx_opset_version": 17}}))
    trainer.load_checkpoint(*models.files_to_load(folder / models.CHECKPOINT_FILE), strict=False)
    return kind, trainer


def batch_for(kind, tokenizer, texts=TEXTS):
    """A padded batch from the exported tokenizer, plus the labels eval_step needs (logits ignore them)."""
    pairs = texts[1] if kind != "gpt2" else None
    enc = tokenizer(list(texts[0]), pairs, padding=kind != "gpt2", return_tensors="pt") if kind != "gpt2" \
        else tokenizer([" ".join(texts[0])] * 2, return_tensors="pt")
    batch = {name: enc[name] for name in export.INFERENCE_INPUTS[kind]}
    rows, seq = batch["input_ids"].shape
    if kind == "bert-pretraining":
        labels = torch.full((rows, seq), -100)
        labels[:, 1] = 5
        batch.update(labels=labels, next_sentence_label=torch.zeros(rows, dtype=torch.int64))
    elif kind == "gpt2":
        batch["labels"] = batch["input_ids"]
    else:
        batch["labels"] = torch.zeros(rows, dtype=torch.int64)
    return batch


def check_hf(folder, hf_dir):
    """from_pretrained (offline) gives the right class, tokenizer and the trainer's eval_step logits."""
    import transformers

    kind, trainer = reference_trainer(folder)
    model = getattr(transformers, AUTO[kind]).from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(model).__name__ == CLASS[kind]
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    own = Tokenizer.from_file(str(folder / models.TOKENIZER_JSON))  # the run's tokenizer
    encoded = tokenizer(TEXTS[0][1], TEXTS[1][1] if kind != "gpt2" else None)
    expected = own.encode(TEXTS[0][1], TEXTS[1][1]) if kind != "gpt2" else own.encode(TEXTS[0][1])
    assert encoded["input_ids"] == expected.ids
    if kind != "gpt2":
        assert encoded["token_type_ids"] == expected.type_ids
    batch = batch_for(kind, tokenizer)
    outputs = trainer.eval_step(**batch)
    with torch.no_grad():
        hf = model(**{name: batch[name] for name in export.INFERENCE_INPUTS[kind]})
    for index, name in enumerate(export.INFERENCE_OUTPUTS[kind], start=1):
        np.testing.assert_allclose(hf[name].numpy(), outputs[index].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    return model, trainer


# ---------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def bert_run(bert_phase1_run):
    return bert_phase1_run  # 8 steps, run.export_at_end=[hf, onnx]; test_recipes' phase 1 (conftest.py)


FINAL = "checkpoint-8"  # bert_run's last checkpoint


@pytest.fixture(scope="module")
def gpt2(gpt2_run):
    return gpt2_run[0] / "checkpoint-8"  # the last checkpoint of test_recipes' GPT-2 run (conftest.py)


# ---------------------------------------------------------------- Hugging Face


def test_export_at_end_writes_hf_and_onnx_and_equals_the_cli_export(bert_run, tmp_path, capsys):
    assert (bert_run / "export-hf" / "model.safetensors").is_file()
    assert (bert_run / "export-onnx" / export.ONNX_FILE).is_file()
    code, out, _ = ckpt(capsys, "export", bert_run / FINAL, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0 and "wrote" in out
    from safetensors.numpy import load_file

    at_end = load_file(bert_run / "export-hf" / "model.safetensors")
    by_cli = load_file(tmp_path / "hf" / "model.safetensors")
    assert at_end.keys() == by_cli.keys()
    for name in at_end:
        np.testing.assert_array_equal(at_end[name], by_cli[name])


def test_hf_bert_pretraining_loads_offline_and_matches_eval_step(bert_run):
    model, _ = check_hf(bert_run / FINAL, bert_run / "export-hf")
    assert model.config.architectures == ["BertForPreTraining"]


def test_hf_bert_classification_keeps_labels_and_matches_eval_step(bert_finetune_run, tmp_path, capsys):
    run, _ = bert_finetune_run  # fine-tuned from bert_run with fp16 compute, 12 steps (conftest.py)
    code, _, _ = ckpt(capsys, "export", run, "--format", "hf", "--out", tmp_path / "hf")  # a run folder: newest
    assert code == 0
    model, _ = check_hf(run / "checkpoint-12", tmp_path / "hf")
    label_list = json.loads((run / "checkpoint-12" / models.MODEL_JSON).read_text())["label_list"]
    assert model.config.num_labels == len(label_list) == 4
    assert model.config.id2label == {i: str(label) for i, label in enumerate(label_list)}
    assert ckpt(capsys, "export", run, "--format", "onnx", "--out", tmp_path / "onnx")[0] == 0
    check_onnx(run / "checkpoint-12", tmp_path / "onnx", [(2, 10), (5, 33)])


def test_hf_gpt2_loads_offline_and_matches_eval_step(gpt2, tmp_path, capsys):
    code, _, _ = ckpt(capsys, "export", gpt2, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0
    check_hf(gpt2, tmp_path / "hf")


# ---------------------------------------------------------------- ONNX


def check_onnx(folder, onnx_dir, shapes):
    kind, trainer = reference_trainer(folder)
    model = onnx.load(str(onnx_dir / export.ONNX_FILE))
    ops = {node.op_type for node in model.graph.node}
    assert not ops & {"Dropout", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}, ops
    assert [i.name for i in model.graph.input] == export.INFERENCE_INPUTS[kind]  # no labels
    for value in model.graph.input:
        assert [d.dim_param for d in value.type.tensor_type.shape.dim] == ["batch", "seq"]
    session = ort.InferenceSession(str(onnx_dir / export.ONNX_FILE), providers=["CPUExecutionProvider"])
    vocab = json.loads((folder / models.MODEL_JSON).read_text())["config"]["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    for rows, seq in shapes:
        ids = torch.randint(5, vocab, (rows, seq), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        batch["attention_mask"][0, seq - 2:] = 0
        batch["token_type_ids"][:, seq // 2:] = 1
        labels = {"bert-pretraining": {"labels": torch.where(ids % 7 == 0, ids, -100),
                                       "next_sentence_label": torch.zeros(rows, dtype=torch.int64)},
                  "gpt2": {"labels": ids}, "bert-classification": {"labels": torch.zeros(rows, dtype=torch.int64)}}
        feed = {name: batch[name] for name in export.INFERENCE_INPUTS[kind]}
        expected = trainer.eval_step(**feed, **labels[kind])
        got = session.run(None, {name: value.numpy() for name, value in feed.items()})
        for index, name in enumerate(export.INFERENCE_OUTPUTS[kind]):
            np.testing.assert_allclose(got[index], expected[index + 1].numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    return trainer, feed, labels[kind], expected


def test_onnx_bert_equals_eval_step_at_two_shapes(bert_run, tmp_path):
    trainer, feed, labels, expected = check_onnx(bert_run / FINAL, bert_run / "export-onnx",
                                                 [(2, 16), (3, 40)])
    assert (bert_run / "export-onnx" / "tokenizer.json").is_file()
    assert (bert_run / "export-onnx" / "config.json").is_file()
    # The legacy save_as_onnx is unchanged: the training-mode forward, labels as inputs, live Dropout.
    trainer.save_as_onnx(str(tmp_path / "legacy.onnx"))
    legacy = onnx.load(str(tmp_path / "legacy.onnx"))
    assert [i.name for i in legacy.graph.input] == [*export.INFERENCE_INPUTS["bert-pretraining"], *labels]
    assert "Dropout" in {node.op_type for node in legacy.graph.node}
    session = ort.InferenceSession(str(tmp_path / "legacy.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: value.numpy() for name, value in {**feed, **labels}.items()})
    assert np.abs(got[1] - expected[1].numpy()).max() > 1e-3  # dropout on: not eval_step's logits


def test_onnx_gpt2_equals_eval_step_at_two_shapes(gpt2, tmp_path, capsys):
    code, _, _ = ckpt(capsys, "export", gpt2, "--format", "onnx", "--out", tmp_path / "onnx")
    assert code == 0
    check_onnx(gpt2, tmp_path / "onnx", [(1, 12), (4, 30)])


# ---------------------------------------------------------------- folders, errors


def test_to_torch_accepts_a_checkpoint_folder(bert_run, tmp_path, capsys):
    folder = bert_run / FINAL
    assert ckpt(capsys, "to-torch", folder, tmp_path / "folder.pt")[0] == 0
    assert ckpt(capsys, "to-torch", folder / models.CHECKPOINT_FILE, tmp_path / "file.pt")[0] == 0
    from_folder, from_file = torch.load(tmp_path / "folder.pt"), torch.load(tmp_path / "file.pt")
    saved = _checkpoint_storage.load(folder / models.CHECKPOINT_FILE, key="model/full_precision")
    assert from_folder.keys() == from_file.keys() == saved.keys()
    for name, value in saved.items():
        np.testing.assert_array_equal(from_folder[name].numpy(), value)
    plain = tmp_path / "saved_by_hand"  # any folder holding one checkpoint file
    plain.mkdir()
    (plain / "model.ortcp").write_bytes((folder / models.CHECKPOINT_FILE).read_bytes())
    assert ckpt(capsys, "to-torch", plain, tmp_path / "plain.safetensors")[0] == 0
    (plain / "other.ortcp").write_bytes(b"")
    code, _, err = ckpt(capsys, "to-torch", plain, tmp_path / "two.pt")
    one_line_error(code, err, "holds several checkpoint files (model.ortcp, other.ortcp); name one")


def test_export_errors_are_one_line_and_exit_2(bert_run, tmp_path, capsys):
    folder = bert_run / FINAL
    bare = tmp_path / "bare.ortcp"
    bare.write_bytes((folder / models.CHECKPOINT_FILE).read_bytes())
    code, _, err = ckpt(capsys, "export", bare, "--format", "hf", "--out", tmp_path / "a")
    one_line_error(code, err, "orttrainer ckpt export: error:", "no model.json", str(tmp_path))
    assert not (tmp_path / "a").exists()
    (tmp_path / models.MODEL_JSON).write_bytes((folder / models.MODEL_JSON).read_bytes())  # now beside it
    code, _, err = ckpt(capsys, "export", bare, "--format", "hf", "--out", tmp_path / "a")
    assert code == 0 and "holds no tokenizer.json" in err  # the model alone, with a warning
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, _, err = ckpt(capsys, "export", folder, "--format", "hf", "--out", busy)
    one_line_error(code, err, "already exists and is not empty", "--overwrite")
    assert (busy / "keep.txt").read_text() == "mine"
    code, _, _ = ckpt(capsys, "export", folder, "--format", "onnx", "--out", busy, "--overwrite")
    assert code == 0 and sorted(p.name for p in busy.iterdir()) == sorted(
        ["config.json", export.ONNX_FILE, "tokenizer.json", "tokenizer_config.json"])

    code, _, err = ckpt(capsys, "export", tmp_path / "missing", "--format", "hf", "--out", tmp_path / "b")
    one_line_error(code, err, "missing does not exist")
    incomplete = tmp_path / "checkpoint-9"
    incomplete.mkdir()
    (incomplete / models.CHECKPOINT_FILE).write_bytes(bare.read_bytes())
    code, _, err = ckpt(capsys, "export", incomplete, "--format", "hf", "--out", tmp_path / "c")
    one_line_error(code, err, "incomplete checkpoint")
    assert not any(p.name.startswith((".a.", ".b.", ".c.")) for p in tmp_path.iterdir())  # no temporary left


def with_weight_as(folder, out, name, dtype):
    """A copy of the checkpoint `folder` whose weight `name` was saved as `dtype` (its marker rewritten, so
    the copy reads as complete and undamaged)."""
    import shutil

    shutil.copytree(folder, out)
    state = _checkpoint_storage.load(out / models.CHECKPOINT_FILE)
    weights = state["model"]["full_precision"]
    weights[name] = (np.asarray(weights[name]) * 100).astype(dtype)
    _checkpoint_storage.save(state, out / models.CHECKPOINT_FILE, overwrite=True)
    facts = json.loads((out / models.COMPLETE_MARKER).read_text())
    (out / models.COMPLETE_MARKER).write_text(models.marker_text(out, **{k: v for k, v in facts.items()
                                                                          if k not in ("time", "files")}))
    return out


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_a_weight_of_another_dtype_is_refused_by_export_and_model_from(bert_run, data_cache, tmp_path, capsys,
                                                                       dtype):
    # Cast, an int32 weight read as all 0.0 and a bool one as all 1.0: refused, naming the tensor.
    name = "bert.encoder.layer.0.attention.self.query.weight"
    folder = with_weight_as(bert_run / FINAL, tmp_path / "checkpoint-8", name, dtype)
    expected = (f"tensor {name} has dtype {dtype} in {folder / models.CHECKPOINT_FILE} but float32 in this "
                "model")
    code, _, err = ckpt(capsys, "export", folder, "--format", "hf", "--out", tmp_path / "hf")
    one_line_error(code, err, expected)
    assert not (tmp_path / "hf").exists()
    from helpers.recipes import SMALL_BERT, sets, train

    for key in ("model.from", "run.init_from"):  # the recipe's weights; the trainer's load_checkpoint
        code = train("bert-pretrain-tiny.yaml", tmp_path / key, sets(data_cache, *SMALL_BERT, f"{key}={folder}",
                                                                      "run.max_steps=1"))
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{name}" in err and dtype in err and "float32" in err, err
