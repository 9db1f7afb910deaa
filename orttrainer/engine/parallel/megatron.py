"""Megatron tensor parallel: the forward ONNX model cut for horizontal rank r of H.

In each transformer block's attention and MLP ("block part"), the first linear is split by COLUMNS
(its output features; GPT-2's fused `c_attn` with stride 3, so each rank holds whole heads of q, k
and v) and the second by ROWS (its input features). Between them every rank computes 1/H of the
heads or hidden units, so the head count and hidden sizes in Reshape / Split constants of that
region are divided by H. Two torch.autograd.Functions, inserted as PythonOp nodes (the gradient
builder emits their PythonOpGrad, engine/pyop/python_op.py runs both), join the ranks:

    x ──f──> column MatMul(s) (+ bias shard) ... row MatMul ──g──> + bias (whole, once)
    f: identity forward, all_reduce of the gradient backward      (over the horizontal group)
    g: all_reduce forward, identity backward

Everything outside the block parts (embeddings, LayerNorm, row biases, the head) is replicated:
f/g make its gradients identical on every horizontal rank. `AllReduceSum` sums a scalar over the
group inside the optimizer part (global gradient norm, LAMB's norms of sharded weights).

Matching is by the Hugging Face parameter names of GPT-2 (Conv1D, weight [in, out]) and BERT
(nn.Linear, weight [out, in], exported as MatMul of a Transpose), and of the bench/tests GPT block
(qkv -> proj, fc -> out); `PATTERNS` lists them.
"""

import dataclasses
import re

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from orttrainer.engine.pyop import python_op, runner_check
from orttrainer.placement.process_group import ProcessGroup
from orttrainer.placement.process_state import PROCESS, keep_module_names

# --------------------------------------------------------------------------- the horizontal group
# PROCESS.tensor_parallel_group: torch.distributed group of this rank's horizontal ranks (set_group).
keep_module_names(__name__, _group="tensor_parallel_group")


def set_group(group):
    PROCESS.tensor_parallel_group = group


def _all_reduce(tensor):
    group = PROCESS.tensor_parallel_group
    if group is None:
        raise RuntimeError("tensor parallel collective called before megatron.set_group")
    torch.distributed.all_reduce(tensor, group=group)
    return tensor


def data_parallel_group(world: ProcessGroup, dims):
    """The group a trainer all-reduces its gradients in: without tensor parallel, the world.

    Tensor parallel: the horizontal group is set here (the f/g PythonOps reduce in it); the returned
    ProcessGroup is the DATA-parallel one (placement/dims.py lays the ranks out): gradients of every
    weight (shards and replicas alike) are all-reduced in it, ZeRO-1 partitions the rank's shards in it.
    Of size 1 (world_size == H) the step is one session run with no gradient collective."""
    if not dims.tensor_parallel or not world.active:
        return world
    runner_check.require(f"tensor parallel (horizontal_parallel_size={dims.tensor}: its f/g collectives are "
                         "PythonOps)")
    horizontal_group, data_group = make_groups(dims, world.rank)
    set_group(horizontal_group)
    return ProcessGroup(rank=dims.coords(world.rank).data, world_size=dims.data,
                        backend=torch.distributed.get_backend() if dims.data > 1 else None, group=data_group)


def make_groups(dims, rank):
    """(horizontal group, data group) of `rank`, made with new_group on EVERY rank (a collective) in the
    same order everywhere. A group of one is None."""
    horizontal = data = None
    for ranks in dims.tensor_groups():
        made = torch.distributed.new_group(ranks)
        if rank in ranks:
            horizontal = made
    if dims.data > 1:
        for ranks in dims.data_groups():
            made = torch.distributed.new_group(ranks)
            if rank in ranks:
                data = made
    return horizontal, data


