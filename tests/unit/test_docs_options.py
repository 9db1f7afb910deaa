"""docs/options.md documents every key of schemas/options.yaml, with its actual default."""

import enum
import re
from pathlib import Path

from orttrainer.orttrainer_options import ORTTrainerOptions, options_schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"
ROW = re.compile(r"^\| `(?P<key>[^`]+)` \| (?P<type>[^|]+) \| (?P<default>[^|]+) \| (?P<meaning>[^|]+) \|")


def schema_keys(schema, prefix=()):
    """(dotted key, rules) of every key, nested dicts included."""
    for name, rules in schema.items():
        path = (*prefix, name)
        yield ".".join(path), rules
        if rules.get("type") == "dict" and "schema" in rules:
            yield from schema_keys(rules["schema"], path)


def doc_rows():
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            rows[match["key"]] = {k: v.strip() for k, v in match.groupdict().items()}
    return rows


def _lookup(tree, dotted_key, get=lambda tree, part: tree[part]):
    for part in dotted_key.split("."):
        tree = get(tree, part)
    return tree


def _as_doc(value):
    if isinstance(value, enum.Enum):
        return f"`{type(value).__name__}.{value.name}`"
    return f"`{value!r}`"


def test_every_schema_key_is_documented():
    rows = doc_rows()
    missing = [key for key, _ in schema_keys(options_schema()) if key not in rows]
    assert not missing, f"keys missing from docs/options.md: {missing}"


def test_documented_keys_exist():
    keys = {key for key, _ in schema_keys(options_schema())}
    stale = [key for key in doc_rows() if key not in keys]
    assert not stale, f"docs/options.md documents keys the schema does not have: {stale}"


def test_documented_defaults_match():
    rows = doc_rows()
    defaults = ORTTrainerOptions()._validated_opts
    for key, rules in schema_keys(options_schema()):
        nested = rules.get("type") == "dict" and "schema" in rules
        if "default" in rules.get("meta", {}):
            # A key added after the legacy schema: absent from the normalized dict, read as its default.
            expected = _as_doc(_lookup(ORTTrainerOptions(), key, getattr))
        else:
            expected = "`{}`" if nested else _as_doc(_lookup(defaults, key))
        assert rows[key]["default"] == expected, key
        assert rows[key]["meaning"], key
