"""The torch side of a trainer: export, the training graph, sessions, the export cache and its checks.

`TrainingSpec` is the one frozen description of what shapes the graphs (model_desc, optimizer config,
loss_fn, the options that change the exported or training graph). `GraphFactory` reads its settings
only from it, so the export cache key -- a digest of the spec -- cannot miss one. The factory holds
no reference to the trainer: the engine's GraphLifecycle calls it, and data flows down only.
"""

import copy
import dataclasses
import warnings

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from orttrainer.engine.kernels.choice import Kernels
from orttrainer.engine.runtime import input_checks as _checks
from orttrainer.engine.parallel import data_parallel as _distributed
from orttrainer.engine.export import torch_export as _export
from orttrainer.engine.export import cache as _export_cache
from orttrainer.engine.graph import torch_gelu_gradient as _gelu_gradient
from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.runtime.session import Runtime
from orttrainer.placement.dims import ParallelDims
from orttrainer.placement.process_state import PROCESS
from orttrainer.postprocess import run_postprocess


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """What shapes the exported and training graphs. Learning rates are fed per step, not baked."""

    inputs: tuple  # ((name, shape), ...)
    outputs: tuple  # ((name, shape, is_loss), ...)
    loss_fn: object
    optim_config: object
    gradient_accumulation_steps: int
    grad_norm_clip: bool
    frozen_weights: tuple
    run_symbolic_shape_infer: bool
    mixed_precision: bool
    compute_dtype: object  # torch dtype the export traces under, or None
    kernels: Kernels  # which kernels compute the graph's matrix products and its Adam updates
    deterministic_compute: bool
    recompute: tg.RecomputeOptions
    enable_internal_postprocess: bool
    extra_postprocess: object
    onnx_opset_version: int
    enable_onnx_contrib_ops: bool
    gelu_gradient_in_torch: bool  # False where the PythonOp hook failed its check: GeluGrad graphs
    dims: ParallelDims  # tensor parallel: the forward model is cut for the rank's tensor index
    world_rank: int

    @classmethod
    def of(cls, model_desc, optim_config, loss_fn, options, compute_dtype, kernels=Kernels()):
        o, internal, distributed = options, options._internal_use, options.distributed
        return cls(
            inputs=tuple((d.name, tuple(d.shape)) for d in model_desc.inputs),
            outputs=tuple((d.name, tuple(d.shape), bool(d.is_loss)) for d in model_desc.outputs),
            loss_fn=loss_fn, optim_config=optim_config,
            gradient_accumulation_steps=o.batch.gradient_accumulation_steps, grad_norm_clip=o.utils.grad_norm_clip,
            frozen_weights=tuple(o.utils.frozen_weights), run_symbolic_shape_infer=o.utils.run_symbolic_shape_infer,
            mixed_precision=bool(o.mixed_precision.enabled), compute_dtype=compute_dtype,
            kernels=kernels,
            deterministic_compute=o.debug.deterministic_compute,
            recompute=tg.RecomputeOptions.from_graph_transformer(o.graph_transformer),
            enable_internal_postprocess=internal.enable_internal_postprocess,
            extra_postprocess=internal.extra_postprocess, onnx_opset_version=internal.onnx_opset_version,
            enable_onnx_contrib_ops=internal.enable_onnx_contrib_ops,
            gelu_gradient_in_torch=_gelu_gradient.enabled(),
            dims=ParallelDims.of(distributed), world_rank=distributed.world_rank)

    @property
    def computes_in(self):
        """The dtype the graph's products compute in: the export's, or bfloat16 where they run on
        torch's bf16 kernel (the CPU's mixed precision: the export itself is fp32)."""
        return torch.bfloat16 if self.kernels.compute == "bfloat16" else self.compute_dtype

    def fingerprint(self, torch_model):
        """A digest of every field (engine/export/cache.py's key) plus the model and the package versions."""
        fields = {f.name: _key(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return _export_cache.digest({"model": _export_cache.model_fingerprint(torch_model), "spec": fields,
                                     "versions": _export_cache.versions()})


def _key(value):
    """A field as the digest sees it: code by its digest, the optimizer config without learning rates."""
    if hasattr(value, "cache_key"):
        return value.cache_key()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if hasattr(value, "defaults") and hasattr(value, "params"):  # an optim._OptimizerConfig
        groups = [value.defaults] + list(value.params)
        return [value.name, [{k: v for k, v in g.items() if k != "lr"} for g in groups]]
    if callable(value):
        return _export_cache.code_digest(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return value


class GraphFactory:
    """Builds what the GraphLifecycle asks for: forward models, training graphs, runtimes.

    Args:
        spec: the TrainingSpec.
        model_desc: the trainer's _ORTTrainerModelDesc (output checks).
        torch_model: the torch module, or None for a given ONNX model.
        group: the process group (engine.distributed).
        placement: (providers, provider_options, torch device) for every session.
        session_options: a callable returning a context manager that yields SessionOptions.
        frozen_values: {initializer: value} loaded by load_state_dict; shared with the trainer and
            written into every later export.
        debug_paths: options.debug.graph_save_paths.
        adopt_parameters: whether the torch parameters may become the trained buffers.
        check_finite: whether distributed runs check gradients for inf/nan (a loss scaler is on).
        adasum: whether distributed runs combine the ranks' updates with Adasum (engine/parallel/adasum.py).
        stub_weights: whether the export may leave the weights that train as data-less stubs, their
            values read from the torch module when the training graph is built (`_by_reference`).
    """

    def __init__(self, spec, model_desc, torch_model, group, placement, session_options, frozen_values,
                 debug_paths, adopt_parameters=True, check_finite=False, allreduce_post_accumulation=True,
                 adasum=False, stub_weights=True):
        self.spec, self.model_desc, self.torch_model, self.group = spec, model_desc, torch_model, group
        self.placement, self.session_options = placement, session_options
        self.frozen_values, self.debug_paths = frozen_values, debug_paths
        self.adopt_parameters, self.check_finite = adopt_parameters, check_finite
        self.allreduce_post_accumulation, self.adasum = allreduce_post_accumulation, adasum
        self.stub_weights = stub_weights
        self._wrapper = None
        self._groups_checked = False  # the optimizer's parameter groups against the model's weights
        # Tensor parallel: {weight: megatron.Cut} of the weights this rank holds a shard of (phase 2's
        # checkpoint layout and re-cut read it); set by the first prepare_forward.
        self.tensor_parallel_cuts = None

    # ------------------------------------------------------------------ the forward model
    def wrapper(self):
        """model + loss_fn as exported (a CPU copy of a model that is elsewhere)."""
        if self._wrapper is None:
            self._wrapper = _export.ModelWithLoss(_on_cpu(self.torch_model), self.spec.loss_fn,
                                                  [name for name, _ in self.spec.inputs])
        return self._wrapper

    def sample(self, inputs):
        return [inputs[n].detach().cpu() for n, _ in self.spec.inputs if n in inputs]

    def export(self, inputs):
        """The torch model (+ loss_fn) exported for these inputs, as the exporter wrote it."""
        spec = self.spec
        names, described = [n for n, _ in spec.inputs], [n for n, _, _ in spec.outputs]
        sample, wrapper = self.sample(inputs), self.wrapper()
        dynamic_axes = {}
        for name, shape in list(spec.inputs) + [(n, s) for n, s, _ in spec.outputs]:
            axes = {axis: dim for axis, dim in enumerate(shape) if isinstance(dim, str)}
            if axes:
                dynamic_axes[name] = axes
        refused = []

        def check(outputs):  # the trace's own outputs: no separate forward to check them
            try:
                if len(outputs) != len(described):
                    what = "loss_fn's loss + the model's outputs" if spec.loss_fn else "the model"
                    dropped = (f" (model_desc inputs {wrapper.dropped} name no parameter of forward() and were not "
                               "passed to it: rename them to forward()'s parameter names)") if wrapper.dropped else ""
                    raise ValueError(f"{what} gave {len(outputs)} tensors but model_desc describes "
                                     f"{len(described)} outputs {described}{dropped}; describe every returned "
                                     "tensor, in order")
                _checks.check_outputs(self.model_desc.outputs, outputs, spec.loss_fn is not None)
            except ValueError as exc:
                refused.append(exc)
                raise

        try:
            with _export.contrib_ops(spec.enable_onnx_contrib_ops, spec.onnx_opset_version):
                return _export.export(wrapper, sample, names, described, dynamic_axes, spec.onnx_opset_version,
                                      compute_dtype=spec.compute_dtype, check_outputs=check,
                                      by_reference=self._by_reference())
        except Exception as exc:
            if refused and exc is refused[0]:
                raise exc.with_traceback(None) from None  # the user's model_desc, not the export, is wrong
            raise _export_error(exc) from exc

    def _by_reference(self):
        """The parameters the export leaves as data-less stubs: those that may train (float32, requiring
        grad, not frozen). Nothing reads their values before the training graph is built, which takes
        them from the module, so the 500 MB of GPT-2 small are never copied into a ModelProto. Empty
        where something else reads the forward model's weights: a user's extra_postprocess, the
        symbolic shape inference option, the tensor-parallel cut, a save of the forward graph, a
        pipeline stage's cut (`stub_weights=False`)."""
        spec = self.spec
        if not self.stub_weights or spec.extra_postprocess is not None or spec.run_symbolic_shape_infer \
                or spec.dims.tensor_parallel or self.debug_paths.model_after_graph_transforms_path:
            return frozenset()
        frozen = set(spec.frozen_weights) | set(self.frozen_values)
        return frozenset(name for name, p in self.torch_model.named_parameters(remove_duplicate=False)
                         if p.requires_grad and p.dtype == torch.float32 and name not in frozen)

    def postprocess(self, model):
        if self.spec.enable_internal_postprocess:
            model = run_postprocess(model)
        if self.spec.extra_postprocess is not None:
            model = self.spec.extra_postprocess(model)
            assert isinstance(model, onnx.ModelProto), "'extra_postprocess' must return an ONNX ModelProto"
        return model

    def prepare_forward(self, exported):
        """An exported model made ready to train: postprocessed, frozen values loaded by
        load_state_dict written in, symbolic shapes inferred when the options ask."""
        model = self.postprocess(exported)
        for init in model.graph.initializer:
            if init.name in self.frozen_values:
                init.CopyFrom(numpy_helper.from_array(np.asarray(self.frozen_values[init.name]), init.name))
        if self.spec.dims.tensor_parallel:
            self._cut_for_tensor_parallel(model)
        if self.spec.run_symbolic_shape_infer:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
            model = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
        return model

    def _cut_for_tensor_parallel(self, model):
        """Every horizontal rank takes its group root's full weights (a collective: all ranks of a
        tensor-parallel group build together, their graphs being joined by f/g), then its shards."""
        from orttrainer.engine.parallel import megatron

        dims, rank = self.spec.dims, self.spec.world_rank
        root = dims.tensor_group(rank)[0]
        for init in model.graph.initializer:
            if init.data_type == onnx.TensorProto.FLOAT:
                value = torch.from_numpy(numpy_helper.to_array(init).copy())
                torch.distributed.broadcast(value, src=root, group=PROCESS.tensor_parallel_group)
                init.CopyFrom(numpy_helper.from_array(value.numpy(), init.name))
        trainable = [name for name, p in self.torch_model.named_parameters() if p.requires_grad] \
            if self.torch_model is not None else [i.name for i in model.graph.initializer]
        self.tensor_parallel_cuts = megatron.cut(model, dims.coords(rank).tensor, dims.tensor, trainable)

    def model_tensors(self):
        """{initializer name: torch tensor} for every parameter and buffer of the torch model."""
        model = self.torch_model
        return dict(list(model.named_parameters(remove_duplicate=False)) +
                    list(model.named_buffers(remove_duplicate=False)))

    # ------------------------------------------------------------------ the export cache
    def export_cache(self, utils_options):
        """The export cache of this spec, or None when the options turn it off."""
        paths = self.debug_paths
        if not utils_options.export_cache or paths.model_after_graph_transforms_path or \
                paths.model_with_gradient_graph_path or paths.model_with_training_graph_path:
            return None  # debug saves need the graphs really built
        tensors, frozen_values = self.model_tensors(), self.frozen_values

        def model_value(name):
            if name in frozen_values:
                return np.asarray(frozen_values[name])
            tensor = tensors.get(name)
            return None if tensor is None else tensor.detach().cpu().numpy()

        return _export_cache.ExportCache(utils_options.export_cache_dir or _export_cache.default_root(),
                                         self.spec.fingerprint(self.torch_model), model_value,
                                         utils_options.export_cache_max_bytes)

    def cache_mismatch(self, run_graphs, inputs, weights, everywhere):
        """(stale, found): whether the outputs of `run_graphs()` (graphs from the cache) disagree with an
        eager forward with the same weights (found = (output, max diff) here, or None); with
        `everywhere` any rank's mismatch counts."""
        found = _export_cache.mismatch_with_eager([n for n, _, _ in self.spec.outputs], run_graphs,
                                                  self.wrapper(), self.sample(inputs),
                                                  dict(weights, **self.frozen_values), self.spec.computes_in)
        stale = found is not None
        if everywhere:
            stale = bool(self.group.all_reduce_(torch.tensor([float(stale)]), "export cache check").item())
        return stale, found

    def check_export(self, ort_outputs, torch_outputs):
        """options.debug.check_model_export: the first batch's outputs against PyTorch's."""
        for (name, _, _), expected, actual in zip(self.spec.outputs, torch_outputs, ort_outputs):
            try:
                np.testing.assert_allclose(expected.float().numpy(), actual.float().cpu().numpy(),
                                           rtol=1e-2, atol=1e-6)
            except AssertionError as exc:
                raise RuntimeError(
                    f"The exported ONNX model disagrees with PyTorch on output {name!r} (dropout off, first "
                    f"batch):\n{exc}\nThe export is likely wrong for this model; set "
                    "options.debug.check_model_export=False to train anyway.") from exc

    # ------------------------------------------------------------------ training graph and session
    def build_training_graph(self, model):
        """The training graph of a forward model (weights to train, distributed form, debug saves)."""
        spec = self.spec
        losses = [name for name, _, is_loss in spec.outputs if is_loss]
        assert len(losses) == 1, f"Only one loss output is supported ({len(losses)} were specified)"
        initializers = {i.name for i in model.graph.initializer}
        unused = [name for name in spec.frozen_weights if name not in initializers]
        if unused:
            raise RuntimeError(f"{unused} params from 'frozen_weights' not found in the ONNX model.")
        self._check_groups(initializers)
        candidates = None
        if self.torch_model is not None:
            # Only torch parameters that require grad train; buffers and constants never do.
            candidates = {name for name, p in self.torch_model.named_parameters() if p.requires_grad}
        weights = tg.trainable_weights(model, frozen=set(spec.frozen_weights), candidates=candidates)
        tensors = self.model_tensors() if self.torch_model is not None else {}

        def module_value(name):  # the module's current value (a view of it on the CPU): never written
            tensor = tensors.get(name)
            return None if tensor is None else tensor.detach().cpu().numpy()

        for init in model.graph.initializer:  # a stub that does not train after all holds its value
            value = module_value(init.name) if tg.is_stub(init) and init.name not in weights else None
            if value is not None:
                init.CopyFrom(numpy_helper.from_array(value, init.name))
        paths = self.debug_paths
        tg.save_debug_graph(model, paths.model_after_graph_transforms_path)
        graph = tg.build_training_graph(
            model, loss=losses[0], outputs=[n for n, _, _ in spec.outputs], weights=weights,
            optim_config=spec.optim_config, gradient_accumulation_steps=spec.gradient_accumulation_steps,
            grad_norm_clip=spec.grad_norm_clip, mixed_precision=spec.mixed_precision,
            gradient_graph_path=paths.model_with_gradient_graph_path or None,
            partition=self._partition(model, weights), recompute=spec.recompute,
            sharded=frozenset(self.tensor_parallel_cuts or ()),
            deterministic=spec.deterministic_compute, values=module_value, kernels=spec.kernels)
        tg.save_debug_graph(graph.model, paths.model_with_training_graph_path)
        return graph

    def _check_groups(self, names):
        """The legacy trainer ignored group names matching no weight; a typo then trains with the defaults
        unnoticed, so warn once (not an error: such configs used to run)."""
        if self._groups_checked:
            return
        self._groups_checked = True
        unknown = [n for group in self.spec.optim_config.params for n in group["params"] if n not in names]
        if unknown:
            warnings.warn(f"{unknown} params from the optimizer's parameter groups not found in the ONNX "
                          "model; their groups' settings apply to nothing. Check the names against "
                          "model.named_parameters().", UserWarning)

    def make_runtime(self, graph, state):
        """A session for `graph`; `state` (None for the first) is the trainer's shared TrainingState."""
        # Graphs from the export cache skip build_training_graph: its weights are the graph's inputs
        # (trained) and initializers (frozen).
        self._check_groups({i.name for i in graph.model.graph.initializer} | {i.name for i in graph.model.graph.input})
        providers, provider_options, device = self.placement
        with self.session_options() as session_options:
            runtime_options = dict(providers=providers, provider_options=provider_options,
                                   session_options=session_options, device=device, state=state)
            if graph.partition is None:
                # The torch model's own parameters become the trained weights (no second copy, as with
                # a torch optimizer); see docs/performance.md "Memory".
                adopt = None
                if state is None and self.torch_model is not None and self.adopt_parameters \
                        and not self.spec.dims.tensor_parallel:  # shards are not the parameters
                    adopt = dict(self.torch_model.named_parameters())
                return Runtime(graph, adopt=adopt, **runtime_options)
            return _distributed.DistributedRuntime(
                graph, self.group, gradient_accumulation_steps=self.spec.gradient_accumulation_steps,
                allreduce_post_accumulation=self.allreduce_post_accumulation,
                check_finite=self.check_finite, adasum=self.adasum,
                sharded=frozenset(self.tensor_parallel_cuts or ()), **runtime_options)

    def _partition(self, model, weights):
        """The distributed form of the graph (tg.Partition), or None for one process without ZeRO.

        Several ranks, or ZeRO stage 1 even on one (the legacy trainer ran it), build the form whose
        gradients torch.distributed reduces between runs; ZeRO-1 updates only this rank's segments.
        """
        zero = self.spec.dims.zero
        if not self.group.active and not zero:
            return None
        if not zero:
            return tg.Partition()
        shapes = {i.name: tuple(i.dims) for i in model.graph.initializer if i.name in set(weights)}
        layout = _distributed.FlatLayout({w: shapes[w] for w in weights}, self.group.world_size)
        return tg.Partition({s.weight: s for s in layout.segments(self.group.rank)})


def _on_cpu(model):
    """`model` when every parameter and buffer is on the CPU, else a CPU copy of it (the export runs
    on the CPU; the caller's model stays where the caller put it). Copied tensor by tensor, so a
    CUDA model is not first duplicated on its device."""
    params, buffers = list(model.parameters()), list(model.buffers())
    if all(t.device.type == "cpu" for t in params + buffers):
        return model
    memo = {id(p): torch.nn.Parameter(p.detach().cpu(), requires_grad=p.requires_grad) for p in params}
    memo.update({id(b): b.detach().cpu() for b in buffers})
    return copy.deepcopy(model, memo)


def _export_error(exc):
    return RuntimeError(
        f"Exporting the model to ONNX failed: {exc}\nThings to try: check that model_desc input names match "
        "forward() parameter names; make forward() return tensors (or tuples/dicts of them); try another "
        "_internal_use.onnx_opset_version; replace unsupported operators.")