class MegatronF(torch.autograd.Function):
    """Identity forward; the gradient summed over the horizontal group backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy.clone())


class MegatronG(torch.autograd.Function):
    """The partial outputs of the row-split MatMul summed over the group forward; identity backward."""

    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, dy):
        return dy.clone()


class AllReduceSum(torch.autograd.Function):
    """A forward-only sum over the group, run as a PythonOp/PythonOpGrad pair (the pair frees the
    context onnxruntime keeps per PythonOp; see torch_gelu_gradient.py): forward keeps the sum, the
    "backward" node hands it to the graph."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(_all_reduce(x.clone()))
        return x.new_empty([0])

    @staticmethod
    def backward(ctx, _unused):
        (total,) = ctx.saved_tensors
        return total


def _python_op(cls, x, y, rank, name):
    """PythonOp node y = cls.apply(x) for an fp32 tensor of the given rank (output 0: its context)."""
    python_op._install_runners()
    return helper.make_node(
        python_op.PYTHON_OP, [x], [f"{y}_ctx", y], name=name, domain=python_op.MS_DOMAIN,
        func_name=python_op._register_function(cls), input_convention="d",
        input_tensor_types=[TensorProto.FLOAT], input_tensor_ranks=[rank], input_requires_grads=[1],
        output_tensor_types=[TensorProto.FLOAT], output_tensor_ranks=[rank], training_mode=1, safe_run_mode=0)


def all_reduce_sum(b, x):
    """Graph nodes (GraphBuilder b) summing the fp32 scalar `x` over the horizontal group."""
    python_op._install_runners()
    func_name = python_op._register_function(AllReduceSum)
    ctx, empty, total = b.fresh("tp_sum_ctx"), b.fresh("tp_sum_empty"), b.fresh("tp_sum")
    common = dict(domain=python_op.MS_DOMAIN, func_name=func_name, safe_run_mode=0)
    b.graph.node.append(helper.make_node(
        python_op.PYTHON_OP, [x], [ctx, empty], name=b.fresh("tp_sum_node"), input_convention="d",
        input_tensor_types=[TensorProto.FLOAT], input_tensor_ranks=[0], input_requires_grads=[1],
        output_tensor_types=[TensorProto.FLOAT], output_tensor_ranks=[1], training_mode=1, **common))
    b.graph.node.append(helper.make_node(
        python_op.PYTHON_OP_GRAD, [ctx, ""], [total], name=b.fresh("tp_sum_grad_node"),
        input_tensor_types=[TensorProto.FLOAT], input_tensor_ranks=[1], output_convention="d",
        output_tensor_types=[TensorProto.FLOAT], output_tensor_ranks=[0], output_tensor_requires_grads=[1],
        **common))
    return total


# --------------------------------------------------------------------------- matching
@dataclasses.dataclass(frozen=True)
class Pattern:
    """One block part: column weight suffixes (a regex group captures the block prefix), row weight."""

    columns: tuple  # suffixes of the column-split weights, e.g. ("attn.c_attn",)
    row: str
    stride: int  # >1: the column weight is `stride` matrices side by side (GPT-2's q|k|v)
    attention: bool


PATTERNS = (
    Pattern(("attn.c_attn",), "attn.c_proj", 3, True),                                    # GPT-2
    Pattern(("mlp.c_fc",), "mlp.c_proj", 1, False),
    Pattern(("attention.self.query", "attention.self.key", "attention.self.value"),        # BERT
            "attention.output.dense", 1, True),
    Pattern(("intermediate.dense",), "output.dense", 1, False),
    Pattern(("qkv",), "proj", 3, True),                                                    # bench/tests GPT
    Pattern(("fc",), "out", 1, False),
)


class TensorParallelError(ValueError):
    """The model cannot be cut for tensor parallel (the message names the block and why)."""


@dataclasses.dataclass
class Cut:
    """How one weight was cut: `axis` of the stored initializer, `stride` equal parts interleaved."""

    axis: int
    stride: int
    row: bool  # row-parallel: cut along the input features
    shape: tuple = ()  # the whole (uncut) shape


