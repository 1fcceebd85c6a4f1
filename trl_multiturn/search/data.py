"""Question-answering data: FlashRAG-format datasets, and a generated offline knowledge base that requires search.

Two sources:

* :func:`load_qa_dataset` -- QA rows in the FlashRAG format Search-R1 trains on (``question``, ``golden_answers``)
  from the Hub by name (e.g. ``RUC-NLPIR/FlashRAG_datasets`` with ``name="nq"``) or from local JSONL / Parquet;
  a string answer becomes a one-element list.
* :func:`build_offline_dataset` -- the offline default: a world of FICTIONAL people, cities, countries and
  companies whose names are built from syllables, so no model can know the answers without searching. It comes
  with its corpus (Search-R1 format, several documents per entity, several facts per document, similar names) and
  with single-hop and two-hop questions. Two disjoint worlds are generated, one per split, so no entity (subject,
  bridge or answer) of a test question appears in any training question. Everything is a function of the seed.

Departure from Search-R1: it trains on NQ + HotpotQA over a Wikipedia dump, which a pretrained model partly
memorised; the fictional knowledge base makes search necessary and gives every question its gold evidence (the
document ids of each hop and the bridge entity), which the expert policy (``trl_multiturn.search.expert``) uses.
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .corpus import open_dataset, write_corpus_jsonl
from .retrievers import Document

# ---------------------------------------------------------------------------------------------------------------
# FlashRAG-format QA data
# ---------------------------------------------------------------------------------------------------------------


def _as_answer_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and "text" in value:  # SQuAD-style {"text": [...], "answer_start": [...]}
        return _as_answer_list(value["text"])
    return [str(v) for v in value]


def normalize_qa_row(row: dict[str, Any], answer_column: str = "golden_answers") -> dict[str, Any]:
    """Return the row with ``question`` stripped and ``golden_answers`` as a list of strings (taken from
    ``answer_column``); other columns are kept."""
    out = dict(row)
    out["question"] = str(row["question"]).strip()
    out["golden_answers"] = _as_answer_list(row.get(answer_column))
    return out


def load_qa_dataset(
    source: Any,
    *,
    split: str = "train",
    name: str | None = None,
    answer_column: str = "golden_answers",
    limit: int | None = None,
    seed: int | None = None,
):
    """Load QA rows in FlashRAG format as a ``datasets.Dataset`` with ``question`` and ``golden_answers``
    (a list of strings).

    Args:
        source: a Hub dataset name (``datasets.load_dataset``), a ``.jsonl``/``.json``/``.parquet``/``.csv`` file,
            a directory of data files, a ``save_to_disk`` directory, a ``datasets.Dataset``, or a list of dicts.
        split: the split to read (Hub datasets, ``DatasetDict`` directories).
        name: the configuration of a Hub dataset (FlashRAG: ``"nq"``, ``"hotpotqa"``, ...).
        answer_column: the column with the gold answers when it is not ``golden_answers`` (e.g. ``"answer"``);
            strings become one-element lists.
        limit: keep the first ``limit`` rows (after shuffling when ``seed`` is given).
        seed: shuffle with this seed before ``limit``.
    """
    import datasets

    if isinstance(source, list):  # normalized first: Arrow cannot hold a column mixing strings and lists
        missing = [i for i, row in enumerate(source) if "question" not in row or answer_column not in row]
        if missing:
            raise ValueError(
                f"QA row {missing[0]} lacks 'question' or the answer column {answer_column!r} "
                f"(keys: {sorted(source[missing[0]])}); pass answer_column= the column holding the gold answers."
            )
        source = [normalize_qa_row(row, answer_column) for row in source]
        answer_column = "golden_answers"
        ds = datasets.Dataset.from_list(source)
    elif isinstance(source, (str, os.PathLike)):
        ds = open_dataset(str(source), split=split, name=name)
    elif isinstance(source, datasets.DatasetDict):
        ds = source[split]
    else:
        ds = source
    cols = set(ds.column_names)
    if "question" not in cols:
        raise ValueError(f"the QA dataset has columns {sorted(cols)}; it needs a 'question' column (FlashRAG format).")
    if answer_column not in cols:
        raise ValueError(
            f"the QA dataset has no answer column {answer_column!r} (columns: {sorted(cols)}); pass "
            "answer_column= the column holding the gold answers."
        )
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    ds = ds.map(lambda row: normalize_qa_row(row, answer_column), desc=None)
    if answer_column != "golden_answers" and answer_column in ds.column_names:
        ds = ds.remove_columns(answer_column)
    return ds


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write rows (dicts) as JSON lines; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------
# The fictional knowledge base
# ---------------------------------------------------------------------------------------------------------------
_ONSETS = "b d f g h k l m n p r s t v z br dr gr kr st tr th sk qu j".split()
_VOWELS = "a e i o u a e o ai ou".split()  # plain vowels twice as likely as diphthongs
_CODAS = ["", "", "", ""] + "n r l s k m v x".split()  # open syllables as likely as closed ones
_CITY_SUFFIXES = "port holm vale grad mere stead ford wick burg haven moor gate".split()
_COUNTRY_SUFFIXES = "ia land ar istan ovia enne".split()
_COMPANY_KINDS = (
    "Systems Industries Foods Mining Textiles Labs Shipping Motors Optics Publishing Ceramics Robotics".split()
)
_PRODUCTS = (
    "glass lenses, river barges, wool cloth, tin cans, clock parts, paper maps, copper wire, salt crackers, "
    "bicycle frames, ceramic tiles, weather balloons, printing ink"
).split(", ")
_PROFESSIONS = (
    "surveyor glassblower cartographer botanist engineer violinist archivist chemist architect linguist beekeeper "
    "clockmaker geologist translator"
).split()


@dataclass(frozen=True)
class Relation:
    """One fact type of the knowledge base, with the words the questions and the expert use for it.

    ``question`` templates take the subject ``{s}``; ``need`` names what is sought about ``{s}``; ``found`` states
    the fact (``{s}`` -> ``{o}``); ``queries`` are search queries about ``{s}`` (the expert draws one).
    """

    name: str
    subject_kind: str
    object_kind: str
    question: tuple[str, ...]
    need: str
    found: str
    queries: tuple[str, ...]


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation(
            "birth_city",
            "person",
            "city",
            ("In which city was {s} born?", "Where was {s} born?"),
            "the city where {s} was born",
            "{s} was born in {o}",
            ("{s} born", "Where was {s} born?", "{s} birthplace", "In which city was {s} born?"),
        ),
        Relation(
            "employer",
            "person",
            "company",
            ("Which company does {s} work for?", "Who employs {s}?"),
            "the company {s} works for",
            "{s} works for {o}",
            ("{s} works for", "{s} employer", "Which company does {s} work for?", "{s} company"),
        ),
        Relation(
            "city_country",
            "city",
            "country",
            ("In which country is the city of {s}?", "Which country is {s} in?"),
            "the country {s} is in",
            "{s} is a city in {o}",
            ("{s} country", "Which country is {s} in?", "{s} city country", "country of {s}"),
        ),
        Relation(
            "company_hq",
            "company",
            "city",
            ("In which city is {s} headquartered?", "Where is {s} headquartered?"),
            "where {s} is headquartered",
            "{s} is headquartered in {o}",
            ("{s} headquarters", "Where is {s} headquartered?", "{s} headquartered in", "{s} head office city"),
        ),
        Relation(
            "capital",
            "country",
            "city",
            ("What is the capital of {s}?", "Which city is the capital of {s}?"),
            "the capital of {s}",
            "the capital of {s} is {o}",
            ("capital of {s}", "{s} capital", "What is the capital of {s}?"),
        ),
    )
}


@dataclass(frozen=True)
class QuestionType:
    """A question type: one relation (1 hop) or a chain of two (2 hops, the object of the first is the bridge)."""

    name: str
    chain: tuple[str, ...]
    question: tuple[str, ...]


QUESTION_TYPES: dict[str, QuestionType] = {
    q.name: q
    for q in (
        *(QuestionType(r.name, (r.name,), r.question) for r in RELATIONS.values()),
        QuestionType(
            "birth_country",
            ("birth_city", "city_country"),
            ("In which country is the city where {s} was born?", "{s} was born in a city of which country?"),
        ),
        QuestionType(
            "employer_hq",
            ("employer", "company_hq"),
            (
                "In which city is the company that {s} works for headquartered?",
                "Where is the headquarters of the company {s} works for?",
            ),
        ),
        QuestionType(
            "company_country",
            ("company_hq", "city_country"),
            ("In which country is {s} headquartered?", "{s} has its headquarters in which country?"),
        ),
    )
}
"""The question types of the offline data set by name: one per relation (1 hop) and three 2-hop chains."""


@dataclass
class _Entity:
    kind: str
    name: str
    doc_ids: dict[str, str] = field(default_factory=dict)  # relation name -> id of the document stating it
    facts: dict[str, Any] = field(default_factory=dict)  # relation/attribute name -> value (entity or str)


class _NameMaker:
    """Invents unique names from syllables. No answer-bearing word is a substring of another word, so that
    normalized substring tests (retrieval hit, substring match) cannot fire on a different entity."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.words: set[str] = set()
        self.answer_words: list[str] = []

    def _syllable(self) -> str:
        r = self.rng
        return r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS)

    def _clashes(self, w: str, answer: bool) -> bool:
        lw = w.lower()
        if lw in self.words or len(lw) < 4:
            return True
        if answer and any(lw in o for o in self.words):
            return True
        return any(a in lw for a in self.answer_words)

    def word(self, syllables: int = 2, suffix: str = "", answer: bool = False) -> str:
        for _ in range(10_000):
            w = ("".join(self._syllable() for _ in range(syllables)) + suffix).capitalize()
            if not self._clashes(w, answer):
                self.words.add(w.lower())
                if answer:
                    self.answer_words.append(w.lower())
                return w
        raise RuntimeError("could not invent a new unique name after 10,000 draws; lower num_entities.")


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _add_doc(docs: list[Document], prefix: str, entity: _Entity, suffix: str, title: str, text: str,
             relations: tuple[str, ...]) -> None:
    """Append a document about ``entity`` stating ``relations`` (its id is provisional: the dataset renumbers)."""
    doc_id = f"{prefix}-{len(docs)}-{suffix}"
    docs.append(Document(id=doc_id, title=title, text=text))
    for r in relations:
        entity.doc_ids[r] = doc_id


