"""The API reference (docs/api/, rendered by mkdocstrings from the docstrings) covers the public API.

Every name that `trl_multiturn` and `trl_multiturn.search` export gets an anchor on an API page, the Sphinx roles of
the docstrings are rewritten into code spans and TRL-style field lines into lists by docs/scripts/griffe_markdown.py,
and no tag written in a docstring (`<search>`) is swallowed as HTML.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from repo_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _load_extension():
    pytest.importorskip("griffe")
    return load_script("docs/scripts/griffe_markdown.py")


def test_docstring_conventions_become_markdown():
    to_markdown = _load_extension().to_markdown
    assert to_markdown("see :class:`~trl_multiturn.trajectory.Trajectory`.") == "see `Trajectory`."
    assert to_markdown(":func:`trl_multiturn.sft.train_sft` and :data:`GRPO_FIELDS`") == (
        "`trl_multiturn.sft.train_sft` and `GRPO_FIELDS`"
    )
    kept = "plain ``code``, `x` and [a link](page.md) stay"
    assert to_markdown(kept) == kept
    assert to_markdown("Configuration for [`MultiTurnGRPOTrainer`].") == "Configuration for `MultiTurnGRPOTrainer`."
    fields = "> Heading\n\na (`int`, defaults to `4`): one.\nb (`str` or `None`): two,\n    continued.\n\nc, d."
    assert to_markdown(fields) == (
        "> Heading\n\n- a (`int`, defaults to `4`): one.\n- b (`str` or `None`): two,\n    continued.\n\nc, d."
    )
    assert to_markdown("Text.\nx (`int`): after a paragraph.") == "Text.\n\n- x (`int`): after a paragraph."
    assert to_markdown("the loss::\n\n    L = -sum m log p\n") == "the loss:\n\n    L = -sum m log p\n"
    assert to_markdown("a::b and ``x::``") == "a::b and ``x::``"


@pytest.fixture(scope="module")
def api_html(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[dev]' (mkdocstrings[python])")
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    pages = {p.parent.name: p.read_text() for p in (site / "api").glob("*/index.html")}
    assert pages, "the site has no API pages under api/"
    return pages


def _exports(package: str) -> dict[str, str]:
    """name -> dotted path of the module that defines it, from the package's lazy import table."""
    module = __import__(package, fromlist=["_LAZY"])
    return {
        name: target if target.startswith("trl_multiturn") else f"{package}.{target}"
        for name, target in module._LAZY.items()
    }


def test_every_public_name_has_an_api_entry(api_html):
    anchors = set()
    for text in api_html.values():
        anchors |= set(re.findall(r'id="(trl_multiturn[\w.]*)"', text))
    expected = {f"{module}.{name}" for package in ("trl_multiturn", "trl_multiturn.search")
                for name, module in _exports(package).items()}
    # built on first access by the module's __getattr__ (importing trl_multiturn.sft does not import TRL); the
    # page describes it in words
    expected.discard("trl_multiturn.sft.MultiTurnSFTTrainer")
    missing = sorted(expected - anchors)
    assert not missing, f"public names without an entry in docs/api/: {missing}"
    assert "MultiTurnSFTTrainer" in api_html["sft"]
    for module in ("trainer", "config", "environment", "protocols", "rollout", "search.retrievers",
                   "search.rewards", "hub", "sft"):
        assert f"trl_multiturn.{module}" in anchors, f"trl_multiturn.{module} has no API page"


def test_docstrings_render_without_sphinx_roles_or_lost_tags(api_html):
    for page, text in api_html.items():
        body = html.unescape(re.sub(r"<[^>]+>", "", text))
        assert ":class:" not in body and ":func:" not in body, f"api/{page}: a Sphinx role was not rewritten"
        assert not re.search(r"\w::\s*$", body, re.MULTILINE), f"api/{page}: a literal-block '::' was left"
    # TRL-style field lines of MultiTurnGRPOConfig's docstring: one list item each
    assert "<li>max_turns (<code>int</code>, defaults to <code>4</code>)" in api_html["config"]
    # the search environment's docstring quotes Search-R1's prompt; its tags must survive as text
    assert "&lt;search&gt; query &lt;/search&gt;" in api_html["retrievers"]
