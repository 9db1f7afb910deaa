"""Named symbolic shapes on the forward graph, so the gradient builder knows where nothing broadcasts.

onnxruntime's gradient of a broadcasting op (Add, Sub, Mul, Div, MatMul) reduces each operand's
gradient over the axes it was broadcast along. Where the graph does not show that two operands have
the same shape (the exporter leaves most intermediate dims unnamed), the builder decides at run time:
Shape + BroadcastGradientArgs + a ReduceSum per operand, and a ReduceSum over no axes copies the
whole gradient. The benchmark GPT ran 71 such copies, 63 BroadcastGradientArgs and 110 Shapes per
step (docs/notes/optimisation-log.md: "Named symbolic shapes"). onnxruntime's own symbolic shape
inference names those dims; the builder then reduces only where a broadcast is certain.

What makes this safe, and when it steps aside (the model is then left as it was, with one warning;
same results, the slower run-time reductions):
- Only what the inference derived is written: the `value_info` of intermediate tensors whose every
  dim is a number or a name. Graph inputs and outputs are left as model_desc declared them.
- Where an op needs two dims equal (a MatMul's inner dims, Concat's other axes) the inference merges
  them: the op fails at run time otherwise. Where it takes two broadcast dims as equal, one of them
  may be 1 at run time instead; such a merge is accepted only between expressions of the same symbols
  (the BERT position slice: `seq` with `Min(512, seq)`); any other refuses the whole pass.
- Large float weights go in without their values (as for the export: only integers define shapes).
- An op the inference does not know gets fresh names for its outputs' dims (nothing is guessed),
  so the gradients downstream of it keep their run-time reductions.
"""

import logging
import math
import os
import traceback
import warnings

import onnx

from orttrainer.engine.runtime import lifecycle
from orttrainer.engine.export.torch_export import LARGE_VALUE_ELEMENTS  # the same rule as for the export: only integers define shapes

logger = logging.getLogger(__name__)

_warned = []  # one warning per process


def annotate(model: onnx.ModelProto) -> bool:
    """Write the inferred shapes of `model`'s intermediate tensors into its value_info (in place).
    True if written; False, with one warning, if the inference refused or failed (model unchanged)."""
    try:
        shapes = _infer(model)
    except _Refused as exc:
        return _fall_back(str(exc))
    except Exception as exc:  # the inference is a large tool with many paths: any failure is a refusal
        where = traceback.extract_tb(exc.__traceback__)[-1]  # its asserts often carry no message
        return _fall_back(f"{type(exc).__name__} at {os.path.basename(where.filename)}:{where.lineno}"
                          + (f": {exc}" if str(exc) else ""))
    declared = {v.name for v in model.graph.input} | {v.name for v in model.graph.output}
    declared |= {i.name for i in model.graph.initializer}
    kept = [vi for vi in shapes if vi.name not in declared and _complete(vi)]
    names = {vi.name for vi in kept}
    others = [vi for vi in model.graph.value_info if vi.name not in names]
    del model.graph.value_info[:]
    model.graph.value_info.extend(others + kept)
    logger.info("symbolic shapes written for %d tensors", len(kept))
    return True


class _Refused(Exception):
    pass


def _infer(model):
    """The value_info the symbolic shape inference derives for `model` (a data-less copy of it)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    class Recording(SymbolicShapeInference):
        """Records every merge of unequal dims the tool makes (it applies them silently), with why:
        "required" where the op itself needs the dims equal (a MatMul's inner dims, Concat's other
        axes), "broadcast" where the tool assumed equal what broadcasting allows to differ."""

        def __init__(self, *args):
            super().__init__(*args)
            self.merges, self._why = [], None

        def _within(self, why, method, *args):
            outer = self._why
            self._why = outer or why  # the outermost reason counts: a broadcast stays one
            try:
                return method(*args)
            finally:
                self._why = outer

        def _broadcast_shapes(self, shape1, shape2):
            return self._within("broadcast", super()._broadcast_shapes, shape1, shape2)

        def _check_merged_dims(self, dims, allow_broadcast=True):
            why = "broadcast" if allow_broadcast else "required"
            return self._within(why, super()._check_merged_dims, dims, allow_broadcast)

        def _merge_symbols(self, dims):  # outside a broadcast: Concat's non-axis dims
            return self._within("required", super()._merge_symbols, dims)

        def _add_suggested_merge(self, symbols, apply=False):
            if len({str(s) for s in symbols}) > 1:
                self.merges.append((self._why or "broadcast", tuple(symbols)))
            return super()._add_suggested_merge(symbols, apply)

    large = {i.name for i in model.graph.initializer
             if i.data_type in _FLOAT_TYPES and math.prod(i.dims) > LARGE_VALUE_ELEMENTS}
    stub = lifecycle.without_data(model, large)
    # Driven step by step rather than through infer_shapes(), which on an incomplete inference saves
    # the model into the current directory before raising.
    inference = Recording(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess_output_rank, verbose
    inference._preprocess(stub)
    while inference.run_:
        inference._infer_impl()
    for why, dims in inference.merges:
        if why == "broadcast":
            _check_broadcast_merge(dims, inference.symbolic_dims_)
    return list(inference.out_mp_.graph.value_info)


def _check_broadcast_merge(dims, expressions):
    """Taking broadcast `dims` as equal is safe only if none is a number and all are expressions of the
    same symbols (then none is 1 while another is not). `expressions`: {dim name: sympy expression}."""
    import sympy

    if any(not isinstance(d, str) for d in dims):
        raise _Refused(f"it equated the dims {list(dims)}, one a number")
    symbols = {frozenset(map(str, (expressions.get(d) or sympy.sympify(d)).free_symbols)) for d in dims}
    if len(symbols) > 1:
        raise _Refused(f"it equated the dims {list(dims)} of different symbols (one may be 1 at run time)")


def _complete(vi):
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return False
    return all(d.HasField("dim_value") or d.HasField("dim_param") for d in vi.type.tensor_type.shape.dim)


_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                onnx.TensorProto.DOUBLE}


def _fall_back(reason):
    if not _warned:
        _warned.append(True)
        warnings.warn(f"orttrainer: symbolic shape inference of the forward graph refused ({reason}); the "
                      "gradient graph finds broadcast axes at run time instead (same results, slower steps).",
                      RuntimeWarning, stacklevel=3)
    return False
