"""Models, batches and model descriptions for the training benchmark (bench/train_bench.py).

Two workloads:
  * ``gpt``  — a GPT-style decoder defined here: token + learned position embedding, pre-LN blocks
    (causal self-attention, GELU MLP 4x), final LayerNorm, output head tied to the token embedding,
    cross-entropy next-token loss.
  * ``bert`` — Hugging Face ``transformers.BertForPreTraining`` from a small config, MLM + NSP labels,
    the loss is the model's own ``loss`` output.

Every system in the benchmark gets a deepcopy of the same initial module and the same pre-generated
batches, so the only difference between systems is the engine. By default every system also runs the
same loss module, which returns only the loss (`Workload.ort_trainer_args`).
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------- GPT
@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    max_positions: int = 256  # >= the longest sequence of the --scaling sweep (seq 256)
    # "masked": explicit scores + masked_fill(-inf) + softmax (exports as MatMul/Where/Softmax);
    # "sdpa": F.scaled_dot_product_attention(is_causal=True).  Both export to ONNX (TorchScript
    # exporter, training mode, opset 14) and train under orttrainer; see ATTENTION_NOTE.
    attention: str = "sdpa"
    attn_dropout: float = 0.0  # dropout on the attention probabilities (bench/recompute_memory.py uses 0.1)


ATTENTION_NOTE = (
    "Both attention forms export with the TorchScript exporter (training mode, opset 14) and train under "
    "orttrainer. 'sdpa' exports to MatMul/Mul/Add(mask)/Softmax/MatMul (the exporter builds the causal "
    "mask from a Trilu of ones), 'masked' to MatMul/Div/Where/Softmax/MatMul; in eager/compile 'sdpa' runs "
    "PyTorch's fused CPU flash-attention kernel. The benchmark uses 'sdpa' (what a user writes today, and "
    "eager's fastest path); --attention masked selects the other form."
)


class Block(torch.nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.hidden
        self.width, self.heads = d, cfg.heads
        self.attention = cfg.attention
        self.attn_dropout = cfg.attn_dropout
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        # The width from the config, not x.shape: with a dynamic batch axis the exporter would compute it
        # at run time, and tensor parallel's cut (engine/parallel/megatron.py) divides constant sizes only.
        b, t, _ = x.shape
        d, h = self.width, self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        p = self.attn_dropout if self.training else 0.0
        if self.attention == "sdpa":
            att = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = scores.softmax(-1)
            att = (F.dropout(probs, p) if p else probs) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """forward(input_ids [batch, seq] int64) -> logits [batch, seq, vocab]."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = torch.nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = torch.nn.Embedding(cfg.max_positions, cfg.hidden)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = torch.nn.LayerNorm(cfg.hidden)
        self.head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(_init_weights)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _init_weights(module):
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)


