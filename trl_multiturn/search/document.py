"""The document type shared by retrievers and corpora, and the parser of Search-R1's ``contents`` field.

Its own module so that ``corpus`` (which builds documents from rows) and ``retrievers`` (which builds them from a
server's answers) both import it without importing each other. ``Document`` is re-exported by
``trl_multiturn.search.retrievers`` and ``parse_contents`` by ``trl_multiturn.search.corpus``, where they lived.

Departure from Search-R1: its code keeps the quotes around the title (the first line of ``contents``) and re-splits
``contents`` at every use; here the title is parsed once, without the quotes, into :class:`Document`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Document:
    """One retrieved (or corpus) document.

    Attributes:
        id: the corpus id (a string; numeric ids are converted).
        title: the title, without Search-R1's surrounding quotes.
        text: the body text.
        score: the retrieval score (higher is better); 0.0 for corpus entries.
    """

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        """The document in Search-R1's corpus format: ``"Title"`` on the first line, the text after it."""
        return f'"{self.title}"\n{self.text}'


def parse_contents(contents: str) -> tuple[str, str]:
    """Split Search-R1's ``contents`` into ``(title, text)``.

    The first line is the title, usually wrapped in double quotes (removed here); the rest is the text. A string
    without a newline is all text with an empty title.
    """
    if "\n" not in contents:
        return "", contents.strip()
    title, text = contents.split("\n", 1)
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text.strip()
