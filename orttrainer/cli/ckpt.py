"""`orttrainer ckpt`: look into, merge and convert ORTTrainer checkpoint files.

    orttrainer ckpt inspect PATH               tree of the file (or of a checkpoint-N folder's file)
    orttrainer ckpt merge PATH... --out OUT    merge per-rank (ZeRO / Megatron) files into one
    orttrainer ckpt to-torch PATH... --out OUT full-precision weights as a torch state_dict
                                               (.pt / .pth: torch.save; .safetensors)
    orttrainer ckpt export CHECKPOINT --format hf|onnx --out DIR
                                               a Hugging Face folder (config, safetensors, tokenizer)
                                               or an inference ONNX model (orttrainer/run/model_export.py)

A PATH / CHECKPOINT may be a checkpoint file, a checkpoint-N folder of `orttrainer train` (every
rank's file of a ZeRO-1, tensor-parallel or pipeline run is read and merged, as --resume merges them)
or a run folder (its newest complete checkpoint). The older positional outputs still work:
`merge OUT PATH...` and `to-torch PATH... OUT`.

Expected errors (missing or bad files, inconsistent ranks, an existing output) print one line to
stderr and exit with status 2.
"""

import os
import pickle
import sys

import h5py
import numpy as np

from orttrainer import _checkpoint_storage, checkpoint
from orttrainer.state.aggregation import PIPELINE_SIZE_KEY
from orttrainer._utils import (
    FULL_PRECISION_KEY, HORIZONTAL_PARALLEL_SIZE_KEY, MODEL_KEY, TRAIN_STEP_INFO_KEY,
    TRAINER_OPTIONS_KEY, USER_DICT_KEY, ZERO_STAGE_KEY,
)

# What bad input raises (missing/corrupt files, inconsistent ranks, existing outputs); anything
# else is a bug and keeps its traceback.
_EXPECTED_ERRORS = (OSError, ValueError, KeyError, pickle.UnpicklingError)
_TORCH_SUFFIXES = (".pt", ".pth")
_SAFETENSORS_SUFFIX = ".safetensors"


def register(subparsers):
    parser = subparsers.add_parser("ckpt", help="inspect, merge and convert checkpoint files",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="ckpt_command", metavar="ACTION")
    commands.required = True

    inspect = commands.add_parser("inspect", help="print the tree of a checkpoint file")
    inspect.add_argument("path", help="checkpoint file (.ortcp), or a checkpoint-N folder holding one")
    inspect.set_defaults(func=_guarded(_inspect))

    merge = commands.add_parser("merge", help="merge per-rank checkpoint files into one checkpoint file",
                                usage="%(prog)s [-h] [--overwrite] PATH... --out OUT  (or: OUT PATH...)")
    merge.add_argument("paths", nargs="+", metavar="PATH", help="rank files, in any order")
    merge.add_argument("--out", metavar="OUT", help="merged checkpoint file to write (or the first positional)")
    merge.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    merge.set_defaults(func=_guarded(_with_output(_merge, positional=0)))

    to_torch = commands.add_parser("to-torch", help="write the full-precision weights as a torch state_dict",
                                   usage="%(prog)s [-h] [--overwrite] PATH... --out OUT  (or: PATH... OUT)")
    to_torch.add_argument("paths", nargs="+", metavar="PATH",
                          help="a checkpoint file or checkpoint-N folder, or the rank files of one run (merged first)")
    to_torch.add_argument("--out", metavar="OUT", help=f"output file: {' / '.join(_TORCH_SUFFIXES)} or "
                                                       f"{_SAFETENSORS_SUFFIX} (or the last positional)")
    to_torch.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    to_torch.set_defaults(func=_guarded(_with_output(_to_torch, positional=-1)))

    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face folder or an ONNX model")
    export.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="checkpoint-N folder or run folder of `orttrainer train` (a bare file has no model "
                             "config and tokenizer)")
    export.add_argument("--format", required=True, choices=["hf", "onnx"],
                        help="hf: config.json + model.safetensors + tokenizer; onnx: model.onnx for inference")
    export.add_argument("--out", required=True, metavar="DIR", help="output folder (new or empty)")
    export.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    export.set_defaults(func=_guarded(_export))


