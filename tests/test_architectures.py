"""One architecture table (edgellm/architectures.py) for the loader and the converter, and nothing left over."""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil

import pytest

import convert
import tiny_models
from convert.common import recipe_for
from convert.recipe import Recipe
from edgellm.architectures import ARCHS, HF_ARCHS
from edgellm.errors import UnsupportedModelError

CONVERTED = {arch for arch, spec in ARCHS.items() if spec.hf_archs}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_arch_has_a_model_file(arch):
    assert importlib.util.find_spec(f"edgellm.models.{ARCHS[arch].model}") is not None


@pytest.mark.parametrize("arch", sorted(CONVERTED))
def test_every_converted_arch_has_a_recipe(arch):
    assert isinstance(importlib.import_module(f"convert.{arch}").RECIPE, Recipe)


def test_every_recipe_module_is_in_the_table():
    recipes = {m.name for m in pkgutil.iter_modules(convert.__path__)
               if hasattr(importlib.import_module(f"convert.{m.name}"), "RECIPE")}
    assert recipes == CONVERTED


def test_hf_names_map_to_the_table():
    assert HF_ARCHS["MistralForCausalLM"] == "llama"  # as llama.cpp writes Mistral checkpoints
    assert recipe_for(["Gemma3ForCausalLM"])[0] == "gemma3"
    assert recipe_for(["SomethingElse", "Qwen2ForCausalLM"])[0] == "qwen2"
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        recipe_for(["GPT2LMHeadModel"])


def test_tiny_models_cover_every_converted_arch():
    assert CONVERTED <= set(tiny_models.ARCHS) <= set(ARCHS)
