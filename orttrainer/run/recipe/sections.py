"""A validated recipe's sections as frozen dataclasses: what the run layer reads.

Validation (spec.py) fills in every default and gives plain nested data (`Recipe.doc`, what `config
print` shows). The run layer reads the sections through these classes instead of string keys, so that a
misspelt name is an AttributeError on the first run of that code, with any recipe, instead of a
KeyError deep into a run where only some recipes reach; and no component can change what another reads.

Built once per recipe from the validated doc (`_Section.of`); a key the doc has and a class lacks, or the
reverse, is a ValueError there, so schemas/recipe.yaml and these classes cannot drift apart unseen.
Lists become tuples and mappings read-only views (`frozen`); `thawed` gives plain data back.

The `trainer:` section is not typed here: its keys are ORTTrainerOptions' (schemas/options.yaml, which
ORTTrainerOptions validates itself), so `Recipe.trainer` is a read-only view of that mapping.
"""

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Optional, Tuple, Union


def frozen(value):
    """`value` read-only all the way down: mappings become MappingProxyType, lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(item) for item in value)
    return value


def thawed(value):
    """Plain data (dicts, lists) of a frozen value or section, as the doc holds it."""
    if isinstance(value, _Section):
        return {_key(f): thawed(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thawed(item) for item in value]
    return value


def _key(field):
    """The recipe key of a field: its name, unless the key is a Python keyword (`from`)."""
    return field.metadata.get("key", field.name)


class _Section:
    """A section built from the doc: fields named after its keys, nested sections built in turn."""

    @classmethod
    def of(cls, doc, where):
        """The section of the validated mapping `doc` at `where` (a dotted key, for the error)."""
        fields = dataclasses.fields(cls)
        keys = [_key(f) for f in fields]
        extra, missing = sorted(set(doc) - set(keys)), sorted(set(keys) - set(doc))
        if extra or missing:
            raise ValueError(f"{where}: the validated recipe and {cls.__name__} disagree: keys without a "
                             f"field {extra}, fields without a key {missing} (schemas/recipe.yaml)")
        values = {}
        for f in fields:
            value = doc[_key(f)]
            nested = isinstance(f.type, type) and issubclass(f.type, _Section)
            values[f.name] = f.type.of(value, f"{where}.{_key(f)}") if nested else frozen(value)
        return cls(**values)


_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class ModelSection(_Section):
    """`model:` what to train."""
    kind: str                    # bert-pretraining | gpt2 | bert-classification
    config: Mapping              # Hugging Face config keyword arguments (read-only view)
    from_: Optional[str] = dataclasses.field(metadata={"key": "from"})  # `from`: weights to start from


@_frozen
class BertSection(_Section):
    """`data.bert:` how BERT pretraining instances are built."""
    max_predictions_per_seq: int
    masked_lm_prob: float
    short_seq_prob: float
    dupe_factor: int


@_frozen
class GptSection(_Section):
    """`data.gpt:` where GPT-2 text is in records."""
    text_field: str


@_frozen
class GlueSection(_Section):
    """`data.glue:` the classification task: files and columns, or the bundled task."""
    train_file: str
    dev_file: str
    text_a: Union[str, int, None]
    text_b: Union[str, int, None]
    label: Union[str, int, None]
    single_sentence: bool
    header: bool
    quotechar: Optional[str]
    label_list: Optional[Tuple[str, ...]]
    task: str                    # topic | next-sentence
    num_topics: int
    num_train: int
    num_dev: int


@_frozen
class DataSection(_Section):
    """`data:` what the model reads, and how it is built and batched."""
    corpus: Union[str, Tuple[str, ...]]
    corpus_max_mb: Optional[float]
    path: Optional[str]
    cache_dir: str
    tokenizer: Optional[str]
    vocab_size: int
    seq_length: int
    batch_size: int
    eval_batch_size: Optional[int]
    eval_fraction: float
    seed: int
    bert: BertSection
    gpt: GptSection
    glue: GlueSection


@_frozen
class RunSection(_Section):
    """`run:` how long, where to, and what to write along the way."""
    max_steps: int
    log_every: int
    eval_every: int
    eval_batches: Optional[int]
    save_every: int
    on_nonfinite_loss: str       # stop | skip
    save_total_limit: Optional[int]
    output_dir: str             # resolved: never null
    overwrite_output_dir: bool
    seed: int
    init_from: Optional[str]
    check_memory: bool
    export_at_end: Union[str, Tuple[str, ...], None]
    progress_bar: Union[str, bool]
    report_to: Tuple[str, ...]
    profile_steps: Optional[Tuple[int, int]]
