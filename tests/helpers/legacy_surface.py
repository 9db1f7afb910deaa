"""Every module-level name of the original ORTTrainer frontend (onnxruntime 1.13, the last release with
it: orttraining/orttraining/python/training/*.py and orttraining/orttraining/python/ort_trainer.py),
with its signature, as data for tests/unit/test_legacy_surface.py. Names and signatures only, not code.

Keys are this package's modules: `onnxruntime.training.X` is `orttrainer.X`, and
`onnxruntime.capi.ort_trainer` is `orttrainer.ort_trainer`. Each entry is one of

    "def (params)"    a function; the original's parameters in order, with their defaults
    "class (params)"  a class; the parameters of its __init__ (without self)
    "module"          a submodule reachable as an attribute
    "attr"            any other name (a constant, a schema dict, a name the module imported and
                      scripts reached through it)

Defaults are Python expressions, evaluated in the namespace of the module here.
ABSENT lists the names left out on purpose, with why; docs/legacy-api.md lists each of them.
"""

_SCALER_DEFAULTS = ("loss_scale=float(1 << 16), up_scale_window=2000, min_loss_scale=1.0, "
                    "max_loss_scale=float(1 << 24)")

SURFACE = {
    "orttrainer": {  # onnxruntime.training (__init__.py)
        "ORTTrainer": "class (model, model_desc, optim_config, loss_fn=None, options=None)",
        "ORTTrainerOptions": "class (options={})",
        "TrainStepInfo": "class (optimizer_config, all_finite=True, fetches=[], optimization_step=0, step=0)",
        "PropagateCastOpsStrategy": "attr",
        "is_ortmodule_available": "def ()",
        "amp": "module", "checkpoint": "module", "model_desc_validation": "module", "optim": "module",
        "orttrainer": "module", "orttrainer_options": "module", "postprocess": "module",
        "_utils": "module", "_checkpoint_storage": "module",
    },
    "orttrainer.orttrainer": {
        "TrainStepInfo": "class (optimizer_config, all_finite=True, fetches=[], optimization_step=0, step=0)",
        "ORTTrainer": "class (model, model_desc, optim_config, loss_fn=None, options=None)",
        # what the module imported, reached as orttrainer.orttrainer.X by the original test helpers
        "ORTTrainerOptions": "attr", "_ORTTrainerModelDesc": "attr",
        "amp": "module", "checkpoint": "module", "optim": "module", "postprocess": "module",
        "_utils": "module", "_checkpoint_storage": "module",
    },
    "orttrainer.orttrainer.ORTTrainer": {  # the methods scripts and the original tests call or patch
        "train_step": "def (self, *args, **kwargs)",
        "eval_step": "def (self, *args, **kwargs)",
        "save_as_onnx": "def (self, path)",
        "state_dict": "def (self, pytorch_format=False)",
        "load_state_dict": "def (self, state_dict, strict=True)",
        "save_checkpoint": "def (self, path, user_dict={}, include_optimizer_states=True)",
        "load_checkpoint": "def (self, *paths, strict=True)",
        "_init_session": "attr",
        "_update_onnx_model_initializers": "def (self, state_tensors)",
    },
    "orttrainer.orttrainer_options": {
        "ORTTrainerOptions": "class (options={})",
        "_ORTTrainerOptionsInternal": "class (main_class_name, options)",
        "ORTTrainerOptionsValidator": "attr",
        "_check_is_callable": "def (field, value, error)",
        "_ORTTRAINER_OPTIONS_SCHEMA": "attr",
    },
    "orttrainer.model_desc_validation": {
        "LEARNING_RATE_IO_DESCRIPTION_NAME": "attr",
        "ALL_FINITE_IO_DESCRIPTION_NAME": "attr",
        "LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME": "attr",
        "GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME": "attr",
        "_ORTTrainerModelDesc": "class (model_desc)",
        "_ORTTrainerModelDescInternal": "class (main_class_name, model_desc)",
        "_model_desc_inputs_validation": "def (field, value, error)",
        "_model_desc_outputs_validation": "def (field, value, error)",
        "MODEL_DESC_SCHEMA": "attr",
    },
    "orttrainer.checkpoint": {
        "experimental_state_dict": "def (ort_trainer, include_optimizer_state=True)",
        "experimental_load_state_dict": "def (ort_trainer, state_dict, strict=False)",
        "experimental_save_checkpoint": ("def (ort_trainer, checkpoint_dir, checkpoint_prefix='ORT_checkpoint', "
                                         "checkpoint_state_dict=None, include_optimizer_state=True)"),
        "experimental_load_checkpoint": ("def (ort_trainer, checkpoint_dir, checkpoint_prefix='ORT_checkpoint', "
                                         "strict=False)"),
        "_AGGREGATION_MODE": "attr",
        "_order_paths": "def (paths, D_groups, H_groups)",
        "_add_or_update_sharded_key": ("def (state_key, state_value, state_sub_dict, model_state_key, "
                                       "state_partition_info, sharded_states_original_dims, mode)"),
        "_add_or_validate_unsharded_key": "def (state_key, state_value, state_sub_dict, mismatch_error_string)",
        "_aggregate_model_states": ("def (rank_state_dict, sharded_states_original_dims, state_dict, "
                                    "mixed_precision_enabled, mode=_AGGREGATION_MODE.Zero)"),
        "_aggregate_optimizer_states": ("def (rank_state_dict, sharded_states_original_dims, state_dict, "
                                        "mode=_AGGREGATION_MODE.Zero)"),
        "_reshape_states": "def (sharded_states_original_dims, state_dict, mixed_precision_enabled)",
        "_aggregate_trainer_options": "def (rank_state_dict, state_dict, partial_aggregation)",
        "_aggregate_megatron_partition_info": "def (rank_state_dict, state_dict)",
        "_to_pytorch_format": "def (state_dict)",
        "_get_parallellism_groups": "def (data_parallel_size, horizontal_parallel_size, world_size)",
        "_aggregate_over_ranks": ("def (ordered_paths, ranks, sharded_states_original_dims=None, "
                                  "mode=_AGGREGATION_MODE.Zero, partial_aggregation=False, pytorch_format=True)"),
        "_aggregate_over_D_H": "def (ordered_paths, D_groups, H_groups, pytorch_format)",
        "aggregate_checkpoints": "def (paths, pytorch_format=True)",
        "_load_single_checkpoint": "def (ort_trainer, checkpoint_dir, checkpoint_prefix, is_partitioned, strict)",
        "_load_multi_checkpoint": "def (ort_trainer, checkpoint_dir, checkpoint_prefix, strict)",
        "_list_checkpoint_files": "def (checkpoint_dir, checkpoint_prefix, extension='.ort.pt')",
        "_get_checkpoint_name": "def (prefix, is_partitioned, world_rank=None, world_size=None)",
        "_split_state_dict": "def (state_dict)",
        "_CombineZeroCheckpoint": "class (checkpoint_files, clean_state_dict=None)",
    },
    "orttrainer._checkpoint_storage": {
        "_dfs_save": "def (group, save_obj)",
        "save": "def (save_obj, path)",
        "_dfs_load": "def (group, load_obj)",
        "load": "def (path, key=None)",
        "to_serialized_hex": "def (user_dict)",
        "from_serialized_hex": "def (serialized_hex)",
    },
    "orttrainer._utils": {
        "timeit": "def (enabled=True)",
        "get_device_index": "def (device)",
        "get_device_index_from_input": "def (input)",
        "get_all_gradients_finite_name_from_session": "def (session)",
        "get_gradient_accumulation_name_from_session": "def (session)",
        "dtype_torch_to_numpy": "def (torch_dtype)",
        "dtype_onnx_to_torch": "def (onnx_type)",
        "static_vars": "def (**kwargs)",
        "import_module_from_file": "def (file_path, module_name=None)",
        **{f"state_dict_{key}": "def ()" for key in (
            "model_key", "optimizer_key", "partition_info_key", "trainer_options_key", "full_precision_key",
            "original_dimension_key", "sharded_optimizer_keys", "user_dict_key",
            "trainer_options_mixed_precision_key", "trainer_options_zero_stage_key",
            "trainer_options_world_rank_key", "trainer_options_world_size_key",
            "trainer_options_data_parallel_size_key", "trainer_options_horizontal_parallel_size_key",
            "trainer_options_optimizer_name_key", "train_step_info_key",
            "train_step_info_optimization_step_key", "train_step_info_step_key")},
    },
    "orttrainer.postprocess": {
        "run_postprocess": "def (model)",
        "find_input_node": "def (model, arg)",
        "find_output_node": "def (model, arg)",
        "add_name": "def (model)",
        "fix_expand_shape": "def (model)",
        "fix_expand_shape_pt_1_5": "def (model)",
        "find_nodes": "def (graph, op_type)",
        "is_type": "def (node, op_type)",
        "add_const": "def (model, name, output, t_value=None, f_value=None)",
        "fuse_softmaxNLL_to_softmaxCE": "def (onnx_model)",
    },
    "orttrainer.optim": {
        "_OptimizerConfig": "class (name, params, defaults)",
        "AdamConfig": "attr", "LambConfig": "attr", "SGDConfig": "attr",
        "_LRScheduler": "class ()",
        "ConstantWarmupLRScheduler": "attr", "CosineWarmupLRScheduler": "attr",
        "LinearWarmupLRScheduler": "attr", "PolyWarmupLRScheduler": "attr",
        "config": "module", "lr_scheduler": "module",
    },
    "orttrainer.optim.config": {
        "_OptimizerConfig": "class (name, params, defaults)",
        "SGDConfig": "class (params=[], lr=0.001)",
        "AdamConfig": ("class (params=[], lr=0.001, alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-8, "
                       "max_norm_clip=1.0, do_bias_correction=True, "
                       "weight_decay_mode=AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE)"),
        "LambConfig": ("class (params=[], lr=0.001, alpha=0.9, beta=0.999, lambda_coef=0.0, "
                       "ratio_min=float('-inf'), ratio_max=float('inf'), epsilon=1e-6, max_norm_clip=1.0, "
                       "do_bias_correction=False)"),
    },
    "orttrainer.optim.lr_scheduler": {
        "_LRScheduler": "class ()",
        "ConstantWarmupLRScheduler": "class (total_steps, warmup=0.002)",
        "CosineWarmupLRScheduler": "class (total_steps, cycles=0.5, warmup=0.002)",
        "LinearWarmupLRScheduler": "class (total_steps, warmup=0.002)",
        "PolyWarmupLRScheduler": "class (total_steps, lr_end=1e-7, power=1.0, warmup=0.002)",
    },
    "orttrainer.amp": {"LossScaler": "attr", "DynamicLossScaler": "attr", "loss_scaler": "module"},
    "orttrainer.amp.loss_scaler": {
        "LossScaler": "class (loss_scale)",
        "DynamicLossScaler": f"class (automatic_update=True, {_SCALER_DEFAULTS})",
    },
    "orttrainer.ort_trainer": {  # onnxruntime.capi.ort_trainer
        "DEFAULT_OPSET_VERSION": "attr",
        "IODescription": "class (name, shape, dtype=None, num_classes=None)",
        "ModelDescription": "class (inputs, outputs)",
        "resolve_symbolic_dimensions": "def (inputs, input_descs, output_descs)",
        "generate_sample": "def (desc, device=None)",
        "get_device_index": "def (device)",
        "input_get_device_index": "def (input)",
        "get_all_gradients_finite_arg_name": "def (session)",
        "get_group_accumulated_gradients_output_node_arg_name": "def (session)",
        "ort_training_session_run_helper": ("def (session, iobinding, inputs, input_descs, output_descs, device, "
                                            "run_options=None)"),
        "FuseSofmaxNLLToSoftmaxCE": "def (onnx_model)",
        "delete_input_with_name": "def (input, name)",
        "dtype_torch_to_numpy": "def (torch_dtype)",
        "model_loss_cls": "class (model, loss_fn)",
        "WrapModel": "class (model, loss_fn, input_names)",
        "wrap_for_input_match": "def (model, loss_fn, input_names)",
        "save_checkpoint": ("def (model, checkpoint_dir, checkpoint_prefix='ORT_checkpoint', "
                            "checkpoint_state_dict=None, include_optimizer_state=True)"),
        "_load_single_checkpoint": "def (model, checkpoint_dir, checkpoint_prefix, is_partitioned, strict)",
        "_load_multi_checkpoint": "def (model, checkpoint_dir, checkpoint_prefix, strict)",
        "load_checkpoint": "def (model, checkpoint_dir, checkpoint_prefix='ORT_checkpoint', strict=False)",
        "ORTTrainer": (
            "class (model, loss_fn, model_desc, training_optimizer_name, map_optimizer_attributes, "
            "learning_rate_description, device, gradient_accumulation_steps=1, world_rank=0, world_size=1, "
            "use_mixed_precision=False, allreduce_post_accumulation=False, global_step=0, get_lr_this_step=None, "
            "loss_scaler=None, deepspeed_zero_stage=0, enable_grad_norm_clip=True, frozen_weights=[], "
            "_opset_version=DEFAULT_OPSET_VERSION, _enable_internal_postprocess=True, _extra_postprocess=None, "
            "_use_deterministic_compute=False, use_memory_efficient_gradient=False, "
            "run_symbolic_shape_infer=False, enable_adasum=False, optimized_model_filepath='')"),
        "LossScaler": f"class (loss_scale_input_name, is_dynamic_scale, {_SCALER_DEFAULTS})",
        # imported from onnxruntime.capi.checkpointing_utils
        "CombineZeroCheckpoint": "class (checkpoint_files, clean_state_dict=None)",
        "get_checkpoint_name": "def (prefix, is_partitioned, world_rank=None, world_size=None)",
        "list_checkpoint_files": "def (checkpoint_dir, checkpoint_prefix, extension='.ort.pt')",
    },
    "orttrainer.ort_trainer.ORTTrainer": {
        "train_step": "def (self, *args, **kwargs)",
        "eval_step": "def (self, *args, **kwargs)",
        "state_dict": "def (self, include_optimizer_state=True)",
        "load_state_dict": "def (self, state_dict, strict=False)",
        "save_as_onnx": "def (self, path)",
        "train": "def (self)", "eval": "def (self)",
    },
}

# Left out on purpose (each is listed in docs/legacy-api.md): they need the C++ TrainingSession of
# the original build, or belong to ORTModule / on-device training, not to the ORTTrainer frontend.
ABSENT = {
    "orttrainer": {
        "TrainingParameters": "the C++ backend's parameters object; options go through ORTTrainerOptions",
        "TrainingSession": "the C++ training session; trainer._training_session gives its legacy getters",
        "artifacts": "on-device training artifacts (onnxruntime.training.api), not the ORTTrainer",
    },
    "orttrainer.optim": {
        "FusedAdam": "an ORTModule / torch optimizer, not an ORTTrainer config",
        "FP16_Optimizer": "an ORTModule / DeepSpeed wrapper, not an ORTTrainer config",
    },
    "orttrainer.postprocess": {
        "layer_norm_transform": "deprecated in the original and never called (the backend fused LayerNorm)",
    },
    "orttrainer.ort_trainer": {
        "convert_model_loss_fn_to_onnx": "the export runs inside ORTTrainer (engine/export/torch_export.py)",
        "create_ort_training_session_with_optimizer": "builds the C++ TrainingSession",
    },
}
