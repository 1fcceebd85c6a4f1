"""A second generated knowledge base for transfer tests: musicians, bands, record labels, towns and regions.

An agent trained on the offline default (:func:`trl_multiturn.search.build_offline_dataset`: people, cities,
companies, countries) never saw these entity types, these relations or this question wording. An agent that learned
to search (ask for what the question needs, read the documents, search again with the bridge entity) should still
answer; one that learned the default's templates should not. Like the default, every name is invented from
syllables, the train and test worlds are disjoint, 1-hop and 2-hop questions carry their gold document ids and
bridge entity, and documents hold distractors (a town a musician moved to, a label a band left).

    from trl_multiturn.search.music import build_music_dataset
    data = build_music_dataset(num_entities=600, seed=0)   # corpus, train_rows, test_rows

The recipes take it as ``--dataset offline-music``.
"""

from __future__ import annotations

import functools
import random

from .data import (
    OfflineDataset,
    QuestionType,
    Relation,
    _a,
    _add_doc,
    _Entity,
    _full_names,
    _NameMaker,
    build_generated_dataset,
)
from .retrievers import Document

_TOWN_SUFFIXES = "by thorpe ley combe wold ness field bridge".split()
_REGION_SUFFIXES = "shire mark reach dale coast".split()
_LABEL_KINDS = "Records Recordings Sound Music Tapes Discs".split()
_GENRES = "folk jazz brass-band punk choral synth bluegrass chamber reggae surf".split()
_INSTRUMENTS = "cello drums banjo trumpet harp accordion bass guitar flute organ oboe".split()

MUSIC_RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation("band_of", "musician", "band",
                 ("Which band does {s} play in?", "Name the band that {s} is a member of."),
                 "the band {s} plays in", "{s} plays in {o}",
                 ("{s} band", "Which band does {s} play in?", "{s} member of", "{s} musician")),
        Relation("label_of", "band", "label",
                 ("Which record label is {s} signed to?", "Name the label that releases the records of {s}."),
                 "the label {s} is signed to", "{s} is signed to {o}",
                 ("{s} record label", "Which label is {s} signed to?", "{s} signed to", "{s} label")),
        Relation("label_town", "label", "town",
                 ("In which town does {s} have its studio?", "Name the town where {s} is based."),
                 "the town {s} is based in", "{s} is based in {o}",
                 ("{s} studio town", "Where is {s} based?", "{s} based in", "{s} town")),
        Relation("town_region", "town", "region",
                 ("Which region is the town of {s} part of?", "Name the region that {s} belongs to."),
                 "the region {s} belongs to", "{s} is a town in {o}",
                 ("{s} region", "Which region is {s} in?", "{s} town region", "region of {s}")),
    )
}

MUSIC_QUESTION_TYPES: dict[str, QuestionType] = {
    q.name: q
    for q in (
        *(QuestionType(r.name, (r.name,), r.question) for r in MUSIC_RELATIONS.values()),
        QuestionType("musician_label", ("band_of", "label_of"),
                     ("Which record label is the band of {s} signed to?",
                      "Name the label that releases the records of the band {s} plays in.")),
        QuestionType("band_town", ("label_of", "label_town"),
                     ("In which town is the record label of {s} based?",
                      "Name the town where the label that {s} is signed to has its studio.")),
        QuestionType("label_region", ("label_town", "town_region"),
                     ("Which region is the studio of {s} in?", "Name the region where {s} has its studio.")),
    )
}
"""The question types by name: one per relation (1 hop) and three 2-hop chains."""


