"""Training recipes: one YAML file that says what to train, on what data, how, and for how long.

    recipe = load_recipe("recipes/bert-pretrain-tiny.yaml", overrides=["run.max_steps=10"])
    recipe.doc                 # the fully resolved recipe (plain data, every default filled in)
    recipe.run.max_steps       # model, data, run: frozen dataclasses (sections.py); trainer: read-only
    recipe.options()           # ORTTrainerOptions built from the `trainer:` section
    recipe.optimizer_config()  # orttrainer.optim.LambConfig(...) etc.

The schema is data (schemas/recipe.yaml); its `trainer:` section is ORTTrainerOptions' own schema
(schemas/options.yaml, merged in here, not copied) plus `optimizer` and `lr_scheduler`, which name
an `orttrainer.optim` class and give its constructor's arguments. Every problem is reported as one
line ``dotted.key.path: got <value>; <what is allowed>`` (with "did you mean" for misspelt keys and
values) in a `RecipeError`. Keys and their meaning: docs/recipes.md.
"""

import copy
import enum
import inspect
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import cerberus
import cerberus.errors
import yaml

from orttrainer._config import validation as _validation
from orttrainer.optim import config as optim_config
from orttrainer.optim import lr_scheduler as schedulers
from orttrainer.orttrainer_options import ORTTrainerOptions, ORTTrainerOptionsValidator, options_schema
from orttrainer.run.recipe.errors import RecipeError
from orttrainer.run.recipe.model import check_model_config, check_model_shape
from orttrainer.run.recipe.sections import DataSection, ModelSection, RunSection, frozen

KINDS = ("bert-pretraining", "gpt2", "bert-classification")

OPTIMIZERS = {"adam": optim_config.AdamConfig, "lamb": optim_config.LambConfig, "sgd": optim_config.SGDConfig}
SCHEDULERS = {
    "constant": schedulers.ConstantWarmupLRScheduler,
    "cosine": schedulers.CosineWarmupLRScheduler,
    "linear": schedulers.LinearWarmupLRScheduler,
    "poly": schedulers.PolyWarmupLRScheduler,
}
# Keys of the recipe's trainer section that are not ORTTrainerOptions.
_RECIPE_ONLY_TRAINER_KEYS = ("optimizer", "lr_scheduler")
# Constructor arguments a recipe cannot give (objects, or fixed by the recipe itself).
_NOT_FROM_RECIPES = {"self", "params", "total_steps"}


# ---------------------------------------------------------------- YAML


# Values a YAML document may hold once its aliases are expanded: a recipe holds a few hundred, while
# a "billion laughs" document of 1 KB (aliases of aliases) expands to billions, which every reader of
# the parsed recipe (validation, error messages, dumps) would walk.
MAX_YAML_VALUES = 10_000


class _AliasBomb(yaml.YAMLError):
    def __init__(self, problem, mark):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


def _expanded_size(node, sizes, open_nodes):
    """Values in `node` with every alias expanded; _AliasBomb past MAX_YAML_VALUES (or on an alias
    inside the node it names), counted once per node so that the count itself stays cheap."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise _AliasBomb("an alias refers to a node that contains it (a recursive document)", node.start_mark)
    open_nodes.add(key)
    children = node.value if isinstance(node, yaml.SequenceNode) else \
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else ()
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_YAML_VALUES:
            raise _AliasBomb(f"its aliases expand to more than {MAX_YAML_VALUES:,} values (a YAML bomb?); "
                             "write the values out instead of aliasing aliases", node.start_mark)
    open_nodes.discard(key)
    sizes[key] = total
    return total


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.1 wants `1.0e-3`; users write 1e-3), and
    refuses a document whose aliases expand past MAX_YAML_VALUES before building anything."""

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _expanded_size(node, {}, set())
        return node


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _mapping_without_duplicates(loader, node):
    """A YAML mapping; a key given twice is an error (YAML would keep the last one silently)."""
    first_line = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first_line[key] + 1})",
                    key_node.start_mark)
            first_line[key] = key_node.start_mark.line
        except TypeError:  # an unhashable key: construct_mapping reports it
            pass
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


class _Dumper(yaml.SafeDumper):
    pass


def _represent_enum(dumper, value):
    return dumper.represent_str(value.name)


