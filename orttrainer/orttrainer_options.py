"""ORTTrainerOptions: the legacy options object (docs/legacy-api.md §1.3), validated with cerberus.

The schema is data (schemas/options.yaml); this module supplies the custom types it names, the
attribute-style access of the legacy class, and the cross-field checks the original lacked.
Option meanings are documented in docs/options.md.
"""

import sys
from collections.abc import Mapping
from enum import IntEnum, unique

import cerberus

from orttrainer._config import validation as _validation
from orttrainer.amp.loss_scaler import LossScaler
from orttrainer.optim.lr_scheduler import _LRScheduler
from orttrainer.placement.dims import LayoutError, ParallelDims


@unique
class PropagateCastOpsStrategy(IntEnum):
    """Cast-propagation strategies of onnxruntime training (legacy names and values)."""

    NONE = 0
    INSERT_AND_REDUCE = 1
    FLOOD_FILL = 2
    REMOVE_INPUT_OUTPUT_UP_DOWN_CASTS = 3


def options_schema():
    """A fresh copy of the options schema (a cerberus schema, plain data)."""
    return _validation.load_schema("options.yaml")


_SCHEMA = options_schema()
_ORTTRAINER_OPTIONS_SCHEMA = _SCHEMA  # the original's name of the schema (cerberus rules, as data here)


def _check_is_callable(field, value, error):
    """cerberus check: `value` is None or callable, else error(field, "Must be callable or None")."""
    if not (value is None or callable(value)):
        error(field, "Must be callable or None")

_TYPE_HELP = {
    "lr_scheduler": "an orttrainer.optim.lr_scheduler._LRScheduler instance "
    "(e.g. LinearWarmupLRScheduler(total_steps=1000))",
    "loss_scaler": "an orttrainer.amp.LossScaler instance (e.g. DynamicLossScaler())",
    "session_options": "an onnxruntime.SessionOptions instance",
    "propagate_cast_ops_strategy": "a PropagateCastOpsStrategy member or its name ("
    + ", ".join(PropagateCastOpsStrategy.__members__)
    + ")",
}


class _SessionOptionsMeta(type):
    def __instancecheck__(cls, value):
        # A SessionOptions can only exist once onnxruntime is imported: no need to import it here
        # (keeps light entry points such as the CLI free of onnxruntime).
        ort = sys.modules.get("onnxruntime")
        return ort is not None and isinstance(value, ort.SessionOptions)


class _SessionOptions(metaclass=_SessionOptionsMeta):
    """Stands for onnxruntime.SessionOptions in isinstance checks, without importing onnxruntime."""


class ORTTrainerOptionsValidator(cerberus.Validator):
    """cerberus Validator with the custom types, coercions and checks options.yaml refers to."""

    types_mapping = {
        **cerberus.Validator.types_mapping,
        "lr_scheduler": cerberus.TypeDefinition("lr_scheduler", (_LRScheduler,), ()),
        "loss_scaler": cerberus.TypeDefinition("loss_scaler", (LossScaler,), ()),
        "session_options": cerberus.TypeDefinition("session_options", (_SessionOptions,), ()),
        "propagate_cast_ops_strategy": cerberus.TypeDefinition(
            "propagate_cast_ops_strategy", (PropagateCastOpsStrategy,), ()
        ),
    }

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("error_handler", _validation.SafeErrorHandler)
        super().__init__(*args, **kwargs)

    def _normalize_coerce_strategy_name(self, value):
        # Recipes (YAML) can only name the strategy; Python callers pass the member itself.
        if isinstance(value, str) and value in PropagateCastOpsStrategy.__members__:
            return PropagateCastOpsStrategy[value]
        return value

    def _check_with_callable_or_none(self, field, value):
        _check_is_callable(field, value, self._error)


