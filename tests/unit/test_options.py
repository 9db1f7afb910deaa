"""ORTTrainerOptions: schema, defaults, attribute access, exact errors, cross-field checks."""

import copy

import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orttrainer import ORTTrainerOptions, amp, optim
from orttrainer.orttrainer_options import (
    PropagateCastOpsStrategy,
    _ORTTrainerOptionsInternal,
    options_schema,
)

EXPECTED_DEFAULTS = {
    "batch": {"gradient_accumulation_steps": 1},
    "device": {"id": "cuda", "mem_limit": 0},
    "distributed": {
        "world_rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "data_parallel_size": 1,
        "horizontal_parallel_size": 1,
        "pipeline_parallel": {
            "pipeline_parallel_size": 1,
            "num_pipeline_micro_batches": 1,
            "pipeline_cut_info_string": "",
            "sliced_schema": {},
            "sliced_axes": {},
            "sliced_tensor_names": [],
        },
        "allreduce_post_accumulation": False,
        "deepspeed_zero_optimization": {"stage": 0},
        "enable_adasum": False,
    },
    "lr_scheduler": None,
    "mixed_precision": {"enabled": False, "loss_scaler": None},
    "graph_transformer": {
        "attn_dropout_recompute": False,
        "gelu_recompute": False,
        "transformer_layer_recompute": False,
        "number_recompute_layers": 0,
        "allow_layer_norm_mod_precision": False,
        "propagate_cast_ops_config": {
            "strategy": PropagateCastOpsStrategy.FLOOD_FILL,
            "level": 1,
            "allow": [],
        },
    },
    "utils": {
        "frozen_weights": [],
        "grad_norm_clip": True,
        "memory_efficient_gradient": False,
        "run_symbolic_shape_infer": False,
    },
    "debug": {
        "deterministic_compute": False,
        "check_model_export": False,
        "graph_save_paths": {
            "model_after_graph_transforms_path": "",
            "model_with_gradient_graph_path": "",
            "model_with_training_graph_path": "",
            "model_with_training_graph_after_optimization_path": "",
        },
    },
    "_internal_use": {
        "enable_internal_postprocess": True,
        "extra_postprocess": None,
        "onnx_opset_version": 14,
        "enable_onnx_contrib_ops": True,
    },
    "provider_options": {},
    "session_options": None,
}


def invalid(options):
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions(options)
    return info.value


# --- defaults and access -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        None,
        {},
        {
            "batch": {},
            "device": {},
            "distributed": {},
            "mixed_precision": {},
            "utils": {},
            "_internal_use": {},
        },
        {
            "batch": {},
            "device": {},
            "distributed": {"pipeline_parallel": {}, "deepspeed_zero_optimization": {}},
            "mixed_precision": {},
            "graph_transformer": {"propagate_cast_ops_config": {}},
            "utils": {},
            "debug": {"graph_save_paths": {}},
            "_internal_use": {},
            "provider_options": {},
        },
    ],
)
def test_defaults(options):
    opts = ORTTrainerOptions() if options is None else ORTTrainerOptions(options)
    assert opts._validated_opts == EXPECTED_DEFAULTS


def test_extension_keys_stay_out_of_the_legacy_defaults_but_are_validated_and_read():
    """utils.export_cache*: not legacy keys, so absent from _validated_opts unless given (the upstream
    options test compares the whole defaults dict), yet read as their defaults and checked when given."""
    opts = ORTTrainerOptions()
    assert "export_cache" not in opts._validated_opts["utils"]
    assert (opts.utils.export_cache, opts.utils.export_cache_dir, opts.utils.export_cache_max_bytes) == \
        (True, "", 4294967296)
    given = ORTTrainerOptions({"utils": {"export_cache": False, "export_cache_max_bytes": 10}})
    assert given._validated_opts["utils"]["export_cache"] is False and given.utils.export_cache is False
    assert given.utils.export_cache_max_bytes == 10 and given.utils.export_cache_dir == ""
    with pytest.raises(ValueError, match="export_cache_max_bytes"):
        ORTTrainerOptions({"utils": {"export_cache_max_bytes": -1}})
    with pytest.raises(ValueError, match="export_cache"):
        ORTTrainerOptions({"utils": {"export_cache": "yes"}})