_Dumper.add_multi_representer(enum.Enum, _represent_enum)


def parse_yaml(text, source="<string>"):
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        what = "YAML refused" if isinstance(exc, _AliasBomb) else "not valid YAML"
        raise RecipeError(f"{what}{where}: {problem}", source) from None


def dump_yaml(doc):
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)


# ---------------------------------------------------------------- schema


def recipe_schema():
    """The recipe schema with ORTTrainerOptions' schema merged into `trainer` (a fresh copy)."""
    schema = _validation.load_schema("recipe.yaml")
    trainer = schema["trainer"]["schema"]
    merged = {key: trainer[key] for key in _RECIPE_ONLY_TRAINER_KEYS}
    for key, rules in options_schema().items():
        merged.setdefault(key, rules)  # the named lr_scheduler replaces the options' scheduler object
    schema["trainer"]["schema"] = merged
    return schema


class RecipeValidator(ORTTrainerOptionsValidator):
    """The options validator (custom types of options.yaml) plus the recipe's coercions; a bool is
    not an integer here (`save_every: true` is a mistake, not 1)."""

    types_mapping = {**ORTTrainerOptionsValidator.types_mapping,
                     "integer": cerberus.TypeDefinition("integer", (int,), (bool,))}

    def _normalize_coerce_to_float(self, value):
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value


_TYPE_HELP = {
    "boolean": "a bool (true/false)",
    "lr_scheduler": "a mapping {name: constant|cosine|linear|poly, ...}",
    "loss_scaler": "null (recipes use the trainer's DynamicLossScaler when mixed precision is on)",
    "session_options": "null (an onnxruntime.SessionOptions cannot be written in YAML)",
    "propagate_cast_ops_strategy": "a PropagateCastOpsStrategy name (NONE, INSERT_AND_REDUCE, FLOOD_FILL, "
    "REMOVE_INPUT_OUTPUT_UP_DOWN_CASTS)",
}


def _readable(validator):
    """One line per problem; 'allowed' errors list the allowed values and the closest one."""
    lines = []
    other = False
    for error in _validation._leaf_errors(validator._errors):
        if error.code == cerberus.errors.UNALLOWED_VALUE.code:
            where = _validation.dotted(error.document_path)
            allowed = list(error.constraint)
            hint = _validation.did_you_mean(error.value, [str(a) for a in allowed])
            line = f"{where}: got {_validation.short_repr(error.value)}; expected one of {allowed}"
            lines.append(line + (f", did you mean {hint!r}?" if hint else ""))
        else:
            other = True
    if other:
        lines += [line for line in _validation.readable_errors(validator, _TYPE_HELP)
                  if not any(line.split(";")[0] == known.split(";")[0] for known in lines)]
    return lines


# ---------------------------------------------------------------- overrides


def _schema_fields_at(schema, path):
    """(fields mapping at `path`, True) while the path stays in the schema; (None, False) when it
    enters a free-form mapping (model.config, provider_options...) where any key is allowed."""
    fields = schema
    for part in path:
        rules = fields.get(part)
        sub = rules.get("schema") if rules else None
        if not isinstance(sub, Mapping) or rules.get("allow_unknown"):
            return None, False
        fields = sub
    return fields, True


def apply_override(doc, assignment, schema=None):
    """Apply one `--set key.path=value` (value parsed as YAML) to the nested dict `doc`, in place."""
    where = f"--set {assignment}"
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"{where}: expected KEY.PATH=VALUE (for example run.max_steps=100)")
    path = key.split(".")
    if any(not part for part in path):
        raise RecipeError(f"{where}: {key!r} is not a dotted key path (empty part)")
    value = parse_yaml(text, where) if text.strip() else None
    if schema is not None:
        for depth in range(len(path)):
            fields, checked = _schema_fields_at(schema, path[:depth])
            if not checked:
                break
            if path[depth] not in fields:
                known = sorted(k for k in fields if isinstance(k, str))
                hint = _validation.did_you_mean(path[depth], known)
                full = ".".join(path[:depth + 1])
                if hint:
                    msg = f"unknown key {full!r}, did you mean {'.'.join([*path[:depth], hint])!r}?"
                else:
                    msg = f"unknown key {full!r}; known keys here: {', '.join(known)}"
                raise RecipeError(f"{where}: {msg}")
    node = doc
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise RecipeError(f"{where}: {'.'.join(path[:depth + 1])} is {_validation.short_repr(child)}, "
                              "not a mapping, so it has no keys")
        node = child
    node[path[-1]] = value


