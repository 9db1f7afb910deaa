"""Tiny models shared by the engine tests (and nothing else): an MLP and a GPT-style language model."""

import math

import torch
import torch.nn.functional as F


class MLP(torch.nn.Module):
    def __init__(self, d_in=6, hidden=16, classes=4):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


MLP_DESC = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 4])]}


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