def test_attribute_access_at_any_depth():
    opts = ORTTrainerOptions({"distributed": {"deepspeed_zero_optimization": {"stage": 1}}})
    assert opts.distributed.deepspeed_zero_optimization.stage == 1
    assert opts.distributed.pipeline_parallel.sliced_tensor_names == []
    assert opts.graph_transformer.propagate_cast_ops_config.strategy is PropagateCastOpsStrategy.FLOOD_FILL
    assert opts._internal_use.onnx_opset_version == 14
    assert opts.device.id == "cuda"
    assert isinstance(opts.distributed, _ORTTrainerOptionsInternal)
    assert opts.distributed._validated_opts["deepspeed_zero_optimization"] == {"stage": 1}
    assert "deepspeed_zero_optimization" in repr(opts)


def test_original_opts_kept():
    given_opts = {"batch": {"gradient_accumulation_steps": 3}}
    opts = ORTTrainerOptions(given_opts)
    assert opts._original_opts == given_opts
    assert opts._validated_opts["batch"]["gradient_accumulation_steps"] == 3


def test_caller_dict_is_not_mutated_and_objects_keep_identity():
    scheduler = optim.LinearWarmupLRScheduler(total_steps=10, warmup=0.1)
    scaler = amp.DynamicLossScaler()
    session_options = ort.SessionOptions()

    def postprocess(model):
        return model

    given_opts = {
        "lr_scheduler": scheduler,
        "mixed_precision": {"enabled": True, "loss_scaler": scaler},
        "session_options": session_options,
        "_internal_use": {"extra_postprocess": postprocess},
        "utils": {"frozen_weights": ["fc1.weight"]},
        "distributed": {"pipeline_parallel": {"sliced_schema": {"x": [1, 2]}}},
    }
    frozen = given_opts["utils"]["frozen_weights"]
    snapshot = copy.copy(given_opts), {k: copy.copy(v) for k, v in given_opts.items() if isinstance(v, dict)}

    opts = ORTTrainerOptions(given_opts)
    opts.utils.frozen_weights.append("buffer")
    opts._validated_opts["utils"]["frozen_weights"].append("buffer")
    opts._validated_opts["distributed"]["pipeline_parallel"]["sliced_schema"]["x"].append(3)

    assert given_opts == snapshot[0]
    assert {k: v for k, v in given_opts.items() if isinstance(v, dict)} == snapshot[1]
    assert frozen == ["fc1.weight"]
    assert given_opts["distributed"]["pipeline_parallel"]["sliced_schema"] == {"x": [1, 2]}
    assert "_internal_use" not in given_opts["mixed_precision"]
    assert opts.lr_scheduler is scheduler
    assert opts.mixed_precision.loss_scaler is scaler
    assert opts._validated_opts["mixed_precision"]["loss_scaler"] is scaler
    assert opts.session_options is session_options
    assert opts._internal_use.extra_postprocess is postprocess


def test_defaults_are_not_shared_between_instances():
    first, second = ORTTrainerOptions(), ORTTrainerOptions()
    first._validated_opts["utils"]["frozen_weights"].append("w")
    first._validated_opts["provider_options"]["X"] = {}
    assert second._validated_opts == EXPECTED_DEFAULTS
    assert ORTTrainerOptions()._validated_opts == EXPECTED_DEFAULTS


def test_mixed_precision_does_not_get_a_default_loss_scaler():
    opts = ORTTrainerOptions({"mixed_precision": {"enabled": True}})
    assert opts.mixed_precision.loss_scaler is None


def test_not_a_dict():
    with pytest.raises(TypeError, match="'options' must be a dict, got list"):
        ORTTrainerOptions([("batch", {})])


# --- custom types and ranges ---------------------------------------------------------------------


