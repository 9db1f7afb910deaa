"""The user's own data through `orttrainer train`: every corpus form (file, folder, glob, JSONL,
save_to_disk, Parquet, CSV) trains a tiny GPT-2 or BERT, and classification trains from CSV, TSV and
JSONL with named columns. Corpora are written by the tests; models are a few thousand parameters,
2 steps each (the export cache makes the repeated shapes cheap)."""

import json
import random
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from orttrainer.cli import main  # noqa: E402

WORDS = ("the river stone light green quick market table window garden paper music silver cloud "
         "orange winter bread letter forest engine travel morning doctor number simple bright").split()
GPT = {"model": {"kind": "gpt2", "config": {"n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 32}},
       "data": {"vocab_size": 300, "seq_length": 16, "batch_size": 2, "eval_fraction": 0.0}}
BERT = {"model": {"kind": "bert-pretraining",
                  "config": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"vocab_size": 200, "seq_length": 32, "batch_size": 2, "eval_fraction": 0.0,
                 "bert": {"max_predictions_per_seq": 5, "dupe_factor": 1}}}
CLS = {"model": {"kind": "bert-classification",
                 "config": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "intermediate_size": 32, "max_position_embeddings": 64}},
       "data": {"seq_length": 16, "batch_size": 2}}


def documents(n=12, seed=0):
    """n documents of a few sentences of common words (deterministic)."""
    rng = random.Random(seed)
    return [" ".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 9))).capitalize() + "."
                     for _ in range(rng.randint(3, 6))) for _ in range(n)]


def write_txt(path, docs):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n\n".join("\n".join(d.split(". ")) for d in docs) + "\n", encoding="utf-8")
    return path


def recipe(tmp_path, base, **data):
    doc = json.loads(json.dumps(base))
    doc["data"].update(data)
    doc["data"].setdefault("cache_dir", str(tmp_path / "cache"))
    doc["trainer"] = {"device": {"id": "cpu"}, "_internal_use": {"onnx_opset_version": 17}}
    doc["run"] = {"max_steps": 2, "log_every": 1, "seed": 0, "check_memory": False, "progress_bar": False}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def train(recipe_path, out, *sets):
    argv = ["train", str(recipe_path), "--output-dir", str(out)]
    for item in sets:
        argv += ["--set", item]
    return main(argv)


def losses(out):
    lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["kind"] == "train"]


