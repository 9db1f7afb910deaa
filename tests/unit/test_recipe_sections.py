"""A loaded recipe's typed sections (orttrainer/run/recipe/sections.py): frozen, equal to the validated
doc for every bundled recipe, and the schema's checks still run first."""

import ast
import copy
import dataclasses
import pickle
from pathlib import Path

import pytest

from orttrainer.run.recipe.sections import DataSection, ModelSection, RunSection, thawed
from orttrainer.run.recipe.spec import RecipeError, load_recipe, resolve

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
BUNDLED = sorted(p.name for p in RECIPES.glob("*.yaml"))
TINY = RECIPES / "gpt2-pretrain-tiny.yaml"


@pytest.mark.parametrize("name", BUNDLED)
def test_sections_hold_the_validated_doc(name):
    recipe = load_recipe(RECIPES / name)
    doc = recipe.doc
    for section, cls in (("model", ModelSection), ("data", DataSection), ("run", RunSection)):
        typed = getattr(recipe, section)
        assert type(typed) is cls
        assert thawed(typed) == doc[section]
        assert list(thawed(typed)) == list(doc[section])  # the schema's order
    assert recipe.model.from_ == doc["model"]["from"]
    assert recipe.data.glue.num_train == doc["data"]["glue"]["num_train"]
    assert recipe.run.max_steps == doc["run"]["max_steps"]
    assert recipe.kind == doc["model"]["kind"]
    assert thawed(recipe.trainer) == doc["trainer"]


def test_sections_and_the_recipe_are_read_only():
    recipe = load_recipe(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.run.max_steps = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.data.gpt.text_field = "body"
    with pytest.raises(TypeError):
        recipe.model.config["n_layer"] = 12
    with pytest.raises(TypeError):
        recipe.trainer["optimizer"]["lr"] = 1.0
    with pytest.raises(AttributeError):
        recipe.run = None
    assert isinstance(recipe.run.report_to, tuple)
    recipe.doc["run"]["max_steps"] = 5  # a copy: the recipe keeps its own
    assert recipe.doc["run"]["max_steps"] == recipe.run.max_steps != 5
    for twin in (copy.deepcopy(recipe), pickle.loads(pickle.dumps(recipe))):
        assert twin.doc == recipe.doc and twin.run == recipe.run and twin.path == recipe.path


def test_a_misspelt_field_is_an_attribute_error():
    with pytest.raises(AttributeError):
        load_recipe(TINY).run.max_step  # noqa: B018


def test_the_sections_follow_overrides_and_output_dir(tmp_path):
    recipe = load_recipe(TINY, ["run.max_steps=7", "data.corpus=[a.txt, b.txt]"], tmp_path / "out")
    assert recipe.run.max_steps == 7 and recipe.run.output_dir == str(tmp_path / "out")
    assert recipe.data.corpus == ("a.txt", "b.txt") and recipe.doc["data"]["corpus"] == ["a.txt", "b.txt"]


def test_an_unknown_key_in_a_recipe_file_is_a_recipe_error_at_load(tmp_path):
    text = TINY.read_text(encoding="utf-8").replace("run:\n", "run:\n  max_stesp: 3\n", 1)
    path = tmp_path / "typo.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    assert "run.max_stesp" in str(caught.value)


def test_a_doc_that_disagrees_with_a_section_class_is_refused():
    with pytest.raises(ValueError, match=r"run: .*RunSection.*\['extra'\]"):
        RunSection.of({**load_recipe(TINY).doc["run"], "extra": 1}, "run")
    with pytest.raises(RecipeError):
        resolve({"model": {"kind": "gpt2"}})  # run is required: the schema speaks first


def _chains(tree):
    """Every dotted name `a.b.c` in `tree`, longest form only (`recipe.run.max_steps`, not `recipe.run`)."""
    inner, chains = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                inner.add(id(value))
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and id(node) not in inner:
                chains.append((node.lineno, [value.id, *reversed(parts)]))
    return chains


def test_the_run_layer_names_only_fields_the_sections_have():
    """`recipe.run.max_step` in any module of the package fails here, not when a run reaches that line."""
    recipe = load_recipe(TINY)
    problems = []
    for path in sorted((RECIPES.parent / "orttrainer").rglob("*.py")):
        for line, chain in _chains(ast.parse(path.read_text(encoding="utf-8"))):
            start = next((i for i, (a, b) in enumerate(zip(chain, chain[1:]))
                          if a == "recipe" and b in ("model", "data", "run")), None)
            if start is None:
                continue
            value = recipe
            for name in chain[start + 1:]:
                if not hasattr(value, name):
                    problems.append(f"{path.name}:{line}: {'.'.join(chain)}")
                    break
                value = getattr(value, name)
                if not dataclasses.is_dataclass(value):
                    break  # a field's value: its own methods (`.get`) are not the recipe's
    assert not problems