def _with_output(command, positional):
    """`command` with args.out set: --out, or (the older form) the positional at index `positional`
    (merge: the first, to-torch: the last). Exactly one of them must name the output."""
    def run(args):
        name = f"orttrainer ckpt {args.ckpt_command}"
        if args.out is None:
            if len(args.paths) < 2:
                raise ValueError(f"no output given; add --out OUT ({name} PATH... --out OUT)")
            args.out = args.paths.pop(positional)
        elif positional and args.paths[-1].lower().endswith((*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX)):
            raise ValueError(f"the output is given twice ({args.paths[-1]} and --out {args.out}); give it once, "
                             "with --out")
        elif not positional and not os.path.lexists(args.paths[0]):
            # Most likely the older form's OUT as well as --out: name both.
            raise ValueError(f"{args.paths[0]} does not exist; with --out {args.out} every PATH is an input file "
                             "(give the output once)")
        return command(args)

    return run


def _guarded(command):
    def run(args):
        try:
            return command(args)
        except _EXPECTED_ERRORS as exc:
            # KeyError's str() adds quotes; notes carry the detail (e.g. "probably truncated").
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            text = " ".join([str(message), *getattr(exc, "__notes__", [])]).replace("\n", " ")
            print(f"orttrainer ckpt {args.ckpt_command}: error: {text}", file=sys.stderr)
            return 2

    return run


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------

def _checkpoint_in(path):
    """`path`, or the checkpoint file inside the folder `path` (a checkpoint-N folder of a run)."""
    if not os.path.isdir(path):
        return path
    files = sorted(name for name in os.listdir(path) if name.endswith(".ortcp"))
    if "checkpoint.ortcp" in files:  # rank 0's file of `orttrainer train` (other ranks: checkpoint.rankR)
        return os.path.join(path, "checkpoint.ortcp")
    if len(files) == 1:
        return os.path.join(path, files[0])
    found = f"several: {', '.join(files)}; name one" if files else "none"
    raise FileNotFoundError(f"{path} is a folder; looked for a checkpoint file (.ortcp) in it and found {found}")


def _inspect(args):
    args.path = _checkpoint_in(args.path)
    with _checkpoint_storage.open_checkpoint(args.path) as f:
        lines = [f"{args.path}"]
        lines += _summary(f)
        lines.append("")
        _tree(f, "", lines)
    print("\n".join(lines))
    return 0


