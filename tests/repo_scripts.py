"""Load one of the repository's scripts (recipes/, benchmarks/, docs/scripts/) as a module, by its path.

The scripts are not part of the package, so the tests import them from their files. The module is registered in
``sys.modules`` under ``name`` before it runs, because a dataclass looks its module up there while the class is built.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, name: str | None = None):
    """``path`` relative to the repository root (or absolute); ``name`` defaults to the file's stem."""
    path = REPO / path
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_recipe():
    """recipes/search_agent.py, the search agent recipe."""
    return load_script("recipes/search_agent.py", "search_agent_recipe")