def _build_music_world(
    rng: random.Random, names: _NameMaker, prefix: str, num_musicians: int
) -> tuple[list[_Entity], dict[str, list[_Entity]], list[Document]]:
    """One world: ``num_musicians`` musicians, a band per 3 of them, a label per 3 bands (at least 3), a town per
    2 labels and bands together (at least 4), a region per 4 towns (at least 2); its documents."""
    n_bands = max(4, num_musicians // 3)
    n_labels = max(3, n_bands // 3)
    n_towns = max(4, (n_bands + n_labels) // 2)
    n_regions = max(2, n_towns // 4)
    regions = [_Entity("region", names.word(2, rng.choice(_REGION_SUFFIXES), answer=True)) for _ in range(n_regions)]
    towns = [_Entity("town", names.word(2, rng.choice(_TOWN_SUFFIXES), answer=True)) for _ in range(n_towns)]
    for i, t in enumerate(towns):  # every region gets a town first
        t.facts["town_region"] = regions[i] if i < n_regions else rng.choice(regions)
        t.facts["festival_month"] = rng.choice("March May June July August September".split())
    labels = []
    for _ in range(n_labels):
        label = _Entity("label", f"{names.word(2, answer=True)} {rng.choice(_LABEL_KINDS)}")
        label.facts["label_town"] = rng.choice(towns)
        label.facts["shop_town"] = rng.choice([t for t in towns if t is not label.facts["label_town"]])
        label.facts["founded"] = rng.randrange(1950, 2015)
        labels.append(label)
    bands = []
    for _ in range(n_bands):
        band = _Entity("band", f"The {names.word(2, answer=True)}s")
        band.facts["label_of"] = rng.choice(labels)
        band.facts["former_label"] = rng.choice([lb for lb in labels if lb is not band.facts["label_of"]])
        # the home town is never the label's town: the band's document must not answer "where is its label based"
        band.facts["home_town"] = rng.choice([t for t in towns if t is not band.facts["label_of"].facts["label_town"]])
        band.facts["genre"] = rng.choice(_GENRES)
        bands.append(band)
    musicians = []
    for full in _full_names(rng, names, num_musicians, (2, 3)):
        m = _Entity("musician", full)
        m.facts["band_of"] = rng.choice(bands)
        m.facts["instrument"] = rng.choice(_INSTRUMENTS)
        m.facts["moved_to"] = rng.choice(towns)
        musicians.append(m)

    docs: list[Document] = []
    add_doc = functools.partial(_add_doc, docs, prefix)
    for m in musicians:
        f = m.facts
        add_doc(m, "musician", m.name,
                f"{m.name} plays the {f['instrument']} in {f['band_of'].name}. {m.name.split()[1]} lives in "
                f"{f['moved_to'].name} and has toured with {f['band_of'].name} since "
                f"{rng.randrange(1980, 2020)}.", ("band_of",))
    for b in bands:
        f = b.facts
        members = [m.name for m in musicians if m.facts["band_of"] is b][:2]
        members_text = f" Its members include {' and '.join(members)}." if members else ""
        add_doc(b, "band", b.name,
                f"{b.name} are {_a(f['genre'])} group from {f['home_town'].name}, signed to the record label "
                f"{f['label_of'].name}. "
                f"They left {f['former_label'].name} after their first album.{members_text}", ("label_of",))
    for lb in labels:
        f = lb.facts
        add_doc(lb, "label", lb.name,
                f"{lb.name} is a record label founded in {f['founded']}, based in {f['label_town'].name}, with a "
                f"record shop in {f['shop_town'].name}.", ("label_town",))
    for t in towns:
        f = t.facts
        add_doc(t, "town", t.name,
                f"{t.name} is a town in {f['town_region'].name}. Its music festival is held every "
                f"{f['festival_month']}.", ("town_region",))
    kinds = {"musician": musicians, "band": bands, "label": labels, "town": towns, "region": regions}
    return musicians, kinds, docs


def build_music_dataset(num_entities: int = 500, seed: int = 0, *, test_fraction: float = 0.2,
                        question_types=None) -> OfflineDataset:
    """The music knowledge base: ``num_entities`` musicians over both splits (see :func:`_build_music_world` for
    the other kinds); question types from ``MUSIC_QUESTION_TYPES`` (default: all). Everything is a function of
    ``seed``."""
    return build_generated_dataset(_build_music_world, MUSIC_QUESTION_TYPES, MUSIC_RELATIONS, num_entities, seed,
                                   test_fraction=test_fraction, question_types=question_types)