def test_custom_types_accepted():
    opts = ORTTrainerOptions(
        {
            "lr_scheduler": optim.PolyWarmupLRScheduler(total_steps=10),
            "mixed_precision": {"enabled": True, "loss_scaler": amp.LossScaler(2.0)},
            "session_options": ort.SessionOptions(),
            "_internal_use": {"extra_postprocess": len},
            "graph_transformer": {"propagate_cast_ops_config": {"strategy": PropagateCastOpsStrategy.NONE}},
        }
    )
    assert isinstance(opts.lr_scheduler, optim.PolyWarmupLRScheduler)
    assert opts.graph_transformer.propagate_cast_ops_config.strategy is PropagateCastOpsStrategy.NONE


@pytest.mark.parametrize(
    "options,message",
    [
        ({"lr_scheduler": 0.1}, "{'lr_scheduler': ['must be of lr_scheduler type']}"),
        (
            {"mixed_precision": {"loss_scaler": 2.0}},
            "{'mixed_precision': [{'loss_scaler': ['must be of loss_scaler type']}]}",
        ),
        ({"session_options": {}}, "{'session_options': ['must be of session_options type']}"),
        (
            {"_internal_use": {"extra_postprocess": 3}},
            "{'_internal_use': [{'extra_postprocess': ['Must be callable or None']}]}",
        ),
        (
            {"_internal_use": {"onnx_opset_version": 11}},
            "{'_internal_use': [{'onnx_opset_version': ['min value is 12']}]}",
        ),
        (
            {"_internal_use": {"onnx_opset_version": 18}},
            "{'_internal_use': [{'onnx_opset_version': ['max value is 17']}]}",
        ),
        (
            {"batch": {"gradient_accumulation_steps": 0}},
            "{'batch': [{'gradient_accumulation_steps': ['min value is 1']}]}",
        ),
        (
            {"distributed": {"deepspeed_zero_optimization": {"stage": 2}}},
            "{'distributed': [{'deepspeed_zero_optimization': [{'stage': ['max value is 1']}]}]}",
        ),
        ({"device": {"id": 0}}, "{'device': [{'id': ['must be of string type']}]}"),
        (
            {"utils": {"frozen_weights": ["a", 1]}},
            "{'utils': [{'frozen_weights': [{1: ['must be of string type']}]}]}",
        ),
        (
            {"graph_transformer": {"propagate_cast_ops_config": {"strategy": 2}}},
            "{'graph_transformer': [{'propagate_cast_ops_config': [{'strategy': "
            "['must be of propagate_cast_ops_strategy type']}]}]}",
        ),
        (
            {"utils": {"invertible_layer_norm_gradient": True}},
            "{'utils': [{'invertible_layer_norm_gradient': ['unknown field']}]}",
        ),
        (
            {"provider_options": {"CUDAExecutionProvider": 1}},
            "{'provider_options': [{'CUDAExecutionProvider': ['must be of dict type']}]}",
        ),
    ],
)
def test_invalid_values_exact_message(options, message):
    assert str(invalid(options)) == f"Invalid options: {message}"


def test_invalid_mixed_precision_enabled_exact_message():
    exc = invalid({"mixed_precision": {"enabled": 1}})
    assert str(exc) == "Invalid options: {'mixed_precision': [{'enabled': ['must be of boolean type']}]}"
    assert exc.__notes__ == ["mixed_precision.enabled: got 1; expected a bool (True/False)"]


@pytest.mark.parametrize("version", [12, 13, 14, 15, 16, 17])
def test_opset_range(version):
    assert (
        ORTTrainerOptions({"_internal_use": {"onnx_opset_version": version}})._internal_use.onnx_opset_version
        == version
    )


def test_strategy_given_by_name():
    opts = ORTTrainerOptions(
        {"graph_transformer": {"propagate_cast_ops_config": {"strategy": "INSERT_AND_REDUCE"}}}
    )
    assert (
        opts.graph_transformer.propagate_cast_ops_config.strategy
        is PropagateCastOpsStrategy.INSERT_AND_REDUCE
    )
    exc = invalid({"graph_transformer": {"propagate_cast_ops_config": {"strategy": "FLOOD"}}})
    assert "FLOOD_FILL" in exc.__notes__[0]


