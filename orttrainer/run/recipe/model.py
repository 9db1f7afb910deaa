"""A recipe's `model:` section: its Hugging Face config class, unknown config keys, and the shapes a
config cannot build (widths, heads, positions). Used by the recipe checks, the memory estimate and the
model builder."""

import inspect

from orttrainer._config import validation as _validation
from orttrainer.run.recipe.errors import RecipeError


def hf_config_class(kind):
    try:
        import transformers
    except ImportError:
        raise RecipeError("recipes need Hugging Face transformers: "
                          "pip install 'orttrainer[recipes]'") from None
    return transformers.GPT2Config if kind == "gpt2" else transformers.BertConfig


def check_model_config(kind, config):
    cls = hf_config_class(kind)
    known = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters)
    known |= {"num_labels", "attn_implementation"}
    known -= {"self", "kwargs", "_name_or_path", "model_type", "transformers_version", "architectures"}
    problems = []
    for key, value in config.items():
        if key not in known:
            hint = _validation.did_you_mean(key, sorted(known))
            text = f"model.config.{key}: got {_validation.short_repr(value)}; {cls.__name__} has no such key"
            problems.append(text + (f", did you mean 'model.config.{hint}'?" if hint else ""))
    return problems


_HEADS = {"gpt2": ("n_embd", "n_head"), "bert": ("hidden_size", "num_attention_heads")}
_POSITIVE = {"gpt2": ("n_embd", "n_head", "n_layer", "vocab_size", "n_positions"),
             "bert": ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                      "vocab_size", "max_position_embeddings")}


def model_shape_problems(kind, values, seq_length=None):
    """Lines about a model config (a dict, every key present) that cannot build the model: sizes below
    1, a width that is not a multiple of the number of heads, fewer positions than the sequence."""
    family = "gpt2" if kind == "gpt2" else "bert"
    problems = []
    for key in _POSITIVE[family]:
        value = values.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"model.config.{key}: got {_validation.short_repr(value)}; expected an integer >= 1")
    if problems:
        return problems
    width, heads = _HEADS[family]
    if values[width] % values[heads]:
        problems.append(f"model.config.{width}: got {values[width]}; it must be a multiple of "
                        f"model.config.{heads} ({values[heads]})")
    positions = _POSITIVE[family][-1]
    if seq_length is not None and values[positions] < seq_length:
        problems.append(f"model.config.{positions}: got {values[positions]}; smaller than data.seq_length "
                        f"({seq_length})")
    return problems


def check_model_shape(doc):
    """model_shape_problems for a recipe whose model is a random init of its config (the config of
    model.from / run.init_from is only known when the model is built)."""
    model, data = doc["model"], doc["data"]
    if model["from"] or doc["run"]["init_from"]:
        return []
    kind = model["kind"]
    config = dict(model["config"])
    config.setdefault("vocab_size", data["vocab_size"])
    if kind == "gpt2":
        config.setdefault("n_positions", max(1024, data["seq_length"]))
        for key in ("bos_token_id", "eos_token_id"):  # the tokenizer decides them; 50256 warns for a small vocab
            config.setdefault(key, None)
    try:
        values = hf_config_class(kind)(**config).to_dict()
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        return [f"model.config: rejected: {exc}"]
    return model_shape_problems(kind, values, data["seq_length"])