def gpt_loss(logits, labels):
    """Cross entropy over every position (labels are the next tokens, pre-shifted)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


# --------------------------------------------------------------------------- BERT
@dataclass(frozen=True)
class BertSize:
    vocab: int = 30522
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 1024
    max_positions: int = 512


def make_bert(size: BertSize = BertSize()):
    import transformers

    config = transformers.BertConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=size.max_positions,
    )
    return transformers.BertForPreTraining(config)


# --------------------------------------------------------------------------- workloads
class Workload:
    """One benchmark workload: how to build the model, its batches, its loss and its model_desc.

    `loss_module(model)` returns a module whose forward(*batch) returns the scalar loss: the step that
    PyTorch eager runs and torch.compile compiles. `ort_trainer_args` gives orttrainer the same step.
    """

    name = ""
    loss_fn = None

    def __init__(self, batch, seq, ort_outputs="loss"):
        assert ort_outputs in ("loss", "all"), ort_outputs
        self.batch, self.seq = batch, seq
        self.ort_outputs = ort_outputs

    def ort_trainer_args(self, model):
        """(model, model_desc, loss_fn) for ORTTrainer, by `ort_outputs`:

        "loss": the loss module that eager and torch.compile run, described as returning the loss only:
            the same work and the same result per step as theirs (the default).
        "all": the legacy scripts' form: the bare model with `loss_fn` (GPT) or the model's own loss
            (BERT), every model output described, so the [batch, seq, vocab] logits are returned (and
            kept for the whole step) on every train_step.
        """
        desc = self.model_desc()
        if self.ort_outputs == "all":
            return model, desc, self.loss_fn
        desc["outputs"] = desc["outputs"][:1]
        return self.loss_module(model), desc, None

    @property
    def tokens(self):
        return self.batch * self.seq

    def describe(self):
        """The workload's settings for the JSON report (subclasses add the model's)."""
        return {"batch": self.batch, "seq": self.seq, "orttrainer_outputs": self.ort_outputs}


class GPTWorkload(Workload):
    name = "gpt"

    def __init__(self, batch=8, seq=128, cfg: GPTConfig = GPTConfig(), ort_outputs="loss"):
        super().__init__(batch, seq, ort_outputs)
        self.cfg = cfg
        assert seq <= cfg.max_positions

    def make_model(self, seed=0):
        torch.manual_seed(seed)
        return GPT(self.cfg)

    def batches(self, n, seed=0):
        g = torch.Generator().manual_seed(1234 + seed)
        out = []
        for _ in range(n):
            tokens = torch.randint(0, self.cfg.vocab, (self.batch, self.seq + 1), generator=g)
            out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        return out

    loss_fn = staticmethod(gpt_loss)

    def model_desc(self):
        return {
            "inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", self.cfg.vocab])],
        }

    def loss_module(self, model):
        return _GPTWithLoss(model)

    def describe(self):
        return {
            "model": "GPT-style decoder (bench/train_bench/models.py)",
            **asdict(self.cfg),
            **super().describe(),
            "tied_head": True,
            "norm": "pre-LN",
            "mlp": "GELU (erf) 4x",
            "loss": "cross-entropy over all positions",
        }


class _GPTWithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return gpt_loss(self.model(input_ids), labels)


class BertWorkload(Workload):
    name = "bert"

    def __init__(self, batch=8, seq=128, size: BertSize = BertSize(), ort_outputs="loss"):
        super().__init__(batch, seq, ort_outputs)
        self.size = size

    def make_model(self, seed=0):
        torch.manual_seed(seed)
        return make_bert(self.size)

    def batches(self, n, seed=0):
        """input_ids, attention_mask (all ones), token_type_ids (two segments), MLM labels on 15% of
        positions (-100 elsewhere), NSP labels."""
        g = torch.Generator().manual_seed(4321 + seed)
        b, t, vocab = self.batch, self.seq, self.size.vocab
        out = []
        for _ in range(n):
            ids = torch.randint(1000 if vocab > 2000 else 5, vocab, (b, t), generator=g)
            attention_mask = torch.ones(b, t, dtype=torch.long)
            token_type_ids = torch.zeros(b, t, dtype=torch.long)
            token_type_ids[:, t // 2 :] = 1
            chosen = torch.rand(b, t, generator=g) < 0.15
            chosen[:, 0] = True  # at least one MLM target per row
            labels = torch.where(chosen, ids, torch.full_like(ids, -100))
            nsp = torch.randint(0, 2, (b,), generator=g)
            out.append((ids, attention_mask, token_type_ids, labels, nsp))
        return out

    def model_desc(self):
        return {
            "inputs": [
                ("input_ids", ["batch", "seq"]),
                ("attention_mask", ["batch", "seq"]),
                ("token_type_ids", ["batch", "seq"]),
                ("labels", ["batch", "seq"]),
                ("next_sentence_label", ["batch"]),
            ],
            "outputs": [
                ("loss", [], True),
                ("prediction_logits", ["batch", "seq", self.size.vocab]),
                ("seq_relationship_logits", ["batch", 2]),
            ],
        }

    def loss_module(self, model):
        return _BertWithLoss(model)

    def describe(self):
        return {
            "model": "transformers.BertForPreTraining",
            **asdict(self.size),
            **super().describe(),
            "loss": "model's own loss (MLM on 15% of positions + NSP)",
        }


class _BertWithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids, labels, next_sentence_label):
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            labels=labels,
            next_sentence_label=next_sentence_label,
        ).loss