# ---------------------------------------------------------------- optimizer / scheduler arguments


def _parameters(cls):
    """{name: default} of the arguments a recipe may give to `cls`."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name not in _NOT_FROM_RECIPES and p.kind is p.POSITIONAL_OR_KEYWORD}


def _coerce_argument(where, value, default):
    """`value` converted to the type of `default`, or a RecipeError line."""
    if isinstance(default, enum.Enum):
        members = type(default).__members__
        if isinstance(value, str) and value in members:
            return members[value]
        values = {m.value for m in members.values()}
        if isinstance(value, int) and not isinstance(value, bool) and value in values:
            return type(default)(value)
        raise RecipeError(f"{where}: got {_validation.short_repr(value)}; expected one of {list(members)}")
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{where}: got {_validation.short_repr(value)}; expected a bool (true/false)")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise RecipeError(f"{where}: got {_validation.short_repr(value)}; expected a number")
    return value


def _class_arguments(section, where, classes, fixed):
    """Check and complete the arguments of the class `section['name']` names; returns (cls, section).

    `fixed` are keys handled by the recipe itself (name, lr, total_steps); every other key must be a
    constructor argument of the class; missing ones get the constructor's default.
    """
    cls = classes[section["name"]]
    params = _parameters(cls)
    problems, out = [], {key: section[key] for key in fixed if key in section}
    for key, value in section.items():
        if key in fixed:
            continue
        if key not in params:
            known = sorted(set(params) | set(fixed))
            hint = _validation.did_you_mean(key, known)
            text = (f"{where}.{key}: got {_validation.short_repr(value)}; "
                    f"{cls.__name__} has no argument {key!r}")
            text += f", did you mean '{where}.{hint}'?" if hint else f" (it takes {', '.join(known)})"
            problems.append(text)
            continue
        try:
            out[key] = _coerce_argument(f"{where}.{key}", value, params[key])
        except RecipeError as exc:
            problems += exc.lines
    for key, default in params.items():
        out.setdefault(key, default)
    if problems:
        raise RecipeError(problems)
    return cls, out


def _ordered(doc, schema):
    """`doc` with its keys in schema order (cerberus appends filled-in defaults at the end)."""
    if not isinstance(doc, dict) or not isinstance(schema, Mapping):
        return doc
    out = {}
    for key, rules in schema.items():
        if key in doc:
            sub = rules.get("schema") if isinstance(rules, Mapping) else None
            out[key] = _ordered(doc[key], sub) if isinstance(sub, Mapping) and rules.get("type") == "dict" \
                else doc[key]
    for key, value in doc.items():
        out.setdefault(key, value)
    return out


def _plain(value):
    """Enums by name, for printing and storing the resolved recipe."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def check_paths(recipe):
    """RecipeError when run.output_dir (or data.cache_dir, when data is built) is a file, lies under
    a file, or cannot be written."""
    checks = [("run.output_dir", recipe.run.output_dir)]
    if not recipe.data.path:
        checks.append(("data.cache_dir", recipe.data.cache_dir))
    problems = []
    for key, path in checks:
        problem = _folder_problem(Path(path))
        if problem:
            problems.append(f"{key}: got {str(path)!r}; {problem}")
    if problems:
        raise RecipeError(problems)


def _folder_problem(path):
    if path.exists() and not path.is_dir():
        return "it is a file, not a folder"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so no folder can be made under it"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    # os.access answers yes to root whatever the file system does (/proc, a read-only bind mount
    # access() misses, a full disk): only creating a file there shows that it can be written.
    try:
        fd, probe = tempfile.mkstemp(prefix=".orttrainer-write-check-", dir=existing)
    except OSError as exc:
        return f"cannot write in {existing}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(probe)
    return None


# ---------------------------------------------------------------- the recipe


