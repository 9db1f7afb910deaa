"""Taking a trained model elsewhere: a checkpoint of `orttrainer train` as a Hugging Face folder or an
inference ONNX model (`orttrainer ckpt export`, `run.export_at_end`).

Everything beyond the weights comes from what the run wrote into its checkpoint-N folder:
``model.json`` (model kind, transformers config, label list), ``tokenizer.json`` and ``recipe.yaml``
(the ONNX opset). The weights are the ``model/full_precision`` tensors of every rank's file, merged
by the checkpoint aggregation code when the run was ZeRO-1 (or Megatron) partitioned.

* ``hf``: ``config.json`` + ``model.safetensors`` (``save_pretrained`` of the transformers class the
  recipe trained: BertForPreTraining, BertForSequenceClassification, GPT2LMHeadModel) and the
  tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), for ``AutoModelFor...`` /
  ``AutoTokenizer.from_pretrained(DIR)`` offline.
* ``onnx``: ``model.onnx`` exported in eval mode (no Dropout, no training nodes), inputs without
  labels and with dynamic batch and sequence axes, outputs the logits; plus ``config.json`` and the
  tokenizer. This is not what the legacy `ORTTrainer.save_as_onnx` writes (see docs/legacy-class.md).
"""

import json
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orttrainer.run import hf_models as models
from orttrainer.run.recipe.spec import parse_yaml

FORMATS = ("hf", "onnx")
ONNX_FILE = "model.onnx"
DEFAULT_OPSET = 17

# The model inputs (the recipe's model_desc without labels) and logits of each kind.
INFERENCE_INPUTS = {
    "bert-pretraining": ["input_ids", "attention_mask", "token_type_ids"],
    "gpt2": ["input_ids"],
    "bert-classification": ["input_ids", "attention_mask", "token_type_ids"],
}
INFERENCE_OUTPUTS = {
    "bert-pretraining": ["prediction_logits", "seq_relationship_logits"],
    "gpt2": ["logits"],
    "bert-classification": ["logits"],
}
_BERT_SPECIAL = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                 "mask_token": "[MASK]"}
_GPT2_SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}


@dataclass
class Checkpoint:
    """One checkpoint of a run: its files (every rank's), folder and what the run wrote beside it."""

    files: list
    folder: Path
    model_json: dict | None
    tokenizer: Path | None
    opset: int


def checkpoint_files(path):
    """(files, folder): the checkpoint files `path` stands for -- a file, a checkpoint-N folder or a
    run folder (its newest complete checkpoint) -- with every rank's file of a ZeRO-1 run."""
    p = Path(path)
    if p.is_dir() and models.checkpoint_step(p) is None and not models.complete_checkpoints(p):
        # Not a run's folder: a folder someone saved checkpoint files into.
        names = sorted(n.name for n in p.iterdir() if n.suffix == ".ortcp")
        if models.CHECKPOINT_FILE in names:
            return models.files_to_load(p / models.CHECKPOINT_FILE), p
        if len(names) == 1:
            return [str(p / names[0])], p
        if names:
            raise ValueError(f"{path} holds several checkpoint files ({', '.join(names)}); name one, or give "
                             "all the rank files of one run to `ckpt to-torch`")
    file, folder = models.find_checkpoint(path, "CHECKPOINT")
    return models.files_to_load(file), (Path(folder) if folder else None)


def full_precision_weights(paths):
    """{name: numpy array} of the full-precision weights; rank files (or one shard) are merged first."""
    from orttrainer._utils import FULL_PRECISION_KEY, MODEL_KEY

    state = models.read_checkpoint(paths)
    try:
        weights = state[MODEL_KEY][FULL_PRECISION_KEY]
    except (KeyError, TypeError):
        raise ValueError(f"{paths[0]} holds no {MODEL_KEY}/{FULL_PRECISION_KEY} weights") from None
    return {name: np.asarray(value) for name, value in weights.items()}


