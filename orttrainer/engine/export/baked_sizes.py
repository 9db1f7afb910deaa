"""Which symbolic input sizes an exported graph baked in as constants.

The TorchScript exporter keeps a size symbolic only while it flows through tensor ops; a size that the
model computes in Python (`torch.nn.MultiheadAttention` reshapes to `(tgt_len, bsz * num_heads, ...)`)
is written into the graph as a constant, so the graph runs only for the sizes of the traced batch --
whatever `dynamic_axes` say.

Found at export time, not by catching run-time failures: when a call first brings another size of a
symbol, its export (needed anyway if the size is baked) is compared with the export at the sizes
before (`engine/runtime/lifecycle.py`). The two differ only in the constants that hold baked sizes, and each
differing value tells which sizes it was made of (a size, a product of two, times a constant factor).
Anything that cannot be explained that way -- a different structure, a constant of another shape, a
float -- counts every changed symbol as baked: one session per distinct set of sizes is always correct.
"""

import itertools
import math

import numpy as np
import onnx
import torch
from onnx import numpy_helper


def input_sizes(inputs, symbols):
    """{symbol: size} of the given inputs; `symbols` is {input name: {axis: symbol}}."""
    sizes = {}
    for name, axes in symbols.items():
        if name in inputs:
            for axis, symbol in axes.items():
                sizes[symbol] = int(inputs[name].shape[axis])
    return sizes


def resized_inputs(inputs, symbols, sizes):
    """The inputs with each symbolic axis cut or cycled to `sizes` (values stay valid: token ids,
    labels and masks are repeated, never invented)."""
    resized = dict(inputs)
    for name, axes in symbols.items():
        if name not in resized:
            continue
        tensor = resized[name]
        for axis, symbol in axes.items():
            index = torch.arange(sizes[symbol]) % tensor.shape[axis]
            tensor = tensor.index_select(axis, index.to(tensor.device))
        resized[name] = tensor
    return resized


def baked_symbols(first, second, sizes, changed, skip=frozenset()):
    """Symbols whose sizes explain every constant that differs between `first` (traced with `sizes`)
    and `second` (traced with `changed`)."""
    differences = _differing_values(first.graph, second.graph, skip)
    if differences is None:  # the structure depends on the sizes
        return frozenset(sizes)
    baked = set()
    for a, b in differences:
        found = _explain(a, b, sizes, changed)
        if not found:
            return frozenset(sizes)
        baked |= found
    return frozenset(baked)


def _explain(a, b, sizes, changed):
    """The symbols of every product of one or two sizes (times one integer factor) that is `a` in the
    first trace and `b` in the second."""
    if not (float(a).is_integer() and float(b).is_integer()):
        return set()
    a, b = int(a), int(b)
    found = set()
    for count in (1, 2):
        for group in itertools.combinations(sorted(sizes), count):
            p, q = math.prod(sizes[s] for s in group), math.prod(changed[s] for s in group)
            if a % p == 0 and b % q == 0 and a // p == b // q and a // p != 0:
                found.update(group)
        if found:
            return found
    return found


def _differing_values(first, second, skip):
    """[(value in first, value in second)] for every constant element that differs, or None when the
    graphs differ in anything but constant values."""
    if [(n.op_type, n.domain, list(n.input), list(n.output)) for n in first.node] != \
            [(n.op_type, n.domain, list(n.input), list(n.output)) for n in second.node]:
        return None
    differing = []
    theirs = {i.name: i for i in second.initializer}
    if {i.name for i in first.initializer} != set(theirs):
        return None
    for init in first.initializer:
        if init.name in skip:
            continue
        pairs = _pairs(numpy_helper.to_array(init), numpy_helper.to_array(theirs[init.name]))
        if pairs is None:
            return None
        differing += pairs
    for node_a, node_b in zip(first.node, second.node):
        if [a.name for a in node_a.attribute] != [b.name for b in node_b.attribute]:
            return None
        for attr_a, attr_b in zip(node_a.attribute, node_b.attribute):
            pairs = _attribute_pairs(attr_a, attr_b)
            if pairs is None:
                return None
            differing += pairs
    return differing


def _attribute_pairs(a, b):
    kind = onnx.AttributeProto
    if a.type != b.type:
        return None
    if a.type == kind.TENSOR:
        return _pairs(numpy_helper.to_array(a.t), numpy_helper.to_array(b.t))
    if a.type in (kind.INT, kind.INTS, kind.FLOAT, kind.FLOATS):
        values = [onnx.helper.get_attribute_value(x) for x in (a, b)]
        return _pairs(np.asarray(values[0]), np.asarray(values[1]))
    return [] if a == b else None


def _pairs(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return None
    if a.dtype.kind not in "iuf":
        return [] if np.array_equal(a, b) else None
    where = a != b
    return list(zip(a[where].tolist(), b[where].tolist()))
