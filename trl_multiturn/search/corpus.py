"""Corpus loading in Search-R1's format: one document per row, ``{"id": ..., "contents": "\\"Title\\"\\ntext"}``.

Sources: a JSONL file (Search-R1's ``wiki-18.jsonl`` layout), a local ``datasets`` dataset (a directory saved with
``save_to_disk``, or a Parquet/JSON/CSV file) or a Hub dataset name, each with the same columns. Rows that carry
``title`` and ``text`` columns (DPR / FlashRAG layout) instead of ``contents`` are accepted too.

Departure from Search-R1: its code keeps the quotes around the title (the first line of ``contents``) and re-splits
``contents`` at every use; here the title is parsed once, without the quotes, into :class:`Document` (by
``parse_contents`` of ``trl_multiturn.search.document``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .document import Document, parse_contents  # re-exported: parse_contents lived here


def document_from_row(row: Mapping[str, Any], index: int = 0) -> Document:
    """Build a :class:`Document` from a corpus row with ``contents`` (or ``title`` + ``text``); ``id`` defaults to
    the row index."""
    doc_id = str(row["id"]) if row.get("id") is not None else str(index)
    if row.get("contents") is not None:
        title, text = parse_contents(str(row["contents"]))
    elif row.get("text") is not None:
        title, text = str(row.get("title") or ""), str(row["text"])
    else:
        raise ValueError(
            f"corpus row {index} has neither 'contents' nor 'text' (keys: {sorted(row)}); "
            'expected Search-R1\'s format {"id": ..., "contents": "\\"Title\\"\\ntext"}.'
        )
    return Document(id=doc_id, title=title, text=text)


def load_corpus_jsonl(path: str | os.PathLike, limit: int | None = None) -> list[Document]:
    """Read a Search-R1 JSONL corpus; ``limit`` keeps the first rows only. Errors name the file and line."""
    docs: list[Document] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(docs) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({e.msg}); each line must be one document.") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno} is a JSON {type(row).__name__}, expected an object per line.")
            docs.append(document_from_row(row, index=len(docs)))
    if not docs:
        raise ValueError(f"the corpus file {path} holds no documents.")
    return docs


def load_corpus_dataset(dataset: Any, limit: int | None = None) -> list[Document]:
    """Convert a ``datasets.Dataset`` (or any iterable of row dicts) with the corpus columns."""
    if hasattr(dataset, "column_names"):
        cols = set(dataset.column_names)
        if "contents" not in cols and "text" not in cols:
            raise ValueError(
                f"the corpus dataset has columns {sorted(cols)}; it needs 'contents' (Search-R1) or 'title'+'text'."
            )
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
    docs = []
    for i, row in enumerate(dataset):
        if limit is not None and i >= limit:
            break
        docs.append(document_from_row(row, index=i))
    if not docs:
        raise ValueError("the corpus dataset holds no documents.")
    return docs


def load_corpus(
    source: Any, *, split: str = "train", name: str | None = None, limit: int | None = None
) -> list[Document]:
    """Load a corpus from a JSONL path, a Parquet/JSON/CSV file, a ``save_to_disk`` directory, a Hub dataset name,
    or an already loaded ``datasets.Dataset`` / list of rows / list of :class:`Document`.

    Args:
        source: where the corpus is (see above).
        split: the split to read from a Hub dataset or a ``DatasetDict``.
        name: the configuration name of a Hub dataset, if it has several.
        limit: keep only the first ``limit`` documents (for quick experiments).
    """
    if isinstance(source, (list, tuple)):
        if source and all(isinstance(d, Document) for d in source):
            return list(source)[:limit] if limit is not None else list(source)
        return load_corpus_dataset(source, limit=limit)
    if not isinstance(source, (str, os.PathLike)):
        if hasattr(source, "keys") and split in source:  # DatasetDict
            source = source[split]
        return load_corpus_dataset(source, limit=limit)

    path = Path(source)
    if path.is_file() and path.name.endswith(".jsonl"):
        return load_corpus_jsonl(path, limit=limit)
    ds = open_dataset(str(source), split=split, name=name)
    return load_corpus_dataset(ds, limit=limit)


def open_dataset(source: str, split: str = "train", name: str | None = None) -> Any:
    """Open one split of a dataset with ``datasets``: a ``save_to_disk`` directory (``load_from_disk``), a
    Parquet/JSON/JSONL/CSV file (the matching builder), or anything else ``datasets.load_dataset`` accepts (a Hub
    name such as ``RUC-NLPIR/FlashRAG_datasets`` with ``name="nq"``, or a local directory of data files)."""
    import datasets

    path = Path(source)
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{source} has splits {sorted(ds)}; no split {split!r}. Pass split= one of them.")
            ds = ds[split]
        return ds
    if path.is_file():
        suffixes = "".join(path.suffixes).lower()
        builder = None
        for ext, builder_name in ((".parquet", "parquet"), (".jsonl", "json"), (".json", "json"), (".csv", "csv")):
            if ext in suffixes:
                builder = builder_name
                break
        if builder is None:
            raise ValueError(f"cannot tell the format of {source}; use a .jsonl, .json, .parquet or .csv file.")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if not path.exists() and source.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"{source} does not exist; give a data file, a dataset directory or a Hub dataset name."
        )
    return datasets.load_dataset(source, name=name, split=split)


def write_corpus_jsonl(docs: Iterable[Document], path: str | os.PathLike) -> Path:
    """Write documents in Search-R1's JSONL format (``id``, ``contents``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d.id, "contents": d.contents}, ensure_ascii=False) + "\n")
    return path