def test_strategy_enum_values():
    assert [(m.name, m.value) for m in PropagateCastOpsStrategy] == [
        ("NONE", 0),
        ("INSERT_AND_REDUCE", 1),
        ("FLOOD_FILL", 2),
        ("REMOVE_INPUT_OUTPUT_UP_DOWN_CASTS", 3),
    ]


def test_provider_options_accept_any_provider():
    providers = {"MyExecutionProvider": {"device_id": "1", "arena": 2}, "CPUExecutionProvider": {}}
    opts = ORTTrainerOptions({"provider_options": providers})
    assert opts._validated_opts["provider_options"] == providers
    assert opts.provider_options.MyExecutionProvider.device_id == "1"


def test_reserved_names_in_free_form_keys_do_not_break_attributes():
    opts = ORTTrainerOptions({"provider_options": {"__class__": {}, "_validated_opts": {"a": 1}}})
    assert opts._validated_opts["provider_options"] == {"__class__": {}, "_validated_opts": {"a": 1}}
    assert type(opts.provider_options) is _ORTTrainerOptionsInternal


# --- readable notes ------------------------------------------------------------------------------


def test_unknown_keys_are_errors_with_did_you_mean():
    exc = invalid({"batchh": {}, "distributed": {"world_sise": 4}})
    assert str(exc) == (
        "Invalid options: {'batchh': ['unknown field'], 'distributed': [{'world_sise': ['unknown field']}]}"
    )
    assert exc.__notes__ == [
        "batchh: got {}; unknown key, did you mean 'batch'?",
        "distributed.world_sise: got 4; unknown key, did you mean 'distributed.world_size'?",
    ]


def test_unknown_key_without_close_match_lists_known_keys():
    exc = invalid({"device": {"zzz": 1}})
    assert exc.__notes__ == ["device.zzz: got 1; unknown key; known keys here: id, mem_limit"]


def test_notes_name_path_value_and_allowed():
    exc = invalid(
        {"distributed": {"world_rank": -1}, "lr_scheduler": "linear", "session_option": ort.SessionOptions()}
    )
    assert exc.__notes__ == [
        "distributed.world_rank: got -1; expected an int >= 0",
        "lr_scheduler: got 'linear'; expected an orttrainer.optim.lr_scheduler._LRScheduler instance "
        "(e.g. LinearWarmupLRScheduler(total_steps=1000)), or None",
        "session_option: got <SessionOptions object>; unknown key, did you mean 'session_options'?",
    ]


def test_keys_that_are_not_strings():
    exc = invalid({None: 1, "distributed": {1.5: 2}})
    assert str(exc) == "Invalid options: {None: ['unknown field'], 'distributed': [{1.5: ['unknown field']}]}"
    assert exc.__notes__ == [
        "None: keys must be strings, got None",
        "distributed.1.5: keys must be strings, got 1.5",
    ]


# --- cross-field checks --------------------------------------------------------------------------


def test_loss_scaler_without_mixed_precision():
    exc = invalid({"mixed_precision": {"loss_scaler": amp.DynamicLossScaler(loss_scale=8.0)}})
    message = str(exc)
    assert message.startswith(
        "Invalid options: mixed_precision.loss_scaler is DynamicLossScaler(loss_scale=8.0"
    )
    assert "mixed_precision.enabled is False" in message
    assert "Loss Scaler cannot be specified when Mixed Precision is not enabled" in message


@pytest.mark.parametrize("rank", ["world_rank", "local_rank"])
def test_rank_must_be_below_world_size(rank):
    exc = invalid({"distributed": {"world_size": 2, rank: 2}})
    assert (
        str(exc) == f"Invalid options: distributed.{rank} (2) must be smaller than distributed.world_size (2)"
    )


def test_parallel_sizes_must_divide_world_size_when_data_parallel_is_inferred():
    exc = invalid({"distributed": {"world_size": 4, "horizontal_parallel_size": 3}})
    assert str(exc).startswith(
        "Invalid options: distributed.horizontal_parallel_size (3) x "
        "distributed.pipeline_parallel.pipeline_parallel_size (1) = 3 must divide distributed.world_size (4)"
    )