class _Graph:
    def __init__(self, model):
        self.graph = model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.consumers = {}
        self.producer = {}
        for node in self.graph.node:
            for i in node.input:
                self.consumers.setdefault(i, []).append(node)
            for o in node.output:
                self.producer[o] = node
        self.ranks, self.lengths = {}, {}
        inferred = onnx.shape_inference.infer_shapes(model)
        infos = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
        for info in infos:
            if info.type.tensor_type.HasField("shape"):
                dims = info.type.tensor_type.shape.dim
                self.ranks[info.name] = len(dims)
                if len(dims) == 1 and dims[0].HasField("dim_value"):
                    self.lengths[info.name] = dims[0].dim_value  # 1-D: a shape's piece

    def array(self, name):
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def constant_source(self, name):
        """(node, input index) whose input holds the constant behind `name` -- `name` itself read by the
        caller (None), or the constant an Unsqueeze turns into it (the exporter writes a Python int of
        a shape as Constant -> Unsqueeze -> Concat)."""
        if self.array(name) is not None:
            return None
        node = self.producer.get(name)
        if node is not None and node.op_type == "Unsqueeze" and self.array(node.input[0]) is not None:
            return node, 0
        return False

    def linear(self, weight):
        """(MatMul or Gemm node, weight layout 'in_out' | 'out_in') of the linear reading `weight`:
        MatMul(x, W), MatMul(x, Transpose(W)) (nn.Linear), Gemm(x, W[, bias]) (Conv1D's addmm)."""
        for node in self.consumers.get(weight, []):
            if node.op_type == "MatMul" and node.input[1] == weight:
                return node, "in_out"
            if node.op_type == "Gemm" and node.input[1] == weight and _plain_gemm(node):
                trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
                return node, "out_in" if trans_b else "in_out"
            if node.op_type == "Transpose":
                for user in self.consumers.get(node.output[0], []):
                    if user.op_type == "MatMul" and user.input[1] == node.output[0]:
                        return user, "out_in"
        return None, None

    def bias_add(self, matmul, bias):
        for node in self.consumers.get(matmul.output[0], []):
            if node.op_type == "Add" and bias in node.input:
                return node
        return None


def _plain_gemm(node):
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)


def _row_as_matmul(g, node, fresh):
    """A row-split Gemm(x, W, bias) becomes MatMul(x, W) + bias, so that the bias can be added once,
    after g's reduction. Returns (MatMul node, bias Add node or None)."""
    if node.op_type == "MatMul":
        return node, None
    weight, bias = node.input[1], node.input[2] if len(node.input) > 2 else ""
    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
    nodes, out = [], node.output[0]
    if trans_b:
        transposed = fresh()
        nodes.append(helper.make_node("Transpose", [weight], [transposed], name=fresh(), perm=[1, 0]))
        weight = transposed
    product = fresh() if bias else out
    matmul = helper.make_node("MatMul", [node.input[0], weight], [product], name=f"{node.name}_matmul")
    nodes.append(matmul)
    add = None
    if bias:
        add = helper.make_node("Add", [product, bias], [out], name=f"{node.name}_bias")
        nodes.append(add)
    index = list(g.graph.node).index(node)
    del g.graph.node[index]
    for offset, new in enumerate(nodes):
        g.graph.node.insert(index + offset, new)
    # insert() stores copies: hand back the graph's own nodes
    placed = {n.name: n for n in g.graph.node[index:index + len(nodes)]}
    return placed[matmul.name], placed[add.name] if add is not None else None


def _blocks(weights):
    """[(prefix, Pattern)] in weight-name order: every block part whose weights all exist."""
    found = []
    for pattern in PATTERNS:
        first = re.compile(rf"^(.*?){re.escape(pattern.columns[0])}\.weight$")
        for name in weights:
            m = first.match(name)
            if not m:
                continue
            prefix = m.group(1)
            if prefix and not prefix.endswith("."):
                continue  # a longer module name ("x_fc"), not this pattern's module
            names = [f"{prefix}{c}.weight" for c in pattern.columns] + [f"{prefix}{pattern.row}.weight"]
            if all(n in weights for n in names) and (prefix, pattern) not in found:
                found.append((prefix, pattern))
    return sorted(found, key=lambda f: f[0])


