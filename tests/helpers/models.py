"""The tests' tiny models: an MLP (also one computing its own loss, exported to ONNX), a GPT-style
language model, and an attention model whose export bakes the sequence length. Small and seeded: a
trainer builds and runs a few steps in well under a second on two cores."""

import io
import math
import warnings

import torch
import torch.nn.functional as F


D_IN, HIDDEN, CLASSES = 6, 16, 4


class MLP(torch.nn.Module):
    """x [batch, 6] -> logits [batch, 4]; trained with `cross_entropy`."""

    def __init__(self, d_in=D_IN, hidden=HIDDEN, classes=CLASSES, dropout=0.0):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.drop = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


MLP_DESC = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", CLASSES])]}


def mlp_loss(logits, label):
    """The MLP's loss on [batch, classes] logits as they come: the export keeps the class axis that
    the trainer's label-range check reads."""
    return F.cross_entropy(logits, label)


def cross_entropy(logits, label):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))


class Block(torch.nn.Module):
    def __init__(self, dim, heads, attn_dropout=0.0):
        super().__init__()
        self.heads = heads
        self.attn_dropout = attn_dropout
        self.ln1 = torch.nn.LayerNorm(dim)
        # No qkv bias: the key bias has an exactly-zero true gradient, and Adam would turn the float
        # noise of two implementations into different ±lr updates.
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 4 * dim)
        self.out = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = scores.softmax(-1)
        if self.attn_dropout:
            probs = F.dropout(probs, self.attn_dropout, self.training)
        att = (probs @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    """Embedding, pre-LN causal attention blocks (optionally with dropout on the attention
    probabilities), GELU MLP, tied output head."""

    def __init__(self, vocab=50, dim=16, heads=2, layers=2, max_len=32, attn_dropout=0.0):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, attn_dropout) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


GPT_DESC = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", 50])]}


def gpt_batches(n, batch=4, seq=12, vocab=50, seed=0):
    """`n` (token ids, next-token labels) batches for TinyGPT: random ids, labels the ids shifted by one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


class MLPWithLoss(torch.nn.Module):
    """The MLP computing its own loss: forward(x, y) -> (loss, logits). Exported as an ONNX model."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        logits = self.fc2(torch.relu(self.fc1(x)))
        return F.cross_entropy(logits, y), logits


def export_mlp_with_loss(seed=0):
    """Serialized ONNX (bytes) of MLPWithLoss in training mode, loss as graph output 'loss'."""
    torch.manual_seed(seed)
    model = MLPWithLoss()
    x = torch.randn(8, D_IN)
    y = torch.randint(0, CLASSES, (8,))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (x, y), buffer, input_names=["x", "y"], output_names=["loss", "logits"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}, "logits": {0: "batch"}},
            dynamo=False, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
            opset_version=14,
        )
    return buffer.getvalue()


ATTENTION_VOCAB, ATTENTION_DIM = 40, 16


class Attention(torch.nn.Module):
    """nn.MultiheadAttention: the exporter bakes the sequence length into a Reshape."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(ATTENTION_VOCAB, ATTENTION_DIM)
        # No projection biases: the key bias has an exactly-zero true gradient, which Adam would turn
        # into ±lr updates of float noise (Block, above).
        self.mha = torch.nn.MultiheadAttention(ATTENTION_DIM, 2, batch_first=True, bias=False)
        self.out = torch.nn.Linear(ATTENTION_DIM, ATTENTION_VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        attended, _ = self.mha(h, h, h, need_weights=False)
        return self.out(attended + h)


ATTENTION_DESC = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
                  "outputs": [("loss", [], True), ("logits", ["batch", "seq", ATTENTION_VOCAB])]}


def attention_batch(seq, seed, batch_size=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ATTENTION_VOCAB, (batch_size, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)
