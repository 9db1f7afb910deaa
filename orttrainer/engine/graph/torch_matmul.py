"""Matrix products of the training graph moved onto torch's kernels (engine/kernels/library.py).

After the gradient graph is built (so no gradient definitions are needed), each fp32 MatMul, Gemm
and FusedMatMul -- forward and backward -- chosen by `wanted` becomes one `com.orttrainer::TorchMatMul`
node computing the same product:

    MatMul(A, B)                        -> TorchMatMul(A, B)
    FusedMatMul(A, B; transA, transB, alpha) -> TorchMatMul(A, B; transA, transB, alpha)
    Gemm(A, B, C; transA, transB, alpha, beta) -> TorchMatMul(A, B, C; the same)
    MatMul(Transpose(X), B), X's last two dims swapped -> TorchMatMul(X, B; transA=1)

The last form matters: onnxruntime fuses such a Transpose into the product at session creation
(FusedMatMul), which it cannot do for a custom op; read through, the operand is a strided view torch's
GEMM takes as it is, with no copy. `compute` is "float32" (the same product, another kernel) or
"bfloat16" (mixed precision on a CPU with bf16 units: computed as torch.autocast computes it).
"""

from onnx import TensorProto, helper

from orttrainer.engine.graph.builder import MS_DOMAIN

DOMAIN = "com.orttrainer"  # engine/kernels/library.py's op
OP = "TorchMatMul"
COMPUTE = {"float32": 0, "bfloat16": 1}
PRODUCTS = {("", "MatMul"), ("", "Gemm"), (MS_DOMAIN, "FusedMatMul")}


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _float_tensors(graph):
    """Names whose element type the graph records as fp32 (inputs, initializers, value_info, outputs)."""
    names = {i.name for i in graph.initializer if i.data_type == TensorProto.FLOAT}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            names.add(info.name)
    return names


def _swaps_last_two(node):
    perm = _attrs(node).get("perm")
    if perm is None or len(perm) < 2:
        return False
    n = len(perm)
    return list(perm) == list(range(n - 2)) + [n - 1, n - 2]


def products(model):
    """The product nodes of `model` that could move (fp32 operands, no batch transposes)."""
    graph = model.graph
    floats = _float_tensors(graph)
    found = []
    for node in graph.node:
        if (node.domain, node.op_type) not in PRODUCTS:
            continue
        attrs = _attrs(node)
        if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
            continue
        if node.output[0] not in floats and not all(name in floats for name in node.input[:2]):
            continue
        found.append(node)
    return found


def matmuls_on_torch(model, compute="float32", wanted=None):
    """Replace the product nodes `wanted(node)` accepts (all by default) by TorchMatMul computing in
    `compute`; returns how many. Transposes left with no reader are removed."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    targets = [n for n in products(model) if wanted is None or wanted(n)]
    if not targets:
        return 0
    replaced = {}
    for node in targets:
        attrs = _attrs(node)
        a, b = node.input[0], node.input[1]
        trans_a, trans_b = int(attrs.get("transA", 0)), int(attrs.get("transB", 0))
        for operand in (0, 1):
            name = a if operand == 0 else b
            source = producers.get(name)
            if source is not None and source.op_type == "Transpose" and source.domain == "" \
                    and _swaps_last_two(source):
                if operand == 0:
                    a, trans_a = source.input[0], 1 - trans_a
                else:
                    b, trans_b = source.input[0], 1 - trans_b
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else ""
        inputs = [a, b] + ([bias] if bias else [])
        replaced[id(node)] = helper.make_node(
            OP, inputs, list(node.output), name=f"{node.name or node.output[0]}_torch", domain=DOMAIN,
            transA=trans_a, transB=trans_b, alpha=float(attrs.get("alpha", 1.0)),
            beta=float(attrs.get("beta", 1.0)), compute=COMPUTE[compute])
    nodes = [replaced.get(id(n), n) for n in graph.node]
    read = {name for n in nodes for name in n.input} | {o.name for o in graph.output}
    unread = [n for n in nodes if n.op_type == "Transpose" and n.domain == "" and n.output[0] not in read]
    nodes = [n for n in nodes if not any(n is t for t in unread)]
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(op.domain == DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(targets)


def kernel_counts(model):
    """How many matrix products of `model` each kernel computes: {"mlas", "torch_float32",
    "torch_bfloat16"}."""
    counts = {"mlas": 0, "torch_float32": 0, "torch_bfloat16": 0}
    for node in model.graph.node:
        if (node.domain, node.op_type) in PRODUCTS:
            counts["mlas"] += 1
        elif node.domain == DOMAIN and node.op_type == OP:
            bf16 = _attrs(node).get("compute", 0) == COMPUTE["bfloat16"]
            counts["torch_bfloat16" if bf16 else "torch_float32"] += 1
    return counts