def _summary(f):
    """Headline lines: steps, trainer options, model size, user_dict keys."""
    lines = []
    if TRAIN_STEP_INFO_KEY in f:
        info = {key: _scalar(item[()]) for key, item in f[TRAIN_STEP_INFO_KEY].items()}
        lines.append("train_step_info: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    if TRAINER_OPTIONS_KEY in f:
        options = {key: _scalar(item[()]) for key, item in f[TRAINER_OPTIONS_KEY].items()}
        lines.append("trainer_options: " + ", ".join(f"{k}={v}" for k, v in options.items()))
        if (options.get(ZERO_STAGE_KEY, 0) > 0 or options.get(HORIZONTAL_PARALLEL_SIZE_KEY, 1) > 1
                or options.get(PIPELINE_SIZE_KEY, 1) > 1):
            lines.append("  (one rank's shard: merge the rank files with `orttrainer ckpt merge`)")
    weights = f.get(f"{MODEL_KEY}/{FULL_PRECISION_KEY}")
    if weights is not None:
        count = sum(int(np.prod(item.shape)) for item in weights.values() if hasattr(item, "shape"))
        lines.append(f"model: {len(weights)} tensors, {count:,} values")
    if USER_DICT_KEY in f:
        lines.append("user_dict: " + _describe_user_dict(f[USER_DICT_KEY][()]))
    return lines


def _describe_user_dict(raw):
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    kind = "json" if text.startswith("json:") else "pickle"
    try:
        value = _checkpoint_storage.decode_user_dict(text)  # the restricted unpickler: runs no code
    except pickle.UnpicklingError:
        return f"{kind}, holds objects other than plain data (not decoded)"
    except ValueError as exc:
        return f"unreadable ({exc})"
    if isinstance(value, dict):
        return f"{kind}, keys: {', '.join(map(str, value)) or '(none)'}"
    return f"{kind}, a {type(value).__name__}"


def _tree(group, indent, lines):
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            lines.append(f"{indent}{key}/")
            _tree(item, indent + "  ", lines)
        elif key == USER_DICT_KEY and not indent:
            lines.append(f"{indent}{key}: str ({len(item[()])} characters)")
        elif item.shape == ():
            lines.append(f"{indent}{key}: {_dtype(item)} = {_scalar(item[()])}")
        elif item.size <= 4 and item.dtype.kind in "biuf":  # small lists such as original_dim
            lines.append(f"{indent}{key}: {_dtype(item)}{list(item.shape)} = {item[()].tolist()}")
        else:
            lines.append(f"{indent}{key}: {_dtype(item)}{list(item.shape)}")


def _dtype(dataset):
    return "str" if dataset.dtype.kind in "OSU" else str(dataset.dtype)


def _scalar(value):
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value.item() if isinstance(value, np.generic) else value


# --------------------------------------------------------------------------------------------
# merge / to-torch
# --------------------------------------------------------------------------------------------

def _merge(args):
    _refuse_existing(args.out, args.overwrite)
    files = _checkpoint_files(args.paths)
    state = checkpoint.aggregate_checkpoints(files, pytorch_format=False)
    if state is None:
        raise ValueError(f"nothing to merge: {files[0]} is not a ZeRO, Megatron or pipeline rank file "
                         "(zero_stage 0, horizontal_parallel_size 1, one stage); it is a complete checkpoint "
                         "already")
    _checkpoint_storage.save(state, args.out, overwrite=args.overwrite)
    print(f"merged {len(files)} files into {args.out}")
    return 0


def _checkpoint_files(paths):
    """The files `paths` stand for: a folder (checkpoint-N or run folder) for every rank's file of its
    checkpoint (orttrainer/run/model_export.py), a file for itself."""
    from orttrainer.run import model_export as export

    files = []
    for path in paths:
        files += export.checkpoint_files(path)[0] if os.path.isdir(path) else [path]
    return files


def _to_torch(args):
    suffix = os.path.splitext(args.out)[1].lower()
    if suffix not in (*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX):
        raise ValueError(f"{args.out}: the output must end with {', '.join(_TORCH_SUFFIXES)} "
                         f"or {_SAFETENSORS_SUFFIX}")
    _refuse_existing(args.out, args.overwrite)
    weights = _full_precision_weights(args.paths)

    import torch

    tensors = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in weights.items()}
    if suffix == _SAFETENSORS_SUFFIX:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ValueError("writing .safetensors needs the safetensors package "
                             "(pip install safetensors)") from None

        def write(tmp_path):
            save_file(tensors, tmp_path, metadata={"format": "pt"})
    else:
        def write(tmp_path):
            torch.save(tensors, tmp_path)

    _checkpoint_storage.atomic_write(args.out, write, overwrite=args.overwrite)
    print(f"wrote {len(tensors)} tensors to {args.out}")
    return 0


def _full_precision_weights(paths):
    """{name: numpy array} of the full-precision weights; rank files (or one shard) are merged first.
    A folder stands for its checkpoint files (every rank's)."""
    from orttrainer.run import model_export as export

    return export.full_precision_weights(_checkpoint_files(paths))


def _export(args):
    from orttrainer.run import model_export as export

    ckpt, wrote_tokenizer = export.export(args.checkpoint, args.format, args.out, overwrite=args.overwrite)
    if not wrote_tokenizer:
        print(f"orttrainer ckpt export: warning: {ckpt.folder} holds no tokenizer.json; "
              "the export has no tokenizer", file=sys.stderr)
    print(f"wrote {args.out} ({args.format}) from {', '.join(ckpt.files)}")
    return 0


def _refuse_existing(path, overwrite):
    # Checked before any work; atomic_write checks again when it writes.
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