def _region(g, starts, stop):
    """Nodes reachable from the outputs of `starts` before node `stop`. Not through Shape: the sizes
    read from the region's tensors also shape tensors after `stop` (the row linear's output)."""
    seen, todo, region = set(), [o for n in starts for o in n.output], []
    while todo:
        name = todo.pop()
        for node in g.consumers.get(name, []):
            if id(node) in seen or node is stop or node.op_type == "Shape":
                continue
            seen.add(id(node))
            region.append(node)
            todo.extend(node.output)
    return region


def _replace_input(g, node, index, value, fresh):
    name = fresh()
    g.graph.initializer.append(numpy_helper.from_array(value, name))
    node.input[index] = name


def _constant_piece(g, name):
    """The int values behind a Concat input (a constant, or a constant through Unsqueeze), or None."""
    source = g.constant_source(name)
    value = g.array(name) if source is None else g.array(source[0].input[source[1]]) if source else None
    return None if value is None else value.reshape(-1)


def _shape_tail(g, shape):
    """The last two entries of a Reshape's shape input: [(piece input name, offset, value or None)],
    oldest first. The shape is a constant, or a Concat of constants and run-time pieces; walking from
    the end stops at a piece of unknown length (nothing before it has a known position)."""
    value = g.array(shape)
    if value is not None:
        value = value.reshape(-1)
        return [(shape, k, int(value[k])) for k in range(max(0, value.size - 2), value.size)]
    concat = g.producer.get(shape)
    if concat is None or concat.op_type != "Concat":
        return []
    tail = []
    for name in reversed(list(concat.input)):
        value = _constant_piece(g, name)
        length = value.size if value is not None else g.lengths.get(name)
        if length is None:
            break
        tail += [(name, k, None if value is None else int(value[k])) for k in reversed(range(length))]
        if len(tail) >= 2:
            break
    return tail[:2][::-1]


