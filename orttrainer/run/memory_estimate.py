"""Will the run fit in this machine's memory? A rough estimate made before anything is built.

A recipe with ``n_layer: 10000`` or ``seq_length: 65536`` is valid YAML; without this check it is
built anyway and grows until the kernel kills it minutes later. The estimate, per process::

    base        the interpreter with torch, onnxruntime and transformers loaded, sessions, arenas
    state       parameters x 4 bytes x copies: the torch model, the session's weights, the gradients,
                the accumulation buffer, the optimizer moments (Adam and LAMB: 2; SGD: none; ZeRO-1:
                moments split over the ranks) and the exported ONNX model during the build
    activations per micro-batch (data.batch_size x data.seq_length): per layer a multiple of
                batch x seq x hidden plus the attention scores (batch x heads x seq^2), and the output
                logits (batch x seq x vocab), each times a factor for what the backward pass keeps

The factors are calibrated against the peak resident memory of real tiny runs (docs/recipes.md,
"Memory check"); they are meant to be honest within a factor of about 1.5, which separates "fits"
from "cannot possibly fit" — not to plan a run to the last gigabyte. `run.check_memory: false`
skips the check.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from orttrainer.run.recipe.spec import RecipeError
from orttrainer.run.recipe.model import hf_config_class

GIB = 1024 ** 3
MIB = 1024 ** 2
# Calibrated on measured peaks (docs/recipes.md, "Memory check").
BASE_BYTES = 600 * MIB
STATE_COPIES = 6               # torch weights, session weights (x2 while built), gradients, accumulator,
                               # the exported model
HIDDEN_FACTOR = 30             # float32 tensors of batch x seq x hidden kept per layer for the backward pass
INNER_FACTOR = 2.5             # of batch x seq x intermediate size (the MLP's wide activations)
ATTENTION_FACTOR = 5           # of batch x heads x seq^2 per layer: scores, probabilities, dropout mask, grad
LOGITS_FACTOR = 5              # of batch x seq x vocab: logits, softmax, their gradient, the eval copy
FLOAT = 4


@dataclass
class Estimate:
    parameters: int
    state: int
    activations: int
    total: int

    def describe(self):
        return (f"about {_size(self.total)} per process ({self.parameters / 1e6:,.1f}M parameters: "
                f"{_size(self.state)} with gradients and optimizer state; activations of one micro-batch "
                f"{_size(self.activations)})")


def _size(n):
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / MIB:,.0f} MiB"


def model_values(recipe):
    """The model's full config (dict) as the run will build it, or None when it cannot be known here
    (the config of model.from / run.init_from cannot be read)."""
    base = {}
    source = recipe.model.from_ or recipe.run.init_from
    if source:
        base = _source_config(source)
        if base is None:
            return None
    values = {**base, **recipe.model.config}
    values.setdefault("vocab_size", recipe.data.vocab_size)
    if recipe.kind == "gpt2":
        values.setdefault("n_positions", max(1024, recipe.data.seq_length))
    for key in ("_name_or_path", "transformers_version", "architectures", "model_type"):
        values.pop(key, None)
    # The class's defaults under the given values, without building a config (which would warn about
    # token ids the tokenizer, not built yet, decides).
    full = {**hf_config_class(recipe.kind)().to_dict(), **values}
    sizes = ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions") if recipe.kind == "gpt2" else \
        ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if not all(isinstance(full.get(k), int) and full[k] > 0 for k in sizes):
        return None  # the schema checks report it
    return full


def _source_config(source):
    from orttrainer.run import hf_models as models

    try:
        found = models.weight_source(source, "model.from")
    except RecipeError:
        return None
    if found.model_json is not None:
        return dict(found.model_json.get("config") or {})
    config = Path(found.path) / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _shape(kind, v):
    """(hidden, layers, heads, inner, vocab, positions, parameter count) of a BERT or GPT-2 config."""
    if kind == "gpt2":
        h, layers, heads = v["n_embd"], v["n_layer"], v["n_head"]
        vocab, pos = v["vocab_size"], v["n_positions"]
        inner = v.get("n_inner") or 4 * h
        per_layer = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
        params = vocab * h + pos * h + layers * per_layer + 2 * h  # lm_head is tied to the embedding
        return h, layers, heads, inner, vocab, params
    h, layers, heads = v["hidden_size"], v["num_hidden_layers"], v["num_attention_heads"]
    inner = v["intermediate_size"]
    vocab, pos, types = v["vocab_size"], v["max_position_embeddings"], v.get("type_vocab_size", 2)
    per_layer = 4 * (h * h + h) + (h * inner + inner) + (inner * h + h) + 4 * h
    # embeddings (+ their LayerNorm), encoder, pooler
    params = (vocab + pos + types) * h + 2 * h + layers * per_layer + (h * h + h)
    if kind == "bert-pretraining":
        params += (h * h + h) + 2 * h + vocab + (2 * h + 2)  # MLM transform + decoder bias (tied), NSP
    else:
        params += h * v.get("num_labels", 2) + v.get("num_labels", 2)
    return h, layers, heads, inner, vocab, params


def estimate(recipe, processes=1):
    """Estimate of one process of `recipe` (None when its model config cannot be known here)."""
    values = model_values(recipe)
    if values is None:
        return None
    kind = recipe.kind
    h, layers, heads, inner, vocab, params = _shape(kind, values)
    t = recipe.trainer
    moments = 0 if t["optimizer"]["name"] == "sgd" else 2
    if t["distributed"]["deepspeed_zero_optimization"]["stage"] >= 1 and processes > 1:
        moments /= processes
    state = int(params * FLOAT * (STATE_COPIES + moments))
    batch, seq = recipe.data.batch_size, recipe.data.seq_length
    tokens = batch * seq
    attention = batch * heads * seq * seq
    per_layer = tokens * (HIDDEN_FACTOR * h + INNER_FACTOR * inner) + ATTENTION_FACTOR * attention
    logits = tokens * (vocab if kind != "bert-classification" else 0)
    activations = int(FLOAT * (layers * per_layer + LOGITS_FACTOR * logits))
    return Estimate(params, state, activations, BASE_BYTES + state + activations)


def available_memory():
    """(bytes this process can still use, where that figure comes from), or (None, None)."""
    found = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or a huge number: no limit
            found.append((int(limit) - usage, "the cgroup's memory limit"))
        break
    if not found:
        return None, None
    return min(found)


ADVICE = ("lower data.batch_size (raise trainer.batch.gradient_accumulation_steps to keep the global batch), "
          "data.seq_length or the model's size, or set run.check_memory=false to start anyway")


def shortfall(recipe, processes=1):
    """The words saying that `processes` processes of `recipe` cannot fit in the available memory,
    or None (they fit, the check is off, or there is nothing to estimate)."""
    if not recipe.run.check_memory or str(recipe.trainer["device"]["id"]).startswith("cuda"):
        return None  # on a GPU the activations live in device memory, which this estimate does not cover
    guess = estimate(recipe, processes)
    free, where = available_memory()
    if guess is None or free is None:
        return None
    needed = guess.total * processes
    if needed <= free:
        return None
    ranks = f" x {processes} processes = {_size(needed)}" if processes > 1 else ""
    return f"memory: this run needs {guess.describe()}{ranks}, but this machine has {_size(free)} available ({where})"


def check(recipe, processes=1):
    """RecipeError (one line) when `processes` processes of `recipe` cannot fit in the available memory:
    `train` refuses to start such a run (`config validate` only notes it)."""
    found = shortfall(recipe, processes)
    if found:
        raise RecipeError(f"{found}; {ADVICE}")


def processes_on_this_machine(nproc=1):
    """Processes of this run sharing this machine's memory: --nproc, or torchrun's LOCAL_WORLD_SIZE."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", nproc))
    except ValueError:
        return nproc
