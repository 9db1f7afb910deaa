"""The Hugging Face models the recipes train, their model_desc, and where their weights come from.

==================== ======================================= ============================================
model.kind           class                                   inputs -> outputs (model_desc)
==================== ======================================= ============================================
bert-pretraining     transformers.BertForPreTraining         input_ids, attention_mask, token_type_ids,
                                                             labels, next_sentence_label -> loss,
                                                             prediction_logits [batch, seq, vocab],
                                                             seq_relationship_logits [batch, 2]
gpt2                 transformers.GPT2LMHeadModel            input_ids, labels -> loss,
                                                             logits [batch, seq, vocab]
bert-classification  transformers.BertForSequenceClassification
                                                             input_ids, attention_mask, token_type_ids,
                                                             labels -> loss, logits [batch, num_labels]
==================== ======================================= ============================================

Every model computes its own loss (no loss_fn). Weights come from a random init of the config
(`model.config`), a local Hugging Face folder (`from_pretrained(folder)`, never the hub), or an
orttrainer checkpoint: its ``model/full_precision`` tensors are loaded by name into the torch model
before export. A checkpoint folder written by `orttrainer train` also holds ``model.json`` (kind
and config) and ``tokenizer.json``, so fine-tuning needs nothing else: from a ``bert-pretraining``
checkpoint a ``bert-classification`` model takes every ``bert.*`` tensor (embeddings, encoder,
pooler), and its classifier starts from random.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from orttrainer.run.recipe.model import model_shape_problems
from orttrainer.run.recipe.sections import thawed
from orttrainer.run.recipe.spec import RecipeError
from orttrainer.run.run_folder import (  # noqa: F401 (also reached through this module)
    CHECKPOINT_FILE, COMPLETE_MARKER, checkpoint_step, complete_checkpoints,
)

MODEL_JSON = "model.json"
TOKENIZER_JSON = "tokenizer.json"
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")

INPUTS = {
    "bert-pretraining": ["input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label"],
    "gpt2": ["input_ids", "labels"],
    "bert-classification": ["input_ids", "attention_mask", "token_type_ids", "labels"],
}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise RecipeError("recipes need Hugging Face transformers: "
                          "pip install 'orttrainer[recipes]'") from None
    transformers.logging.set_verbosity_error()  # no "weights not initialized" / loss_type chatter
    transformers.logging.disable_progress_bar()  # from_pretrained's "Loading weights" bar
    return transformers


def _gpt2_class():
    transformers = _transformers()

    class GPT2LMHeadModel(transformers.GPT2LMHeadModel):
        """GPT2LMHeadModel with forward(input_ids, labels), always given an all-ones attention mask.

        Without a mask, transformers (5.x) looks for packed sequences in the position ids with
        torch.diff, which the ONNX exporter cannot export (aten::diff); with one it builds the
        plain causal mask. Weights and state_dict names are the parent's.
        """

        def forward(self, input_ids, labels=None):
            return super().forward(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   labels=labels, use_cache=False, return_dict=True)

    return GPT2LMHeadModel


def model_class(kind):
    transformers = _transformers()
    if kind == "gpt2":
        return _gpt2_class()
    return {"bert-pretraining": transformers.BertForPreTraining,
            "bert-classification": transformers.BertForSequenceClassification}[kind]


def config_class(kind):
    transformers = _transformers()
    return transformers.GPT2Config if kind == "gpt2" else transformers.BertConfig


def model_desc(kind, config):
    """The exact model_desc of `kind` for a Hugging Face `config`."""
    inputs = {"bert-pretraining": [["batch", "seq"]] * 4 + [["batch"]],
              "gpt2": [["batch", "seq"]] * 2,
              "bert-classification": [["batch", "seq"]] * 3 + [["batch"]]}[kind]
    if kind == "bert-pretraining":
        outputs = [("loss", [], True), ("prediction_logits", ["batch", "seq", config.vocab_size]),
                   ("seq_relationship_logits", ["batch", 2])]
    elif kind == "gpt2":
        outputs = [("loss", [], True), ("logits", ["batch", "seq", config.vocab_size])]
    else:
        outputs = [("loss", [], True), ("logits", ["batch", config.num_labels])]
    return {"inputs": [(name, shape) for name, shape in zip(INPUTS[kind], inputs)], "outputs": outputs}


# ---------------------------------------------------------------- weight sources


@dataclass
class WeightSource:
    """Where `model.from` / `run.init_from` points: kind 'hf' (a folder) or 'checkpoint' (a file)."""

    kind: str
    path: str                      # the HF folder, or the checkpoint file
    folder: str | None = None      # checkpoint-N folder holding model.json / tokenizer.json
    model_json: dict | None = None
    tokenizer: str | None = None   # tokenizer file that came with the weights



def rank_file(folder, rank):
    """Rank r's checkpoint file in a checkpoint folder: rank 0's is the usual CHECKPOINT_FILE, so a
    multi-rank checkpoint still reads as a one-process one wherever one file is enough."""
    return Path(folder) / (CHECKPOINT_FILE if rank == 0 else f"checkpoint.rank{rank}.ortcp")


def files_to_load(file):
    """The files a trainer loads for the checkpoint `file`: every rank's file of a ZeRO-1 run (their
    optimizer states are partitioned; load_checkpoint merges them) or of a pipeline run (one stage
    each) or of a tensor-parallel run (one shard each), else the file alone (data-parallel ranks save
    identical states)."""
    from orttrainer import _checkpoint_storage

    try:
        options = _checkpoint_storage.load(str(file), key="trainer_options")
        zero, world = int(options.get("zero_stage", 0)), int(options.get("world_size", 1))
        stages = int(options.get("pipeline_parallel_size", 1))  # pipeline: each rank file holds a stage
        horizontal = int(options.get("horizontal_parallel_size", 1))  # tensor parallel: a shard each
    except (OSError, ValueError, KeyError):
        return [str(file)]  # unreadable: the load itself reports it
    if (zero == 0 and stages == 1 and horizontal == 1) or world == 1:
        return [str(file)]
    files = [rank_file(Path(file).parent, r) for r in range(world)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise RecipeError(f"{file} is rank 0 of a {world}-rank ZeRO-1, pipeline or tensor-parallel "
                          f"checkpoint, but {', '.join(missing)} "
                          "is missing: every rank's file is needed")
    return [str(f) for f in files]



def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def marker_text(folder, **facts):
    """The COMPLETE marker of `folder`: `facts` plus the size and SHA-256 of every file in it, so a
    later reader can tell a damaged checkpoint (truncated, flipped bytes) from a good one."""
    files = {}
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and path.name != COMPLETE_MARKER:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    return json.dumps({**facts, "time": time.time(), "files": files}, indent=1) + "\n"


def checkpoint_damage(folder):
    """Why the complete checkpoint `folder` cannot be trusted, or None when every file its marker
    lists has the recorded size and checksum (markers of older versions list none: trusted)."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"its {COMPLETE_MARKER} marker is unreadable ({exc})"
    if not isinstance(marker, dict):
        return f"its {COMPLETE_MARKER} marker is not a JSON object"
    for name, expected in (marker.get("files") or {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.get("bytes"):
            return f"{name} has {size:,} bytes, {expected.get('bytes'):,} were written"
        if _sha256(path) != expected.get("sha256"):
            return f"{name} does not match its checksum (its bytes changed after the save)"
    return None


def incomplete_checkpoints(run_dir):
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(child for child in run_dir.iterdir()
                  if checkpoint_step(child) is not None and not (child / COMPLETE_MARKER).is_file())


def find_checkpoint(path, what):
    """The checkpoint file `path` names: a checkpoint file, a complete checkpoint-N folder, or a run
    folder (its newest complete checkpoint). Returns (file, folder or None)."""
    p = Path(path)
    if p.is_file():
        return str(p), (str(p.parent) if checkpoint_step(p.parent) is not None else None)
    if not p.exists():
        raise RecipeError(f"{what}: {path} does not exist")
    if (p / CHECKPOINT_FILE).is_file():
        if not (p / COMPLETE_MARKER).is_file():
            raise RecipeError(f"{what}: {path} is an incomplete checkpoint (no {COMPLETE_MARKER} marker: "
                              "its save was interrupted); use an earlier one")
        _refuse_damaged(p, what)
        return str(p / CHECKPOINT_FILE), str(p)
    found = complete_checkpoints(p)
    if found:
        _refuse_damaged(found[-1], what)
        return str(found[-1] / CHECKPOINT_FILE), str(found[-1])
    raise RecipeError(f"{what}: {path} holds no complete checkpoint (checkpoint-N/ folders with a "
                      f"{COMPLETE_MARKER} marker)")


def _refuse_damaged(folder, what):
    damage = checkpoint_damage(folder)
    if damage is not None:
        raise RecipeError(f"{what}: {folder} is damaged: {damage}; use an earlier checkpoint")


def weight_source(path, what="model.from"):
    """Classify `path` (HF folder or orttrainer checkpoint) and read what comes with it."""
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file() and any((p / name).is_file() for name in _HF_WEIGHTS):
        has_tokenizer = any((p / n).is_file() for n in ("tokenizer.json", "vocab.txt")) or \
            ((p / "vocab.json").is_file() and (p / "merges.txt").is_file())
        return WeightSource("hf", str(p), tokenizer=str(p) if has_tokenizer else None)
    if p.is_dir() and (p / "config.json").is_file():
        raise RecipeError(f"{what}: {path} has a config.json but no weights ({', '.join(_HF_WEIGHTS[:2])})")
    file, folder = find_checkpoint(path, what)
    model_json = tokenizer = None
    if folder is not None:
        if (Path(folder) / MODEL_JSON).is_file():
            model_json = json.loads((Path(folder) / MODEL_JSON).read_text(encoding="utf-8"))
        if (Path(folder) / TOKENIZER_JSON).is_file():
            tokenizer = str(Path(folder) / TOKENIZER_JSON)
    return WeightSource("checkpoint", file, folder, model_json, tokenizer)


def read_checkpoint(paths):
    """The one-process state_dict of one checkpoint's files `paths` (files_to_load gives every rank's):
    the rank files of a ZeRO-1, Megatron or pipeline run, or of their combinations, merged by the
    trainer's own aggregation, as --resume loads them. Every reader of a run's checkpoint (model.from,
    `orttrainer ckpt export / to-torch`) reads it through here. A file without trainer_options (weights
    only) is read as it is; the user_dict stays encoded."""
    from orttrainer import _checkpoint_storage, checkpoint
    from orttrainer.state.aggregation import PIPELINE_SIZE_KEY
    from orttrainer._utils import HORIZONTAL_PARALLEL_SIZE_KEY, TRAINER_OPTIONS_KEY, ZERO_STAGE_KEY

    paths = [str(path) for path in paths]
    try:
        options = _checkpoint_storage.load(paths[0], key=TRAINER_OPTIONS_KEY)
    except KeyError:
        options = {}  # a file with weights only
    if (int(options.get(ZERO_STAGE_KEY, 0)) > 0 or int(options.get(HORIZONTAL_PARALLEL_SIZE_KEY, 1)) > 1
            or int(options.get(PIPELINE_SIZE_KEY, 1)) > 1):
        return checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
    if len(paths) != 1:
        raise ValueError(f"expected one checkpoint file: {paths[0]} is not a ZeRO, Megatron or pipeline rank "
                         f"file, but {len(paths)} files were given")
    return _checkpoint_storage.load(paths[0])


def read_checkpoint_weights(file):
    """{name: numpy array} of the full-precision model tensors of the checkpoint `file` (and of the
    other ranks' files beside it, merged)."""
    from orttrainer._utils import FULL_PRECISION_KEY, MODEL_KEY

    try:
        state = read_checkpoint(files_to_load(file))
    except (OSError, ValueError, KeyError) as exc:
        raise RecipeError(f"cannot read checkpoint {file}: {exc}") from None
    return state.get(MODEL_KEY, {}).get(FULL_PRECISION_KEY, {})


def checkpoint_tensor(name, value, like, file, what):
    """The checkpoint's tensor `name` (from `file`) as a torch tensor for the model's tensor `like`:
    the same shape, and a dtype of the same kind, as ORTTrainer.load_state_dict requires (a float64
    weight loads into a float32 one; an int or bool array in place of a float weight is refused:
    cast, it would be all 0.0 or 1.0). RecipeError naming the tensor otherwise."""
    from orttrainer.state.load_checks import compatible_dtype, numpy_dtype

    value = np.asarray(value)
    if tuple(value.shape) != tuple(like.shape):
        raise RecipeError(f"{what}: tensor {name} has shape {list(value.shape)} in {file} but "
                          f"{list(like.shape)} in this model; the model's config differs from the checkpoint's")
    expected = numpy_dtype(like)
    if not compatible_dtype(value.dtype, expected):
        raise RecipeError(f"{what}: tensor {name} has dtype {value.dtype} in {file} but {expected} in this "
                          "model; the checkpoint is from a different model or was altered")
    return torch.from_numpy(np.ascontiguousarray(value)).to(like.dtype)


def _tied_groups(kind, config):
    """Groups of parameter names that share one tensor in a `kind` model (built on the meta device)."""
    with torch.device("meta"):
        model = model_class(kind)(config)
    groups = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def load_checkpoint_weights(model, file, source_kind, source_config):
    """Copy the checkpoint's tensors into `model` by name; returns (loaded, randomly initialized) names.

    The checkpoint keeps one name per tied tensor (the exporter's); the other names of its group in a
    `source_kind` model are filled in first, so e.g. a classifier gets the word embeddings whichever
    name held them."""
    weights = dict(read_checkpoint_weights(file))
    for names in _tied_groups(source_kind, source_config):
        present = next((n for n in names if n in weights), None)
        if present is not None:
            for n in names:
                weights.setdefault(n, weights[present])
    target = model.state_dict()
    loaded, missing = {}, []
    for name, tensor in target.items():
        if name not in weights:
            missing.append(name)
            continue
        loaded[name] = checkpoint_tensor(name, weights[name], tensor, file, "model.from")
    if not loaded:
        raise RecipeError(f"model.from: no tensor of {file} matches this model's parameter names")
    model.load_state_dict(loaded, strict=False)
    return sorted(loaded), missing


# ---------------------------------------------------------------- building


@dataclass
class BuiltModel:
    kind: str
    model: torch.nn.Module
    config: object                    # the transformers config
    desc: dict
    source: str                       # where the weights came from, in words
    random_init: list = field(default_factory=list)  # parameter names not loaded from `source`

    def model_json(self, label_list=None):
        return {"kind": self.kind, "config": self.config.to_dict(), "label_list": label_list}


def _config(kind, base, overrides, vocab_size, seq_length, special, label_list):
    """The transformers config: `base` (dict or None) updated with the recipe's `overrides`."""
    cls = config_class(kind)
    values = dict(base or {})
    values.update(thawed(overrides))  # plain data: the config is written as JSON
    for key in ("_name_or_path", "transformers_version"):
        values.pop(key, None)
    if kind == "gpt2":
        values.setdefault("n_positions", max(1024, seq_length))
        values["use_cache"] = False
        if special.get("eos") is not None:
            values.setdefault("bos_token_id", special["eos"])
            values.setdefault("eos_token_id", special["eos"])
    elif special.get("pad") is not None:
        values.setdefault("pad_token_id", special["pad"])
    if vocab_size is not None:
        values.setdefault("vocab_size", vocab_size)
    if kind == "bert-classification":
        if label_list is None:
            raise RecipeError("bert-classification needs the data's label list")
        given = values.get("num_labels")
        if "num_labels" in overrides and given != len(label_list):
            raise RecipeError(f"model.config.num_labels: got {given}; the data has {len(label_list)} labels "
                              f"{label_list}")
        values["num_labels"] = len(label_list)
        values["id2label"] = {i: str(label) for i, label in enumerate(label_list)}
        values["label2id"] = {str(label): i for i, label in enumerate(label_list)}
    try:
        config = cls(**values)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"model.config: {cls.__name__} rejected it: {exc}") from None
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise RecipeError(f"model.config.vocab_size: got {config.vocab_size}; the tokenizer has {vocab_size} "
                          "tokens, so it must be at least that")
    problems = model_shape_problems(kind, config.to_dict(), seq_length)
    if problems:
        raise RecipeError(problems)
    return config


def build_model(kind, overrides, *, seed, vocab_size, seq_length, special=None, label_list=None,
                source=None, base_config=None):
    """The torch model for `kind`, seeded random init, then weights from `source` (a WeightSource).

    `base_config` (dict) replaces the source's config (used when resuming: the checkpoint's own).
    """
    special = special or {}
    cls = model_class(kind)
    torch.manual_seed(seed)
    if source is not None and source.kind == "hf" and base_config is None:
        config_cls = config_class(kind)
        try:
            base = config_cls.from_pretrained(source.path, local_files_only=True).to_dict()
        except (OSError, ValueError) as exc:
            raise RecipeError(f"model.from: cannot read {source.path}/config.json: {exc}") from None
        config = _config(kind, base, overrides, vocab_size, seq_length, special, label_list)
        try:
            model = cls.from_pretrained(source.path, config=config, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise RecipeError(f"model.from: cannot load the weights in {source.path}: {exc}") from None
        return BuiltModel(kind, model, config, model_desc(kind, config), f"Hugging Face folder {source.path}")

    source_kind, base = kind, base_config
    if source is not None and base is None and source.model_json is not None:
        source_kind = source.model_json.get("kind", kind)
        base = dict(source.model_json.get("config") or {})
        if kind != source_kind:
            for key in ("num_labels", "id2label", "label2id", "architectures"):
                base.pop(key, None)
    config = _config(kind, base, overrides, vocab_size, seq_length, special, label_list)
    model = cls(config)
    if source is None:
        return BuiltModel(kind, model, config, model_desc(kind, config), "random init")
    source_config = config
    if source_kind != kind:
        source_config = config_class(source_kind)(**{k: v for k, v in (base or {}).items()
                                                     if k not in ("_name_or_path", "transformers_version")})
    loaded, missing = load_checkpoint_weights(model, source.path, source_kind, source_config)
    return BuiltModel(kind, model, config, model_desc(kind, config),
                      f"checkpoint {os.path.relpath(source.path)} ({len(loaded)} tensors)", missing)