def write_form(form, tmp_path, docs):
    """Write `docs` in one of the corpus forms; returns what data.corpus names."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    if form == "file":
        return str(write_txt(src / "all.txt", docs))
    if form in ("folder", "glob"):
        for i in range(0, len(docs), 4):
            write_txt(src / "part" / f"{i:02d}" / "docs.txt", docs[i:i + 4])
        return str(src / "part") if form == "folder" else str(src / "part" / "*" / "*.txt")
    if form == "jsonl":
        path = src / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
        return str(path)
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"id": list(range(len(docs))), "body": docs})
    if form == "save_to_disk":
        table.save_to_disk(str(src / "saved"))
        return str(src / "saved")
    if form == "parquet":
        table.to_parquet(str(src / "docs.parquet"))
        return str(src / "docs.parquet")
    table.to_csv(str(src / "docs.csv"), index=False)
    return str(src / "docs.csv")


FORMS = ["file", "folder", "glob", "jsonl", "save_to_disk", "parquet", "csv"]


@pytest.mark.parametrize("form", FORMS)
def test_gpt_trains_on_each_corpus_form(form, tmp_path, capsys):
    corpus = write_form(form, tmp_path, documents(40))
    assert train(recipe(tmp_path, GPT, corpus=corpus, gpt={"text_field": "body"}), tmp_path / "run") == 0, \
        capsys.readouterr().err
    assert len(losses(tmp_path / "run")) == 2
    out = capsys.readouterr().out
    assert "data: " in out and "blocks of 16 tokens" in out


@pytest.mark.parametrize("form", ["folder", "parquet"])
def test_bert_trains_on_own_corpus(form, tmp_path, capsys):
    corpus = write_form(form, tmp_path, documents(16))
    assert train(recipe(tmp_path, BERT, corpus=corpus, gpt={"text_field": "body"}), tmp_path / "run") == 0, \
        capsys.readouterr().err
    assert len(losses(tmp_path / "run")) == 2
    assert "BERT instances (seq 32)" in capsys.readouterr().out


def test_bert_sees_each_record_as_a_document_split_into_sentences(tmp_path):
    """A record's text becomes one document, one sentence per line (BERT's segments)."""
    from orttrainer.run.data.corpus import read_documents
    from orttrainer.run.data.sources import plain_text_files

    docs = ["One sentence here. And a second one!\n\nA third after a blank line.", "Only one."]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    files = plain_text_files([str(src)], "text", tmp_path / "work", sentences=True)
    assert read_documents(files) == [["One sentence here.", "And a second one!", "A third after a blank line."],
                                     ["Only one."]]


def classification_data(folder, fmt, labels=("neg", "pos", "neu"), n=24, seed=1):
    """train/dev files of a 3-label pair task; columns 'premise', 'hypothesis', 'verdict'."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, count in (("train", n), ("dev", n // 2)):
        rows = [(" ".join(rng.choices(WORDS, k=5)), " ".join(rng.choices(WORDS, k=4)), labels[i % len(labels)])
                for i in range(count)]
        path = folder / f"{split}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps({"premise": a, "hypothesis": b, "verdict": c}) + "\n"
                                    for a, b, c in rows))
        else:
            sep = "," if fmt == "csv" else "\t"
            path.write_text("premise" + sep + "hypothesis" + sep + "verdict\n"
                            + "".join(f'"{a}, really"{sep}{b}{sep}{c}\n' if fmt == "csv" else f"{a}{sep}{b}{sep}{c}\n"
                                      for a, b, c in rows))
    return folder


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    corpus = write_txt(folder / "c.txt", documents(20))
    assert main(["data", "tokenizer", str(corpus), "--vocab-size", "120", "--out", str(folder / "tok")]) == 0
    return str(folder / "tok")


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_classification_trains_from_named_columns(fmt, tmp_path, wordpiece, capsys):
    data = classification_data(tmp_path / "cls", fmt)
    path = recipe(tmp_path, CLS, path=str(data), tokenizer=wordpiece,
                  glue={"train_file": f"train.{fmt}", "dev_file": f"dev.{fmt}", "text_a": "premise",
                        "text_b": "hypothesis", "label": "verdict"})
    assert train(path, tmp_path / "run") == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "labels ['neg', 'neu', 'pos']" in out  # sorted from the training split
    config = json.loads(next((tmp_path / "run").glob("checkpoint-*/model.json")).read_text())["config"]
    assert config["id2label"] == {"0": "neg", "1": "neu", "2": "pos"}  # what evaluation and export use
    if fmt == "csv":  # quoted fields with commas are read whole
        from orttrainer.run.data.glue import read_glue_tsv

        assert read_glue_tsv(data / "train.csv", text_a="premise", label="verdict")[0].text_a.endswith(", really")


def test_label_order_is_numeric_for_integer_labels_and_pinned_by_labels_json(tmp_path, wordpiece, capsys):
    from orttrainer.run.data.glue import sort_labels

    assert sort_labels(["10", "2", "1"]) == ["1", "2", "10"] and sort_labels(["b", "a", "10"]) == ["10", "a", "b"]
    data = classification_data(tmp_path / "cls", "tsv")
    (data / "labels.json").write_text(json.dumps({"labels": ["pos", "neu", "neg"]}))
    path = recipe(tmp_path, CLS, path=str(data), tokenizer=wordpiece,
                  glue={"text_a": "premise", "text_b": "hypothesis", "label": "verdict"})
    assert train(path, tmp_path / "run") == 0, capsys.readouterr().err
    assert "labels ['pos', 'neu', 'neg']" in capsys.readouterr().out