def find(path):
    """The Checkpoint `path` names, with what an export needs; one-line ValueError when it lacks some."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist")
    files, folder = checkpoint_files(path)
    folder = folder if folder is not None else Path(files[0]).parent  # model.json beside a bare file
    model_json = tokenizer = None
    opset = DEFAULT_OPSET
    if (folder / models.MODEL_JSON).is_file():
        try:
            model_json = json.loads((folder / models.MODEL_JSON).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{folder / models.MODEL_JSON} is not readable JSON ({exc})") from None
        if (folder / models.TOKENIZER_JSON).is_file():
            tokenizer = folder / models.TOKENIZER_JSON
        if (folder / "recipe.yaml").is_file():
            recipe = parse_yaml((folder / "recipe.yaml").read_text(encoding="utf-8"), str(folder / "recipe.yaml"))
            opset = (((recipe or {}).get("trainer") or {}).get("_internal_use") or {}).get(
                "onnx_opset_version") or DEFAULT_OPSET
    if model_json is None:
        raise ValueError(f"{path}: no {models.MODEL_JSON} (the model kind and config) in {folder}; export needs "
                         "a checkpoint-N folder written by `orttrainer train` (or that file beside the checkpoint)")
    if not isinstance(model_json, dict) or model_json.get("kind") not in INFERENCE_INPUTS:
        kind = model_json.get("kind") if isinstance(model_json, dict) else model_json
        raise ValueError(f"{folder / models.MODEL_JSON}: unknown model kind {kind!r}; "
                         f"expected one of {', '.join(INFERENCE_INPUTS)}")
    return Checkpoint(files, folder, model_json, tokenizer, int(opset))


def build_model(ckpt, for_onnx=False):
    """(kind, config, torch model in eval mode) with the checkpoint's weights; every parameter must
    come from the checkpoint (a missing or misshapen one is an error, never a random init)."""
    import torch

    kind = ckpt.model_json["kind"]
    values = {k: v for k, v in (ckpt.model_json.get("config") or {}).items()
              if k not in ("_name_or_path", "transformers_version")}
    config = models.config_class(kind)(**values)
    if kind == "gpt2" and not for_onnx:
        cls = models._transformers().GPT2LMHeadModel  # the plain class: save_pretrained names it
    else:
        cls = models.model_class(kind)  # gpt2: forward(input_ids), as the trainer exported it
    with torch.random.fork_rng(devices=[]):
        model = cls(config)
    weights = full_precision_weights(ckpt.files)
    for names in models._tied_groups(kind, config):
        present = next((n for n in names if n in weights), None)
        if present is not None:
            for n in names:
                weights.setdefault(n, weights[present])
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state, loaded = model.state_dict(), {}
    for name, tensor in state.items():
        if name not in weights:
            if name in parameters:
                raise ValueError(f"{ckpt.files[0]} has no tensor {name}, a parameter of this {kind} model")
            continue  # a buffer the run did not save keeps the model's own value
        loaded[name] = models.checkpoint_tensor(name, weights[name], tensor, ckpt.files[0], "export")
    model.load_state_dict(loaded, strict=False)
    return kind, config, model.eval()


def _save_tokenizer(ckpt, kind, config, out):
    """tokenizer.json + tokenizer_config.json for AutoTokenizer; False when the run kept none."""
    if ckpt.tokenizer is None:
        return False
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(ckpt.tokenizer))
    vocab = tok.get_vocab()
    special = _GPT2_SPECIAL if kind == "gpt2" else _BERT_SPECIAL
    special = {key: token for key, token in special.items() if token in vocab}
    names = ["input_ids", "attention_mask"] if kind == "gpt2" else ["input_ids", "token_type_ids", "attention_mask"]
    max_length = config.n_positions if kind == "gpt2" else config.max_position_embeddings
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, model_input_names=names,
                            **special).save_pretrained(str(out))
    return True


def _write_hf(ckpt, out):
    kind, config, model = build_model(ckpt)
    model.save_pretrained(str(out), safe_serialization=True)
    return _save_tokenizer(ckpt, kind, config, out)


def _inference_module(kind, model):
    """forward(*inputs) -> the logits (a tuple) of a recipe model, in eval mode, without labels."""
    import torch

    class Inference(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            output = self.model(**dict(zip(INFERENCE_INPUTS[kind], inputs)))
            return tuple(output[name] for name in INFERENCE_OUTPUTS[kind])

    return Inference().eval()


def _write_onnx(ckpt, out):
    import torch

    kind, config, model = build_model(ckpt, for_onnx=True)
    names = INFERENCE_INPUTS[kind]
    sample = torch.ones(2, 8, dtype=torch.int64)
    sample_inputs = tuple(sample if name != "token_type_ids" else torch.zeros_like(sample) for name in names)
    axes = {name: {0: "batch", 1: "seq"} for name in names}
    for name in INFERENCE_OUTPUTS[kind]:
        axes[name] = {0: "batch", 1: "seq"} if name in ("prediction_logits", "logits") and kind != \
            "bert-classification" else {0: "batch"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(_inference_module(kind, model), sample_inputs, str(out / ONNX_FILE), input_names=names,
                          output_names=INFERENCE_OUTPUTS[kind], dynamic_axes=axes, opset_version=ckpt.opset,
                          training=torch.onnx.TrainingMode.EVAL, do_constant_folding=True, dynamo=False)
    config.save_pretrained(str(out))
    return _save_tokenizer(ckpt, kind, config, out)


def export(path, fmt, out, overwrite=False):
    """Write the checkpoint `path` in format `fmt` ('hf' or 'onnx') into the folder `out`; returns
    (Checkpoint, whether a tokenizer was written). An existing non-empty `out` is an error unless
    `overwrite`; the folder is built next to `out` and renamed into place, so a failure leaves `out` as
    it was."""
    if fmt not in FORMATS:
        raise ValueError(f"--format: got {fmt!r}; expected one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty; pass --overwrite to replace it")
    ckpt = find(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    tmp.mkdir()  # not mkdtemp: its 0o700 would stay on the renamed folder
    try:
        wrote_tokenizer = (_write_hf if fmt == "hf" else _write_onnx)(ckpt, tmp)
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        elif out.exists() or out.is_symlink():
            out.unlink()  # a link itself, never what it points to
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt, wrote_tokenizer


def export_at_end(folder, formats, run_dir, say):
    """`run.export_at_end`: the final checkpoint `folder` into run_dir/export-<format>/ (replaced)."""
    from orttrainer.run.errors import TrainingError

    for fmt in formats:
        out = Path(run_dir) / f"export-{fmt}"
        try:
            _, wrote_tokenizer = export(folder, fmt, out, overwrite=True)
        except (OSError, ValueError, KeyError) as exc:
            raise TrainingError(f"run.export_at_end: cannot write {out} from {folder}: {exc}; the checkpoint is "
                                f"saved, export it with: orttrainer ckpt export {folder} --format {fmt} "
                                f"--out {out}") from exc
        say(f"exported {folder.name} to {out} ({fmt})" + ("" if wrote_tokenizer else "; the run kept no tokenizer"))
