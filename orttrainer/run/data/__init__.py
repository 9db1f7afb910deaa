"""Training data: the bundled stdlib corpus, tokenizers, and builders/readers for BERT
pretraining shards (NVIDIA HDF5), GPT token files and GLUE-style TSVs.

Names are imported lazily so `import orttrainer.run.data` stays cheap.
"""

import importlib

_NAMES = {
    "DataError": "common",
    "build_corpus": "corpus", "ensure_corpus": "corpus", "read_documents": "corpus",
    "iter_documents": "corpus",
    "train_tokenizer": "tokenizer", "save_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "special_token_ids": "tokenizer",
    "build_bert_shards": "bert", "BertPretrainingDataset": "bert", "find_shards": "bert",
    "build_gpt_tokens": "gpt", "GPTBlockDataset": "gpt",
    "read_glue_tsv": "glue", "GlueDataset": "glue", "build_next_sentence_task": "glue",
    "ResumableSampler": "sampler", "ResumableLoader": "sampler",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(f"orttrainer.run.data.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'orttrainer.run.data' has no attribute {name!r}")


def __dir__():
    return __all__
