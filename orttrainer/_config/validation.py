"""Shared helpers for cerberus-based validation (options, model_desc, recipes).

The legacy API fixes `str(exc)` of a validation error as `Invalid <what>: {validator.errors}`. That dict
is exact but hard to read, so every error also carries notes (`exc.add_note`): one line per problem,
`dotted.path: got <value>; <what is allowed>`, with a "did you mean" for misspelt keys.
"""

import copy
import difflib
import functools
import reprlib
from collections.abc import Mapping
from importlib.resources import files

import cerberus
import cerberus.errors
import yaml

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 100

# How each cerberus type name reads in an explanation; callers add their custom types.
TYPE_HELP = {
    "boolean": "a bool (True/False)",
    "integer": "an int",
    "float": "a float",
    "number": "a number",
    "string": "a str",
    "dict": "a mapping",
    "list": "a list",
}


@functools.lru_cache(maxsize=None)
def _load_schema_text(name):
    return files("orttrainer.schemas").joinpath(name).read_text(encoding="utf-8")


def load_schema(name):
    """Returns a fresh copy of the schema `name` (a YAML file shipped in orttrainer.schemas)."""
    return yaml.safe_load(_load_schema_text(name))


def copy_plain(value):
    """Copies dicts, lists and tuples recursively; any other object is kept as is (same identity).

    The user's schedulers, loss scalers and SessionOptions must stay the objects they passed, while
    their dicts and lists must never be shared with (and mutated through) what we normalized.
    """
    if isinstance(value, Mapping):
        return {k: copy_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(copy_plain(v) for v in value)
    return value


class SafeErrorHandler(cerberus.errors.BasicErrorHandler):
    """BasicErrorHandler (same output) that never deep-copies the offending values.

    The stock handler deep-copies every error with its value, which fails for objects such as
    `onnxruntime.SessionOptions` put under a wrong key; paths are rewritten on shallow copies instead.
    """

    def add(self, error):
        error = _copy_error(error)
        self._rewrite_error_path(error)
        if error.is_logic_error:
            self._insert_logic_error(error)
        elif error.is_group_error:
            self._insert_group_error(error)
        elif error.code in self.messages:
            self._insert_error(error.document_path, self._format_message(error.field, error))


def _copy_error(error):
    new = copy.copy(error)
    if error.is_group_error:  # logic (*of) errors are group errors too
        children = error.info[0]
        new.info = (type(children)(_copy_error(child) for child in children), *error.info[1:])
    return new


def exotic_key_errors(document):
    """Error tree (cerberus format) for mapping keys that are neither str nor int.

    Cerberus sorts errors by their path and fails with TypeError on keys such as None or 1.5 (YAML
    produces them); no option is named like that, so they are reported as unknown fields up front.
    """
    tree = {}
    for key, value in document.items():
        if not isinstance(key, (str, int)):
            tree[key] = ["unknown field"]
        elif isinstance(value, Mapping):
            sub = exotic_key_errors(value)
            if sub:
                tree[key] = [sub]
    return tree


def did_you_mean(name, candidates):
    """The closest candidate to a misspelt key, or None."""
    if not isinstance(name, str):
        return None
    words = [c for c in candidates if isinstance(c, str)]
    match = difflib.get_close_matches(name, words, n=1, cutoff=0.6)
    if not match:
        lowered = {w.lower(): w for w in words}
        match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        match = [lowered[m] for m in match]
    return match[0] if match else None


def dotted(path):
    """('distributed', 'world_size') -> 'distributed.world_size'; ('outputs', 1) -> 'outputs[1]'."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def short_repr(value):
    """repr() cut to one readable line; objects without a repr of their own show their type."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a broken __repr__ must not hide the validation error
        text = "<"
    if text.startswith("<") and not isinstance(value, str):
        return f"<{type(value).__name__} object>"
    return text


def _fields_at(schema, path):
    """The field -> rules mapping that applies to the dict at `path` of a document, or None."""
    fields = schema
    for part in path:
        rules = fields.get(part) if fields is not None else None
        sub = rules.get("schema") if rules is not None else None
        if not isinstance(sub, Mapping):
            return None  # the path left the schema (unknown key, keysrules/valuesrules, ...)
        fields = _ListItems(sub) if rules.get("type") == "list" else sub
    return fields


class _ListItems(Mapping):
    """Any index of a list maps to the list's item rules."""

    def __init__(self, item_rules):
        self._rules = item_rules

    def __getitem__(self, key):
        if isinstance(key, int):
            return self._rules
        raise KeyError(key)

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0


def _expected(rules, type_help):
    """Plain-words description of what a field accepts, from its rules."""
    if not rules:
        return "a valid value"
    types = rules.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    words = " or ".join(type_help.get(t, TYPE_HELP.get(t, t)) for t in types) or "a value"
    lo, hi = rules.get("min"), rules.get("max")
    if lo is not None and hi is not None:
        words += f" from {lo} to {hi}"
    elif lo is not None:
        words += f" >= {lo}"
    elif hi is not None:
        words += f" <= {hi}"
    if "allowed" in rules:
        words += f", one of {rules['allowed']!r}"
    if rules.get("nullable"):
        words += ", or None"
    return words


def _leaf_errors(errors):
    for error in errors:
        if error.is_group_error:
            yield from _leaf_errors(error.child_errors)
        else:
            yield error


def _explain(error, schema, type_help, handler):
    """(where and what was given, what is allowed) for one leaf cerberus error."""
    path = error.document_path
    where = dotted(path)
    got = f"{where}: got {short_repr(error.value)}"
    siblings = _fields_at(schema, path[:-1])
    rules = siblings.get(path[-1]) if siblings is not None and path else None
    code = error.code
    if code == cerberus.errors.UNKNOWN_FIELD.code:
        known = sorted(k for k in (siblings or {}) if isinstance(k, str))
        hint = did_you_mean(path[-1], known) if path else None
        if hint:
            return got, f"unknown key, did you mean {dotted((*path[:-1], hint))!r}?"
        if known:
            return got, "unknown key; known keys here: " + ", ".join(known)
        return got, "unknown key"
    if code == cerberus.errors.REQUIRED_FIELD.code:
        return f"{where}: missing", "this key is required"
    if code in (
        cerberus.errors.BAD_TYPE.code,
        cerberus.errors.NOT_NULLABLE.code,
        cerberus.errors.MIN_VALUE.code,
        cerberus.errors.MAX_VALUE.code,
    ):
        if rules is None and error.rule == "type":
            rules = {"type": error.constraint}
        return got, f"expected {_expected(rules, type_help)}"
    return got, handler._format_message(error.field, error)


def readable_errors(validator, type_help=None):
    """One line per invalid value found by `validator`: 'dotted.path: got <value>; <what is allowed>'."""
    type_help = {**TYPE_HELP, **(type_help or {})}
    handler = cerberus.errors.BasicErrorHandler()
    explained = {}  # several problems with one value share its line
    for error in _leaf_errors(validator._errors):
        head, what = _explain(error, validator.schema, type_help, handler)
        explained.setdefault(head, []).append(what)
    return [f"{head}; {'; '.join(whats)}" for head, whats in explained.items()]


def validate(validator, document, what, type_help=None):
    """Normalizes `document` with `validator`, or raises ValueError(f"Invalid {what}: {errors}").

    The error's notes explain each problem in words (see `readable_errors`).
    """
    exotic = exotic_key_errors(document)
    if exotic:
        exc = ValueError(f"Invalid {what}: {exotic}")
        for path_tree in _exotic_lines(exotic):
            exc.add_note(path_tree)
        raise exc
    normalized = validator.validated(document)
    if normalized is None:
        exc = ValueError(f"Invalid {what}: {validator.errors}")
        for line in readable_errors(validator, type_help):
            exc.add_note(line)
        raise exc
    return normalized


def _exotic_lines(tree, path=()):
    for key, (entry, *_rest) in tree.items():
        if isinstance(entry, Mapping):
            yield from _exotic_lines(entry, (*path, key))
        else:
            yield f"{dotted((*path, key))}: keys must be strings, got {short_repr(key)}"