def lr_scheduler_of(trainer):
    """The scheduler object of a `trainer:` section (None without one); also for the stored recipe of a
    checkpoint, which is not validated again (checkpointer.py)."""
    section = trainer["lr_scheduler"]
    if section is None:
        return None
    cls, args = _class_arguments(dict(section), "trainer.lr_scheduler", SCHEDULERS, ("name", "total_steps"))
    args.pop("name")
    try:
        scheduler = cls(**args)
    except AssertionError as exc:
        raise RecipeError(f"trainer.lr_scheduler: {cls.__name__} rejected its arguments: {exc}") from None
    lr = trainer["optimizer"]["lr"]
    if isinstance(scheduler, schedulers.PolyWarmupLRScheduler) and not lr > scheduler.lr_end:
        raise RecipeError(f"trainer.lr_scheduler.lr_end: got {scheduler.lr_end}; must be smaller than "
                          f"trainer.optimizer.lr ({lr})")
    return scheduler


class Recipe:
    """A validated recipe (see `resolve`): `doc` is the fully resolved plain data (what `config print`
    shows; a fresh copy on each read, so changing it changes nothing), `model`, `data` and `run` its
    frozen sections (sections.py), `trainer` a read-only view of the ORTTrainerOptions section."""

    __slots__ = ("_doc", "path", "model", "data", "run", "trainer")

    def __init__(self, doc, path=None):
        set_ = object.__setattr__
        set_(self, "_doc", copy.deepcopy(doc))
        set_(self, "path", path)
        for name, cls in (("model", ModelSection), ("data", DataSection), ("run", RunSection)):
            set_(self, name, cls.of(self._doc[name], name))
        set_(self, "trainer", frozen(self._doc["trainer"]))

    def __setattr__(self, name, value):
        raise AttributeError(f"a Recipe is read-only (cannot set {name!r}); build another with resolve()")

    def __reduce__(self):  # copy and pickle: built again from the doc
        return Recipe, (self._doc, self.path)

    doc = property(lambda self: copy.deepcopy(self._doc))
    kind = property(lambda self: self.model.kind)

    def to_yaml(self):
        return dump_yaml(self._doc)

    def optimizer_config(self):
        section = dict(self._doc["trainer"]["optimizer"])
        cls, args = _class_arguments(section, "trainer.optimizer", OPTIMIZERS, ("name", "lr"))
        args.pop("name")
        try:
            return cls(**args)
        except AssertionError as exc:
            raise RecipeError(f"trainer.optimizer: {cls.__name__} rejected its arguments: {exc}") from None

    def lr_scheduler(self):
        return lr_scheduler_of(self._doc["trainer"])

    def options_dict(self):
        """The `trainer:` section as an ORTTrainerOptions dict (without the scheduler)."""
        trainer = self._doc["trainer"]
        return {k: copy.deepcopy(v) for k, v in trainer.items() if k not in _RECIPE_ONLY_TRAINER_KEYS}

    def options(self, lr_scheduler=None, distributed=None):
        """ORTTrainerOptions of the `trainer:` section; `lr_scheduler` is the object to use (the
        loop passes its own, see run/loop.py), `distributed` this process's rank keys (run/ranks.py);
        problems become RecipeError lines under `trainer.`."""
        options = self.options_dict()
        options["lr_scheduler"] = lr_scheduler
        if distributed:
            options["distributed"] = {**options.get("distributed", {}), **distributed}
        mixed = options.get("mixed_precision") or {}
        if self.run.on_nonfinite_loss == "skip" and not mixed.get("enabled"):
            # fp32 compute with the mixed-precision graph's finiteness check and a fixed scale of 1:
            # a non-finite step is discarded before it updates anything (numerics otherwise unchanged).
            from orttrainer.amp import DynamicLossScaler

            options["mixed_precision"] = {**mixed, "enabled": True, "compute_dtype": "float32",
                                          "loss_scaler": DynamicLossScaler(automatic_update=False, loss_scale=1.0)}
        try:
            return ORTTrainerOptions(options)
        except ValueError as exc:
            notes = getattr(exc, "__notes__", None) or []
            if notes:
                raise RecipeError([f"trainer.{line}" for line in notes]) from None
            text = str(exc)
            text = text[len("Invalid options: "):] if text.startswith("Invalid options: ") else text
            raise RecipeError([f"trainer: {part.strip()}" for part in text.split("; ")]) from None