def _cross_field_problems(opts):
    """Checks between fields that a per-field schema cannot express."""
    problems = []
    mp = opts["mixed_precision"]
    if mp.get("compute_dtype", "auto") in ("float16", "bfloat16") and not mp["enabled"]:
        problems.append(
            f"mixed_precision.compute_dtype is {mp['compute_dtype']!r} but mixed_precision.enabled is "
            f"{mp['enabled']}: low-precision compute needs mixed precision (fp32 master weights, loss "
            "scaling); set mixed_precision.enabled=True"
        )
    if mp["loss_scaler"] is not None and not mp["enabled"]:
        problems.append(
            f"mixed_precision.loss_scaler is {_validation.short_repr(mp['loss_scaler'])} but "
            f"mixed_precision.enabled is {mp['enabled']}: "
            "Loss Scaler cannot be specified when Mixed Precision is not enabled"
        )

    dist = opts["distributed"]
    world = dist["world_size"]
    for rank in ("world_rank", "local_rank"):
        if dist[rank] >= world:
            problems.append(
                f"distributed.{rank} ({dist[rank]}) must be smaller than distributed.world_size ({world})"
            )
    try:
        ParallelDims.of(dist)
    except LayoutError as exc:
        problems.append(str(exc))

    gt = opts["graph_transformer"]
    if gt["number_recompute_layers"] > 0 and not gt["transformer_layer_recompute"]:
        problems.append(
            f"graph_transformer.number_recompute_layers ({gt['number_recompute_layers']}) needs "
            "graph_transformer.transformer_layer_recompute to be True "
            f"(it is {gt['transformer_layer_recompute']})"
        )
    return problems


def validate_options(options):
    """Normalized copy of `options` (defaults filled in), or ValueError naming every problem."""
    validator = ORTTrainerOptionsValidator(_SCHEMA)
    normalized = _validation.validate(validator, options, "options", _TYPE_HELP)
    normalized = _validation.copy_plain(normalized)  # no list/dict shared with schema defaults
    problems = _cross_field_problems(normalized)
    if problems:
        raise ValueError("Invalid options: " + "; ".join(problems))
    return normalized


def _read_absent_as_default(node, schema):
    """Keys added after the legacy schema carry their default in `meta.default`: left out of
    `_validated_opts` when not given (the legacy default dict stays exactly the legacy one), they
    still read as that default through attributes (`opts.mixed_precision.compute_dtype`)."""
    for key, rules in schema.items():
        if rules.get("type") == "dict" and "schema" in rules:
            child = getattr(node, key, None)
            if isinstance(child, ORTTrainerOptions):
                _read_absent_as_default(child, rules["schema"])
        elif "default" in rules.get("meta", {}) and not hasattr(node, key):
            setattr(node, key, rules["meta"]["default"])


# Attribute names that nested option keys (e.g. free-form provider_options) must not overwrite.
_RESERVED = {"_original_opts", "_validated_opts", "_main_class_name"}


class ORTTrainerOptions:
    r"""Settings used by the training backend, grouped by feature (see docs/options.md).

    Args:
        options (dict): nested option dict; missing keys take their defaults, unknown keys are errors.

    Raises:
        ValueError: `str(exc)` is the legacy `Invalid options: {cerberus errors}`; the exception's
            notes explain each problem in words.

    Example:
        >>> opts = ORTTrainerOptions({'batch': {'gradient_accumulation_steps': 4}})
        >>> opts.batch.gradient_accumulation_steps, opts.device.id
        (4, 'cuda')
    """

    def __init__(self, options=None):
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise TypeError(f"'options' must be a dict, got {type(options).__name__}")
        # Copies of the caller's containers (their objects keep their identity); never mutated.
        self._original_opts = _validation.copy_plain(options)
        self._main_class_name = self.__class__.__name__
        self._validated_opts = validate_options(self._original_opts)
        self._set_attributes(self._validated_opts)
        _read_absent_as_default(self, _SCHEMA)

    def _set_attributes(self, options):
        for key, value in options.items():
            if isinstance(key, str) and not key.startswith("__") and key not in _RESERVED:
                setattr(self, key, self._wrap(value))

    def _wrap(self, value):
        if isinstance(value, (tuple, list, set, frozenset)):
            return type(value)(self._wrap(v) for v in value)
        if isinstance(value, dict):
            return _ORTTrainerOptionsInternal(self._main_class_name, value)
        return value

    def __repr__(self):
        hidden = ("_original_opts", "_validated_opts", "_main_class_name")
        return "{%s}" % ", ".join(f"'{k}': {v!r}" for k, v in self.__dict__.items() if k not in hidden)


class _ORTTrainerOptionsInternal(ORTTrainerOptions):
    r"""Attribute view of one nested (already validated) option dict. Users must not create it."""

    def __init__(self, main_class_name, options):
        self._main_class_name = main_class_name
        self._validated_opts = dict(options)
        self._set_attributes(options)