def test_parallel_sizes_must_equal_world_size_when_data_parallel_is_set():
    exc = invalid({"distributed": {"world_size": 8, "data_parallel_size": 2, "horizontal_parallel_size": 2}})
    assert str(exc) == (
        "Invalid options: distributed.data_parallel_size (2) x distributed.horizontal_parallel_size (2) x "
        "distributed.pipeline_parallel.pipeline_parallel_size (1) = 4 must equal distributed.world_size (8)"
    )


@pytest.mark.parametrize(
    "distributed",
    [
        {"world_size": 8, "world_rank": 7, "local_rank": 3, "horizontal_parallel_size": 2},
        {"world_size": 8, "horizontal_parallel_size": 2, "pipeline_parallel": {"pipeline_parallel_size": 2}},
        {
            "world_size": 8,
            "data_parallel_size": 2,
            "horizontal_parallel_size": 2,
            "pipeline_parallel": {"pipeline_parallel_size": 2},
        },
        {"world_size": 4, "data_parallel_size": 4},
    ],
)
def test_parallel_sizes_that_fit(distributed):
    assert ORTTrainerOptions({"distributed": distributed}).distributed.world_size == distributed["world_size"]


def test_recompute_layers_need_layer_recompute():
    exc = invalid({"graph_transformer": {"number_recompute_layers": 2}})
    assert str(exc) == (
        "Invalid options: graph_transformer.number_recompute_layers (2) needs "
        "graph_transformer.transformer_layer_recompute to be True (it is False)"
    )
    opts = ORTTrainerOptions(
        {"graph_transformer": {"number_recompute_layers": 2, "transformer_layer_recompute": True}}
    )
    assert opts.graph_transformer.number_recompute_layers == 2


def test_all_cross_field_problems_are_reported_together():
    message = str(
        invalid({"distributed": {"world_rank": 1}, "graph_transformer": {"number_recompute_layers": 1}})
    )
    assert (
        "distributed.world_rank (1)" in message and "graph_transformer.number_recompute_layers (1)" in message
    )


# --- property: random input only ever raises ValueError ------------------------------------------


def _schema_keys(schema):
    keys = set()
    for name, rules in schema.items():
        keys.add(name)
        if isinstance(rules.get("schema"), dict) and rules.get("type") == "dict":
            keys.update(_schema_keys(rules["schema"]))
    return sorted(keys)


_KEYS = (
    st.sampled_from(_schema_keys(options_schema()))
    | st.text(max_size=8)
    | st.integers()
    | st.none()
    | st.floats()
)
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(
        [
            amp.DynamicLossScaler(),
            optim.ConstantWarmupLRScheduler(5),
            ort.SessionOptions(),
            len,
            "FLOOD_FILL",
            PropagateCastOpsStrategy.NONE,
        ]
    )
)
_VALUES = st.recursive(
    _LEAVES,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_KEYS, children, max_size=4),
    max_leaves=12,
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _VALUES, max_size=5))
def test_random_nested_dicts_only_raise_value_error(options):
    try:
        opts = ORTTrainerOptions(options)
    except ValueError as exc:
        assert str(exc).startswith("Invalid options: ")
    else:
        assert set(opts._validated_opts) == set(EXPECTED_DEFAULTS)


# --- shared validation helpers (reused by the recipe loader) --------------------------------------


def test_validation_helpers():
    from orttrainer._config import validation as _validation

    assert _validation.did_you_mean("lr_schedular", ["lr_scheduler", "session_options"]) == "lr_scheduler"
    assert _validation.did_you_mean("Device", ["device", "debug"]) == "device"
    assert _validation.did_you_mean("zzz", ["device"]) is None
    assert _validation.dotted(("outputs", 1, "name")) == "outputs[1].name"
    scheduler = optim.LinearWarmupLRScheduler(10)
    data = {"a": [1, {"b": scheduler}], "c": (2, [3])}
    copied = _validation.copy_plain(data)
    assert copied == data and copied["a"] is not data["a"] and copied["c"][1] is not data["c"][1]
    assert copied["a"][1]["b"] is scheduler
    first = _validation.load_schema("options.yaml")
    first["batch"]["schema"].clear()
    assert _validation.load_schema("options.yaml")["batch"]["schema"]
