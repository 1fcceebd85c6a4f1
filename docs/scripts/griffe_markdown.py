"""Griffe extension for the API reference: docstring conventions that are not Markdown become Markdown.

mkdocstrings renders docstrings as Markdown; the package's docstrings follow the conventions ``help()``, IDEs and TRL
use. When the docs are built (mkdocs.yml loads this file), and only then, the source being unchanged:

* Sphinx roles become code spans: ``:class:`~trl_multiturn.trajectory.Trajectory``` -> ```Trajectory``` (``~`` keeps
  the last component of the dotted name, as in Sphinx), ``:func:`a.f``` -> ```a.f```;
* TRL's doc-builder links become code spans: ``[`MultiTurnGRPOTrainer`]`` -> ```MultiTurnGRPOTrainer```;
* a reStructuredText literal-block marker loses its second colon (``tokens only::`` + an indented block ->
  ``tokens only:``; the indented block already is a Markdown code block);
* TRL-style field lines (``name (`type`, defaults to ...): text``, one per line, as in ``MultiTurnGRPOConfig``)
  become list items, which Markdown would otherwise join into one paragraph.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|obj|exc|const):`(~?)([^`]+)`")
DOC_BUILDER_LINK = re.compile(r"\[(`[\w.]+`)\](?![(\[])")
LITERAL_MARKER = re.compile(r"(\S)::\n(\s*\n)+(?=    )")
FIELD_LINE = re.compile(r"^(\w+) \(`[^`]+`[^)]*\): ", re.MULTILINE)


def strip_roles(text: str) -> str:
    """``:class:`~a.b.C``` -> ```C```, ``:func:`a.f``` -> ```a.f```."""

    def code(match: re.Match) -> str:
        tilde, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"

    return ROLE.sub(code, text)


def to_markdown(text: str) -> str:
    """All the rewrites; a field line after a non-field line gets a blank line first, so the list starts there."""
    text = DOC_BUILDER_LINK.sub(r"\1", strip_roles(text))
    text = LITERAL_MARKER.sub(lambda m: m.group(0).replace("::", ":", 1), text)
    lines = text.split("\n")
    out: list[str] = []
    in_list = False
    for line in lines:
        if FIELD_LINE.match(line):
            if not in_list and out and out[-1].strip():
                out.append("")
            out.append(f"- {line}")
            in_list = True
        else:
            in_list = in_list and (line.startswith(" ") and bool(line.strip()))  # an indented continuation
            out.append(line)
    return "\n".join(out)


class DocstringsToMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