def _tail_changes(tail, widths, heads, horizontal):
    """{position in tail: new value}: only what a cut changes -- the last entry when it is a cut width
    ([b, t, width]), the one before it when it is the head count before the head size or -1 ([b, t,
    heads, head_size]). Other entries (a fixed batch or sequence size equal to a head count or width)
    keep their values: patching by position, not by value alone."""
    values = [v for _, _, v in tail]
    changes = {}
    if values and values[-1] in widths:
        changes[len(values) - 1] = values[-1] // horizontal
    if len(values) == 2 and heads and values[0] == heads and values[1] in (min(widths) // heads, -1):
        changes[0] = heads // horizontal
    return changes


def _divide_sizes(g, region, widths, heads, horizontal, fresh):
    """Divide by H what the cut divides in the region: Split sizes equal to a cut width, and the
    Reshape shape entries _tail_changes picks (`heads`: the head count when a constant holds it).
    Patched values go into new initializers and a Concat is cloned, so a constant or Concat that
    other nodes share keeps its value for them. Returns how many nodes were changed."""
    changed = 0
    for node in region:
        if node.op_type not in ("Reshape", "Split") or len(node.input) < 2:
            continue
        shape = node.input[1]
        if node.op_type == "Split":
            value = g.array(shape)
            if value is not None and np.isin(value, list(widths)).all():
                _replace_input(g, node, 1, value // horizontal, fresh)
                changed += 1
            continue
        tail = _shape_tail(g, shape)
        changes = _tail_changes(tail, widths, heads, horizontal)
        if not changes:
            continue
        pieces = {}  # piece input name -> its patched values
        for position, new in changes.items():
            name, offset, _ = tail[position]
            piece = pieces.setdefault(name, (g.array(shape).reshape(-1) if name == shape
                                             else _constant_piece(g, name)).copy())
            piece[offset] = new
        if shape in pieces:
            _replace_input(g, node, 1, pieces[shape].astype(np.int64), fresh)
        else:
            concat = g.producer[shape]
            inputs = list(concat.input)
            for i, name in enumerate(inputs):
                if name in pieces:
                    inputs[i] = fresh()
                    patched = numpy_helper.from_array(pieces[name].astype(np.int64), inputs[i])
                    g.graph.initializer.append(patched)
            clone = helper.make_node("Concat", inputs, [fresh()], name=fresh(), axis=0)
            g.graph.node.insert(list(g.graph.node).index(node), clone)
            node.input[1] = clone.output[0]
        changed += 1
    return changed


def _cut_array(value, axis, rank, horizontal, stride):
    parts = np.split(value, stride, axis=axis)  # stride 3: q | k | v, each cut alike
    return np.concatenate([np.split(p, horizontal, axis=axis)[rank] for p in parts], axis=axis)


def cut(model: onnx.ModelProto, rank: int, horizontal: int, trainable) -> dict:
    """Cut `model` in place for horizontal rank `rank` of `horizontal`; returns {weight: Cut}.
    `trainable`: the weight names (the parameters of the model). Raises TensorParallelError naming the
    first block part that does not match."""
    g = _Graph(model)
    counter = iter(range(1 << 30))

    def fresh():
        return f"megatron_{next(counter)}"

    blocks = _blocks([w for w in trainable if w in g.inits])
    if not blocks:
        raise TensorParallelError(
            "tensor parallel (horizontal_parallel_size > 1) found no transformer block to cut: it matches "
            "Hugging Face GPT-2 (attn.c_attn/c_proj, mlp.c_fc/c_proj), BERT (attention.self.query/key/"
            "value, attention.output.dense, intermediate.dense, output.dense) and GPT blocks named "
            "qkv/proj, fc/out (bench/models.py) parameter names")
    cuts, partitioned = {}, set()
    for prefix, pattern in blocks:
        where = f"block part {prefix}{pattern.columns[0]} .. {prefix}{pattern.row}"
        columns = []
        for c in pattern.columns:
            node, layout = g.linear(f"{prefix}{c}.weight")
            if node is None:
                raise TensorParallelError(f"{where}: weight {prefix}{c}.weight is not read by a plain MatMul or "
                                          "Gemm "
                                          "(directly or through a Transpose); this block cannot be cut")
            columns.append((c, node, layout))
        row, row_layout = g.linear(f"{prefix}{pattern.row}.weight")
        if row is None:
            raise TensorParallelError(f"{where}: weight {prefix}{pattern.row}.weight is not read by a plain "
                                      "MatMul or Gemm")
        inputs = {node.input[0] for _, node, _ in columns}
        if len(inputs) != 1:
            raise TensorParallelError(f"{where}: the column MatMuls {[n.name for _, n, _ in columns]} read "
                                      "different inputs; expected one block input")
        (x,) = inputs
        if x not in g.ranks:
            raise TensorParallelError(f"{where}: the rank of the block input {x!r} is unknown")
        # column weights and their bias shards
        widths, starts = set(), []
        for c, node, layout in columns:
            weight = f"{prefix}{c}.weight"
            value = g.array(weight)
            axis = 1 if layout == "in_out" else 0
            width = value.shape[axis] // pattern.stride
            if width % horizontal:
                raise TensorParallelError(f"{where}: {weight} has {width} output features per part, not "
                                          "divisible "
                                          f"by horizontal_parallel_size={horizontal}")
            widths |= {width, width * pattern.stride}
            _set(g, weight, _cut_array(value, axis, rank, horizontal, pattern.stride))
            cuts[weight] = Cut(axis, pattern.stride, row=False, shape=value.shape)
            start = node
            bias = f"{prefix}{c}.bias"
            add = g.bias_add(node, bias) if bias in g.inits else None
            gemm_bias = node.op_type == "Gemm" and bias in node.input  # Conv1D: Gemm's third input
            if gemm_bias or add is not None:
                whole = g.array(bias)
                _set(g, bias, _cut_array(whole, 0, rank, horizontal, pattern.stride))
                cuts[bias] = Cut(0, pattern.stride, row=False, shape=whole.shape)
                start = add if add is not None else start
            starts.append(start)
        # the block input through f
        fx = fresh()
        nodes = [_python_op(MegatronF, x, fx, g.ranks[x], f"{fresh()}_f")]
        for _, node, _ in columns:
            node.input[0] = fx
        # row weight; its output through g before the bias
        weight = f"{prefix}{pattern.row}.weight"
        value = g.array(weight)
        axis = 0 if row_layout == "in_out" else 1
        if value.shape[axis] % horizontal:
            raise TensorParallelError(f"{where}: {weight} has {value.shape[axis]} input features, not "
                                      "divisible by "
                                      f"horizontal_parallel_size={horizontal}")
        _set(g, weight, _cut_array(value, axis, rank, horizontal, 1))
        cuts[weight] = Cut(axis, 1, row=True, shape=value.shape)
        region = _region(g, starts, row)
        rank_out = g.ranks.get(row.output[0], g.ranks.get(row.input[0]))
        row, bias_add = _row_as_matmul(g, row, fresh)
        y, gy = row.output[0], fresh()
        nodes.append(_python_op(MegatronG, y, gy, rank_out, f"{fresh()}_g"))
        users = [bias_add] if bias_add is not None else g.consumers.get(y, [])
        for user in users:
            for index, name in enumerate(user.input):
                if name == y:
                    user.input[index] = gy
        heads = explicit = None
        if pattern.attention:
            heads, explicit = _head_count(g, region, widths)
            if heads is None:
                raise TensorParallelError(f"{where}: no Reshape to [..., heads, head_size] found in the "
                                          "attention")
            if heads % horizontal:
                raise TensorParallelError(f"{where}: {heads} attention heads are not divisible by "
                                          f"horizontal_parallel_size={horizontal}")
        changed = _divide_sizes(g, region, widths, heads if explicit else None, horizontal, fresh)
        if pattern.attention and explicit and not changed:
            raise TensorParallelError(f"{where}: no head-count constant found to divide")
        _seed_dropouts(region, rank, partitioned)
        g.graph.node.extend(nodes)
    _seed_dropouts([n for n in g.graph.node if id(n) not in partitioned], None, partitioned)
    return cuts


def _head_count(g, region, widths):
    """(head count, whether a constant holds it): the last two entries (heads, head_size) of a region
    Reshape whose product is a width, or (-1, head_size) -- the heads inferred by Reshape, as
    transformers 5's `view(*shape, -1, head_dim)` writes it: nothing to divide then."""
    inferred = None
    for node in region:
        if node.op_type != "Reshape":
            continue
        tail = [v for _, _, v in _shape_tail(g, node.input[1])]
        if len(tail) != 2 or tail[1] is None or tail[0] is None or tail[1] <= 0:
            continue
        a, b = tail
        if a > 0 and a * b in widths:
            return a, True
        if a == -1 and min(widths) % b == 0:
            inferred = min(widths) // b
    return (inferred, False) if inferred else (None, False)


_SEED_BASE = 0x5EED


def _seed_dropouts(nodes, rank, done):
    """Fixed Dropout seeds: replicated regions (rank None) draw the same mask on every horizontal rank,
    partitioned ones (attention probabilities) a different one per rank, as the original offset them."""
    for index, node in enumerate(nodes):
        if node.op_type != "Dropout" or id(node) in done:
            continue
        done.add(id(node))
        seed = _SEED_BASE + index + (0 if rank is None else 1_000_003 * (rank + 1))
        kept = [a for a in node.attribute if a.name != "seed"]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute("seed", seed)])


def _set(g, name, value):
    g.inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), name))