def default_output_dir(path):
    stem = Path(path).name if path else "recipe"
    for suffix in (".yaml", ".yml"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    return str(Path("runs") / stem)


def resolve(document, path=None, output_dir=None):
    """Validate `document` (a dict), fill every default; returns a Recipe or raises RecipeError."""
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        raise RecipeError(f"<root>: got {_validation.short_repr(document)}; expected a mapping of "
                          "sections (model, data, trainer, run)", path)
    exotic = _validation.exotic_key_errors(document)
    if exotic:
        raise RecipeError(list(_validation._exotic_lines(exotic)), path)
    validator = RecipeValidator(recipe_schema())
    normalized = validator.validated(_validation.copy_plain(document))
    if normalized is None:
        raise RecipeError(_readable(validator), path)
    doc = _validation.copy_plain(normalized)

    problems = check_model_config(doc["model"]["kind"], doc["model"]["config"])
    run = doc["run"]
    if output_dir is not None:
        run["output_dir"] = str(output_dir)
    if run["output_dir"] is None:
        run["output_dir"] = default_output_dir(path)
    trainer = doc["trainer"]
    if trainer["lr_scheduler"] is not None and trainer["lr_scheduler"].get("total_steps") is None:
        trainer["lr_scheduler"]["total_steps"] = run["max_steps"]
    for section, fixed, classes in (("optimizer", ("name", "lr"), OPTIMIZERS),
                                    ("lr_scheduler", ("name", "total_steps"), SCHEDULERS)):
        if trainer[section] is None:
            continue
        try:
            _, args = _class_arguments(trainer[section], f"trainer.{section}", classes, fixed)
            args = {k: v for k, v in args.items() if k != "name"}
            trainer[section] = {"name": trainer[section]["name"], **args}
        except RecipeError as exc:
            problems += exc.lines
    recipe = Recipe(_ordered(_plain(doc), recipe_schema()), path)  # the sections, frozen once
    if not problems:
        for build in (recipe.optimizer_config, recipe.lr_scheduler, lambda: recipe.options(
                distributed=_smallest_world(trainer["distributed"]))):
            try:
                build()
            except RecipeError as exc:
                problems += exc.lines
    _check_run(doc, problems)
    if not problems:
        problems += check_model_shape(doc)
    if problems:
        raise RecipeError(problems, path)
    return recipe


def _smallest_world(distributed):
    """Validation-time rank keys: world_size 1 means "the number of processes decides" (--nproc), so
    the options are checked on the smallest world the parallel sizes allow (the ranks' own check
    uses the real one)."""
    if distributed.get("world_size", 1) != 1:
        return None
    pipeline = (distributed.get("pipeline_parallel") or {}).get("pipeline_parallel_size", 1)
    size = distributed.get("horizontal_parallel_size", 1) * pipeline * distributed.get("data_parallel_size", 1)
    return {"world_size": size} if size > 1 else None


def _check_run(doc, problems):
    run, data = doc["run"], doc["data"]
    if run["init_from"] and doc["model"]["from"]:
        problems.append(f"run.init_from: got {run['init_from']!r} while model.from is "
                        f"{doc['model']['from']!r}; "
                        "give one: run.init_from continues a run (weights, optimizer, step count), "
                        "model.from only takes weights")
    if isinstance(data["corpus"], list) and not data["corpus"]:
        problems.append("data.corpus: got []; expected 'stdlib', a file, or a non-empty list of files")
    from orttrainer.run.report.measures import run_key_problems  # run.profile_steps

    problems += run_key_problems(run)


def load_recipe(path, overrides=(), output_dir=None):
    """Read the YAML recipe at `path`, apply `--set` overrides, validate; returns a Recipe."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc}") from None
    document = parse_yaml(text, str(path))
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise RecipeError(f"<root>: got {_validation.short_repr(document)}; expected a mapping of sections "
                          "(model, data, trainer, run)", str(path))
    schema = recipe_schema()
    for assignment in overrides:
        apply_override(document, assignment, schema)
    return resolve(document, str(path), output_dir)


def recipe_from_yaml(text, path=None):
    """A Recipe from the YAML text of a resolved recipe (as stored in checkpoints)."""
    return resolve(parse_yaml(text, path or "<stored recipe>"), path)