def _full_names(rng: random.Random, names: _NameMaker, n: int, family_syllables: tuple[int, ...]) -> Iterator[str]:
    """``n`` unique "given family" names, drawn lazily (the caller's own draws interleave as they always did). Given
    and family names are shared between people (namesakes are distractors); full names are unique."""
    givens = [names.word(2) for _ in range(max(3, n // 3))]
    families = [names.word(rng.choice(family_syllables)) for _ in range(max(3, n // 3))]
    used: set[str] = set()
    while len(used) < n:
        full = f"{rng.choice(givens)} {rng.choice(families)}"
        if full not in used:
            used.add(full)
            yield full


def _build_world(
    rng: random.Random, names: _NameMaker, prefix: str, num_people: int
) -> tuple[list[_Entity], dict[str, list[_Entity]], list[Document]]:
    """One self-contained world: its entities by kind and its documents (ids prefixed with ``prefix``)."""
    n_cities = max(4, num_people // 4)
    n_companies = max(4, num_people // 4)
    n_countries = max(2, n_cities // 4)

    countries = [
        _Entity("country", names.word(2, rng.choice(_COUNTRY_SUFFIXES), answer=True)) for _ in range(n_countries)
    ]
    cities = [_Entity("city", names.word(2, rng.choice(_CITY_SUFFIXES), answer=True)) for _ in range(n_cities)]
    for i, c in enumerate(cities):  # every country gets a city first, so every country has a capital
        c.facts["city_country"] = countries[i] if i < n_countries else rng.choice(countries)
        c.facts["population"] = rng.randrange(20, 900) * 1000
        c.facts["river"] = names.word(2)
        c.facts["twin"] = None
    for c in cities:
        c.facts["twin"] = rng.choice([o for o in cities if o is not c])
    for n in countries:
        own = [c for c in cities if c.facts["city_country"] is n]
        n.facts["capital"] = rng.choice(own)
        n.facts["cities"] = own
        n.facts["neighbour"] = rng.choice([o for o in countries if o is not n])
    companies = []
    for _ in range(n_companies):
        k = _Entity("company", f"{names.word(2, answer=True)} {rng.choice(_COMPANY_KINDS)}")
        k.facts["company_hq"] = rng.choice(cities)
        k.facts["office"] = rng.choice([c for c in cities if c is not k.facts["company_hq"]])
        k.facts["founded"] = rng.randrange(1850, 1990)
        k.facts["product"] = rng.choice(_PRODUCTS)
        companies.append(k)

    people = []
    for full in _full_names(rng, names, num_people, (2, 2, 3)):
        p = _Entity("person", full)
        p.facts["birth_city"] = rng.choice(cities)
        p.facts["employer"] = rng.choice(companies)
        # the city a person moved to (named in both documents) is neither an answer about them nor a 2-hop shortcut
        p.facts["moved_to"] = rng.choice(
            [c for c in cities if c is not p.facts["birth_city"] and c is not p.facts["employer"].facts["company_hq"]]
        )
        p.facts["previous_employer"] = rng.choice([k for k in companies if k is not p.facts["employer"]])
        p.facts["profession"] = rng.choice(_PROFESSIONS)
        p.facts["birth_year"] = rng.randrange(1900, 2000)
        people.append(p)
    by_family: dict[str, list[_Entity]] = {}
    for p in people:
        by_family.setdefault(p.name.split()[1], []).append(p)

    docs: list[Document] = []
    add_doc = functools.partial(_add_doc, docs, prefix)

    for p in people:
        f, family = p.facts, p.name.split()[1]
        siblings = [o for o in by_family[family] if o is not p]
        sibling = (
            f" {p.name} has a relative, {siblings[0].name}, who is {_a(siblings[0].facts['profession'])}."
            if siblings
            else ""
        )
        add_doc(
            p,
            "bio",
            p.name,
            f"{p.name} (born {f['birth_year']}) is {_a(f['profession'])} who was born in {f['birth_city'].name}. "
            f"{family} grew up in {f['birth_city'].name} and later moved to {f['moved_to'].name}.{sibling}",
            ("birth_city",),
        )
        add_doc(
            p,
            "career",
            f"{p.name} (career)",
            f"{p.name} works for {f['employer'].name} as {_a(f['profession'])}. Before that, {family} worked for "
            f"{f['previous_employer'].name} in {f['moved_to'].name}.",
            ("employer",),
        )
    for c in cities:
        f = c.facts
        add_doc(
            c,
            "city",
            c.name,
            f"{c.name} is a city in the country of {f['city_country'].name}. {c.name} lies on the {f['river']} "
            f"river and has about {f['population']:,} inhabitants. It is twinned with {f['twin'].name}, a city in "
            f"{f['twin'].facts['city_country'].name}.",
            ("city_country",),
        )
    for k in companies:
        f = k.facts
        staff = [p.name for p in people if p.facts["employer"] is k][:2]
        staff_text = f" Its staff include {' and '.join(staff)}." if staff else ""
        add_doc(
            k,
            "company",
            k.name,
            f"{k.name} is a company headquartered in the city of {f['company_hq'].name}. {k.name} was founded in "
            f"{f['founded']} and makes {f['product']}. It also has an office in {f['office'].name}.{staff_text}",
            ("company_hq",),
        )
    for n in countries:
        f = n.facts
        others = [c.name for c in f["cities"] if c is not f["capital"]][:3]
        other_text = f" Other cities of {n.name} include {', '.join(others)}." if others else ""
        add_doc(
            n,
            "country",
            n.name,
            f"{n.name} is a country whose capital is {f['capital'].name}.{other_text} {n.name} borders "
            f"{f['neighbour'].name}.",
            ("capital",),
        )
    kinds = {"person": people, "city": cities, "country": countries, "company": companies}
    return people, kinds, docs


def _questions(
    rng: random.Random,
    kinds: dict[str, list[_Entity]],
    split: str,
    question_types: Iterable[str],
    types: dict[str, QuestionType] | None = None,
    relations: dict[str, Relation] | None = None,
) -> list[dict[str, Any]]:
    types, relations = types or QUESTION_TYPES, relations or RELATIONS
    rows: list[dict[str, Any]] = []
    for qt_name in question_types:
        qt = types[qt_name]
        first = relations[qt.chain[0]]
        for subject in kinds[first.subject_kind]:
            entity, doc_ids, bridge = subject, [], None
            for hop, rel_name in enumerate(qt.chain):
                doc_ids.append(entity.doc_ids[rel_name])
                entity = entity.facts[rel_name]
                if hop == 0 and len(qt.chain) > 1:
                    bridge = entity.name
            rows.append(
                {
                    "question": rng.choice(qt.question).format(s=subject.name),
                    "golden_answers": [entity.name],
                    "hops": len(qt.chain),
                    "qtype": qt.name,
                    "subject": subject.name,
                    "bridge": bridge,
                    "gold_doc_ids": doc_ids,
                }
            )
    rng.shuffle(rows)
    for i, row in enumerate(rows):
        row["id"] = f"{split}-{i:05d}"
    return [{"id": r["id"], **{k: v for k, v in r.items() if k != "id"}} for r in rows]


@dataclass
class OfflineDataset:
    """The generated knowledge base: ``corpus`` (documents of both worlds), ``train_rows`` / ``test_rows`` (question
    dicts), and ``train`` / ``test`` as ``datasets.Dataset`` (built on first access).

    Each question row: ``id``, ``question``, ``golden_answers`` (one-element list), ``hops`` (1 or 2), ``qtype``,
    ``subject`` (the entity asked about), ``bridge`` (the intermediate entity of a 2-hop question, else None),
    ``gold_doc_ids`` (the document holding the fact of each hop, in order).
    """

    corpus: list[Document]
    train_rows: list[dict[str, Any]]
    test_rows: list[dict[str, Any]]
    seed: int
    num_entities: int
    entity_names: dict[str, set[str]] = field(default_factory=dict)  # split -> every entity name of its world
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def _dataset(self, split: str):
        if split not in self._cache:
            import datasets

            self._cache[split] = datasets.Dataset.from_list(self.train_rows if split == "train" else self.test_rows)
        return self._cache[split]

    @property
    def train(self):
        return self._dataset("train")

    @property
    def test(self):
        return self._dataset("test")

    def write(self, out_dir: str | os.PathLike) -> dict[str, Path]:
        """Write ``corpus.jsonl`` (Search-R1 format), ``train.jsonl`` and ``test.jsonl`` into ``out_dir``."""
        return write_offline_dataset(self, out_dir)


def build_offline_dataset(
    num_entities: int = 500,
    seed: int = 0,
    *,
    test_fraction: float = 0.2,
    question_types: Iterable[str] | None = None,
) -> OfflineDataset:
    """Generate the fictional knowledge base, its corpus and its train/test questions.

    Args:
        num_entities: the number of people over both splits; each world also has one city and one company per 4
            people and one country per 4 cities (at least 4, 4 and 2). 500 gives ~1,300 documents, ~1,900 training
            and ~500 test questions.
        seed: everything (names, facts, wording, order) is a function of it.
        test_fraction: the share of people (and so of every kind of entity) in the test world.
        question_types: names from ``QUESTION_TYPES`` (default: all; 1-hop: birth_city, employer, city_country,
            company_hq, capital; 2-hop: birth_country, employer_hq, company_country).
    """
    return build_generated_dataset(_build_world, QUESTION_TYPES, RELATIONS, num_entities, seed,
                                   test_fraction=test_fraction, question_types=question_types)


def build_generated_dataset(
    build_world: Callable[[random.Random, _NameMaker, str, int], tuple[Any, dict[str, list[_Entity]], list[Document]]],
    types: dict[str, QuestionType],
    relations: dict[str, Relation],
    num_entities: int,
    seed: int,
    *,
    test_fraction: float = 0.2,
    question_types: Iterable[str] | None = None,
) -> OfflineDataset:
    """Two disjoint worlds (train and test) from ``build_world``, their questions of ``types`` (default: all), and
    one shuffled corpus with renumbered document ids. :func:`build_offline_dataset` is this with the people world;
    ``trl_multiturn.search.music`` builds another knowledge base with it."""
    if num_entities < 10:
        raise ValueError(f"num_entities must be at least 10 (5 per split at the smallest), got {num_entities}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}.")
    qtypes = list(question_types) if question_types is not None else list(types)
    unknown = [q for q in qtypes if q not in types]
    if unknown:
        raise ValueError(f"unknown question_types {unknown}; choose from {sorted(types)}.")
    n_test = max(5, round(num_entities * test_fraction))
    n_train = num_entities - n_test
    if n_train < 5:
        raise ValueError(f"test_fraction={test_fraction} leaves {n_train} training people; lower it.")

    rng = random.Random(seed)
    names = _NameMaker(rng)
    corpus: list[Document] = []
    rows: dict[str, list[dict[str, Any]]] = {}
    entity_names: dict[str, set[str]] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        _, kinds, docs = build_world(rng, names, split, n)
        corpus.extend(docs)
        rows[split] = _questions(rng, kinds, split, qtypes, types, relations)
        entity_names[split] = {e.name for group in kinds.values() for e in group}
    # Interleave the worlds and renumber the documents, so neither position nor id tells a document's split.
    order = list(range(len(corpus)))
    rng.shuffle(order)
    new_ids = {corpus[i].id: f"kb-{j:05d}" for j, i in enumerate(order)}
    corpus = [Document(id=new_ids[corpus[i].id], title=corpus[i].title, text=corpus[i].text) for i in order]
    for row in rows["train"] + rows["test"]:
        row["gold_doc_ids"] = [new_ids[d] for d in row["gold_doc_ids"]]
    return OfflineDataset(corpus, rows["train"], rows["test"], seed, num_entities, entity_names)


def write_offline_dataset(data: OfflineDataset, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``corpus.jsonl``, ``train.jsonl`` and ``test.jsonl`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    return {
        "corpus": write_corpus_jsonl(data.corpus, out / "corpus.jsonl"),
        "train": write_jsonl(data.train_rows, out / "train.jsonl"),
        "test": write_jsonl(data.test_rows, out / "test.jsonl"),
    }
