"""Street addresses, and the postal codes in them, found by pattern (US, Canadian, British and
continental European forms): `address` (`1600 Pennsylvania Avenue NW, Washington, DC 20500`,
`221B Baker Street, London NW1 6XE`, `290 Bremner Blvd, Toronto, ON M5V 3L9`, `Springfield, IL
62704`, `Flat 8, Jane Ramp, Shawtown, LU74 8GA`; `Musterstraße 12, 10115 Berlin`, `12 rue de la
Paix, 75002 Paris`, `Damrak 1, 1012 LG Amsterdam`, `Via Roma 1, 00184 Roma`, `Calle Mayor 5,
28013 Madrid`, `Rua Augusta, 1500, 01304-001 São Paulo`) and `postal_code` (a code that a state
or province, a postcode area or the words `ZIP code` / `postcode` put in an address context:
`IL 62704`, `NW1 6XE`, `zip code is 02134`). A bare number is no ZIP code; a continental
postal code is part of an address only after a street (one without a street word, `Damrak 1`,
only with a code no year can be, 5 digits or `1012 LG`, and a city that is no ordinary English
word: `Windows 10, 20000 Users` is none), never alone (`80000 Mitarbeiter`), but for a Dutch
one with its city (`1012 LG Amsterdam`).

Why hand-written rather than a library: the one well-kept library that *finds* addresses in
free text, `pyap2` (MIT, the maintained fork of `pyap`), matches with Python's backtracking
`re`: measured on 2 busy cores, 140 us per character of `1 1 1 ...` (1.4 s for 10,000
characters, 2.8 s for 20,000, US rules), quadratic on a run of digits with its British rules
(1.2 s for 10,000, 4.8 s for 20,000), and 17 us per character of plain prose with its British rules (17 ms per
1,000 characters, more than the model); its offsets are those of a copy of the text with
spaces and commas collapsed. `usaddress` and libpostal parse a string that *is* an address
(they find none in prose), `commonregex` (2014) is a lookahead regex for US streets. So
these are RE2 patterns (linear time, like `regex`'s kinds), with pyap's shape: a house number,
capitalised street-name words and a street type, then optionally a unit, a city, a state or
province and a postal code.

Streaming (continental addresses: a window holds one of up to SEAM_CHARS, 64 characters, whole;
the parts of a longer one are not all found alone, so one cut there may release its code and
city): every match is self-sufficient (nothing before its first character decides it but
the character before it, inside its own whitespace-free run, which a stream's window holds),
lies within a piece between natural cuts (`pii_ner` judges each piece alone: a `St. ` or a
line break ends a piece, and the part after it is judged on its own), and the parts that a
window of a stream may start at (a city and its state and code, a state and its ZIP code, a
British postcode) are found on their own too, so an address that a seam window cuts is still
covered whole. No open tail: a cut street name is a prefix of any capitalised words."""

from __future__ import annotations

import re

import re2

from .person_names import ordinary_words
from .re2_scan import CONFIG_MAX_MEM, WORD_CHARS, Utf8Text, body_spans, bounded_pattern, re2_options

Span = tuple[int, int, str]

# US states, DC, territories and military "states"; Canadian provinces and territories
_US = (
    "AL AK AZ AR CA CO CT DE FL GA HI ID IL IN IA KS KY LA ME MD MA MI MN MS MO MT NE NV NH NJ "
    "NM NY NC ND OH OK OR PA RI SC SD TN TX UT VT VA WA WV WI WY DC PR GU VI AS MP AA AE AP"
).split()
_CA = "AB BC MB NB NL NS NT NU ON PE QC SK YT".split()
# codes that are also everyday words or abbreviations (`user ID 12345`, `OK 200`): a state
# only after a city (`Boise, ID 83702`), never alone before a number
_AMBIGUOUS = {"AS", "ID", "IN", "ME", "OK", "OR", "HI", "AA", "AE", "AP", "MP", "GU", "VI"}
_STATE_NAMES = (
    "Alabama|Alaska|Arizona|Arkansas|California|Colorado|Connecticut|Delaware|Florida|Georgia|"
    "Hawaii|Idaho|Illinois|Indiana|Iowa|Kansas|Kentucky|Louisiana|Maine|Maryland|Massachusetts|"
    "Michigan|Minnesota|Mississippi|Missouri|Montana|Nebraska|Nevada|New Hampshire|New Jersey|"
    "New Mexico|New York|North Carolina|North Dakota|Ohio|Oklahoma|Oregon|Pennsylvania|"
    "Rhode Island|South Carolina|South Dakota|Tennessee|Texas|Utah|Vermont|Virginia|Washington|"
    "West Virginia|Wisconsin|Wyoming|Ontario|Quebec|Alberta|Manitoba|Saskatchewan|"
    "British Columbia|Nova Scotia|New Brunswick"
)
# British postcode areas (the letters of a postcode's outward code)
_UK_AREAS = (
    "AB AL B BA BB BD BH BL BN BR BS BT CA CB CF CH CM CO CR CT CV CW DA DD DE DG DH DL DN DT DY "
    "E EC EH EN EX FK FY G GL GU GY HA HD HG HP HR HS HU HX IG IM IP IV JE KA KT KW KY L LA LD LE "
    "LL LN LS LU M ME MK ML N NE NG NN NP NR NW OL OX PA PE PH PL PO PR RG RH RM S SA SE SG SK SL "
    "SM SN SO SP SR SS ST SW SY TA TD TF TN TQ TR TS TW UB W WA WC WD WF WN WR WS WV YO ZE"
).split()
_STREET_TYPES = (
    "Street|St|Avenue|Ave|Av|Road|Rd|Boulevard|Blvd|Drive|Dr|Lane|Ln|Way|Court|Ct|Place|Pl|"
    "Terrace|Ter|Terr|Circle|Cir|Parkway|Pkwy|Highway|Hwy|Square|Sq|Trail|Trl|Crescent|Cres|"
    "Close|Row|Mews|Gardens|Gdns|Grove|Alley|Plaza|Loop|Pike|Expressway|Expy|Freeway|Fwy|"
    "Turnpike|Tpke|Walk|Hill|Heights|Hts|Crossing|Xing|Run|Path|Point|Pt|Commons|Green|"
    "Embankment|Quay|Wharf|Parade|Esplanade|Broadway|Causeway"
)

_WORD = r"\p{Lu}[\p{L}'\x{2019}-]{0,24}"  # a capitalised word (`O'Neil`, `Saint-Denis`)
_ORDINAL = r"[0-9]{1,4}(?:st|nd|rd|th|ST|ND|RD|TH)"
_NUMBER = r"[0-9]{1,6}[A-Za-z]?"  # `1600`, `221B`
_DIR = r"(?:N|S|E|W|NE|NW|SE|SW|North|South|East|West)"
_STREET = (
    rf"{_NUMBER} (?:{_DIR}\.? )?(?:{_WORD}|{_ORDINAL})(?: (?:{_WORD}|{_ORDINAL})){{0,3}} "
    rf"(?i:{_STREET_TYPES})\.?(?: (?:N|S|E|W|NE|NW|SE|SW)\b)?"
    r"(?:,? (?:Apt|Apartment|Suite|Ste|Unit|Flat|Floor|Fl|Room|Rm)\.?(?: #? ?| ?#)[0-9]{1,5}"
    r"[A-Za-z]?|,? #[0-9]{1,5}[A-Za-z]?)?"
)
# a unit on its own (a line of an address: `Suite 232`, `Apt 12B`; `Apt. 12` is cut by its
# `. `, a natural cut); US military and post-office boxes (`Unit 6832 Box 3839`, `PSC 1234,
# Box 5678`, `PO Box 75`)
_UNIT = r"(?:Apt|Apartment|Suite|Ste)(?: #? ?| ?#|\.#? ?)[0-9]{1,5}[A-Za-z]?"
_BOX = r"(?:(?:Unit|PSC|CMR) [0-9]{3,5},? Box [0-9]{1,5}|(?:PO|Post Office) Box [0-9]{1,6})"
# Street names of continental Europe as they are written there (the name, then the house
# number): a word ending in a street word (`Linzer Strasse 69`, `Kapelaniestraat 88`,
# `Ladbyvej 84`), or a street word and the name (`Rue des Ecoles 119`, `Via Roma 12`)
_EU_SUFFIX = (
    "strasse|straße|gasse|weg|allee|platz|straat|laan|gracht|plein|vej|gata|gatan|vägen|"
    "veien|katu|utca|ulica|ring|damm|ufer|kade|singel|dijk|steeg"
)
# the street words that are a word of their own too (`Linzer Strasse 69`; not `ring`)
_EU_WORDS = "|".join(w.capitalize() for w in _EU_SUFFIX.split("|")[:18])
# the street words that come before the name in French, Italian, Spanish, Portuguese, Catalan
# and Polish (the odonyms of everyday addresses, not a generator's list)
_EU_PREFIX = (
    "Rue|Via|Viale|Piazza|Piazzale|Corso|Vicolo|Strada|Contrada|Borgo|Lungomare|Calle|Carrer|"
    "Avenida|Rua|Praça|Praceta|Paseo|Passeig|Plaza|Largo|Travessa|Travesía|Camino|Carretera|"
    "Ronda|Glorieta|Pasaje|Rambla|Alameda|Estrada|Ulica|Boulevard|Avenue|Chemin|Route|Place|"
    "Quai|Allée|Impasse|Cours|Passage|Urbanización|Cuesta|Callejón|Avinguda|Vía"
)
_PARTICLE = r"(?:de|del|della|delle|des|du|la|le|las|los|da|do|dos|das|di|der|den|van|von)"
# a house number of continental Europe: `12`, `12a`, `12 bis`, a range or a building and a
# flat (`3-6`, `72/12`)
_EU_HOUSE = r"[0-9]{1,4}[a-zA-Z]?(?:[-/][0-9]{1,4}[a-zA-Z]?| bis| ter)?"
# a floor, door or staircase after the house number (`Calle Mayor 5 Piso 3`, `Via Roma 1
# Piano 2`)
_EU_FLOOR = (
    r"(?:,? (?:Piso|Planta|Puerta|Escalera|Piano|Scala|Interno|Appartamento|Andar|Apto|Bloco"
    r"|Étage|Etage"
    r"|Stock|Bus) [0-9A-Z]{1,3})"
)
_EU_STREET = (
    rf"(?:(?:{_WORD} ){{0,2}}(?:\p{{Lu}}[\p{{L}}-]{{0,30}}(?i:{_EU_SUFFIX})|{_EU_WORDS})"
    rf"|(?:{_EU_PREFIX}) (?:{_PARTICLE} )?{_WORD}(?: (?:{_PARTICLE} )?{_WORD}){{0,3}})"
    rf",? {_EU_HOUSE}"
)
# French and Belgian streets, the number first and the street word lower-cased (`12 rue de la
# Paix`, `36, boulevard Bruneau`, `5 bis avenue d'Italie`); capitalised too where the word is
# no English one (`12 Rue de la Paix`, not `3 Square Feet`, `10 Place Names`)
_FR_ONLY_WORDS = "rue|bd|chemin|allée|impasse|quai|voie|rond-point|faubourg|sentier|parvis"
_FR_ENGLISH_WORDS = "avenue|boulevard|place|route|cours|passage|square|esplanade|promenade"
_FR_WORDS = rf"(?:(?i:{_FR_ONLY_WORDS})|{_FR_ENGLISH_WORDS})"
_FR_NAME = (
    rf"{_FR_WORDS} (?:(?:de la|de l'|d'|des|du|de|la|le) ?)?"
    rf"{_WORD}(?: (?:{_PARTICLE} )?{_WORD}){{0,3}}"
)
_FR_STREET = rf"{_NUMBER}(?: bis| ter)?,? {_FR_NAME}"
# Postal codes of continental Europe and Brazil after a street: 4 or 5 digits (Germany,
# France, Italy, Spain; Austria, Switzerland, Belgium, Denmark), the Dutch `1012 LG`, the
# Portuguese `1100-148` and the Brazilian `01304-001`. Only after a street (or in `_EU_BARE`,
# the unambiguous ones): a bare 4- or 5-digit number is a year, an amount, an order.
_EU_CODE_STRICT = r"(?:[0-9]{5}(?:-[0-9]{3})?|[1-9][0-9]{3} ?[A-Z]{2}|[0-9]{4}-[0-9]{3})"
_EU_CODE = rf"(?:{_EU_CODE_STRICT}|[0-9]{{4}})"
# a city's name: capitalised words, with the particles of place names between them (`Capelle
# aan den IJssel`, `Santa Cruz de Tenerife`, `Saint-Denis`), and an Italian province after it
# (`Padova (PD)`)
_CITY_PARTICLE = rf"(?:{_PARTICLE}|aan|am|an|im|ob|sur|sous|en|lès)"
_EU_CITY = rf"{_WORD}(?: (?:{_CITY_PARTICLE} ){{0,2}}{_WORD}){{0,3}}(?: \([A-Z]{{2}}\))?"
# after a continental street: its postal code and city (either order, a comma or not)
_EU_TAIL = rf"(?:,? (?:{_EU_CODE},? {_EU_CITY}|{_EU_CITY},? {_EU_CODE}))"
# a street without a street word (`Damrak 1`, `Canale Tomasini, 612`), or a French one without
# its number (`rue Mathieu, 58213 Sainte Marc`): an address only with an unambiguous postal
# code and a city after a comma, either way round (`Damrak 1, 1012 LG Amsterdam`, `Acceso Nidia
# Hernández 10, Córdoba, 08650`)
_EU_STRICT_TAIL = rf", (?:{_EU_CODE_STRICT},? {_EU_CITY}|{_EU_CITY},? {_EU_CODE_STRICT})"
_EU_BARE = (
    rf"(?:{_WORD}(?: (?:{_PARTICLE} )?{_WORD}){{0,2}},? {_EU_HOUSE}{_EU_FLOOR}?|{_FR_NAME})"
    rf"{_EU_STRICT_TAIL}"
)
# a Dutch postcode and its city alone (`1012 LG Amsterdam`: four digits, a space, two
# capitals and a capitalised word), a stretch a stream's window may start at
_NL_LOCALITY = rf"[1-9][0-9]{{3}} ?[A-Z]{{2}},? {_EU_CITY}"
_CITY = rf"{_WORD}(?: {_WORD}){{0,2}}"
_ZIP = r"[0-9]{5}(?:-[0-9]{4})?"
_CA_POSTAL = r"[ABCEGHJ-NPRSTVXY][0-9][ABCEGHJ-NPRSTV-Z] ?[0-9][ABCEGHJ-NPRSTV-Z][0-9]"
_UK_POSTCODE = rf"(?:{'|'.join(_UK_AREAS)})[0-9][0-9A-Z]? [0-9][ABD-HJLNP-UW-Z]{{2}}|GIR 0AA"
_US_CODE = "|".join(_US)
_CA_CODE = "|".join(_CA)
_STATE = rf"(?:{_US_CODE}|{_CA_CODE}|{_STATE_NAMES})"
_POSTAL = rf"(?:{_ZIP}|{_CA_POSTAL}|{_UK_POSTCODE})"
# after a street: a city, a state or province, a postal code (ending in one of the last two)
_TAIL = rf"(?:,? (?:{_CITY},? )?(?:{_STATE}(?:,? {_POSTAL})?|{_POSTAL}))?"
# A match's neighbours (consumed, as `regex`'s kinds do, and only inside the match's own
# whitespace-free run, which a stream's window holds whole): no letter or number before, and
# none after (a ZIP code is not followed by `-` and a digit either: a longer number)
_BEFORE = rf"(?:^|[^{WORD_CHARS}]|\\[nrt])"
# a house number is not the end of a longer number (`3.11 Main Street`, `2-12 Main Street`)
_NUMBER_BEFORE = rf"(?:^[.\-/]?|[^{WORD_CHARS}.\-/]|[^\p{{N}}][.\-/]|\\[nrt])"
_AFTER = rf"(?:$|[^{WORD_CHARS}\-]|-(?:$|[^\p{{N}}]))"

# a street and what follows it; a city with its state and code (a seam window may start there)
_ADDRESS = bounded_pattern(_NUMBER_BEFORE, rf"{_STREET}{_TAIL}", _AFTER)
_OTHER = bounded_pattern(_BEFORE, rf"(?:{_EU_STREET}|{_BOX}|{_UNIT})(?:,? {_UNIT})?{_TAIL}", _AFTER)
# a continental street with its postal code and city; one without a street word but with an
# unambiguous code; a French street (each its own pattern: together they outgrow RE2's budget)
_EU_ADDRESS = bounded_pattern(_BEFORE, rf"{_EU_STREET}{_EU_FLOOR}?{_EU_TAIL}", _AFTER)
_EU_BARE_ADDRESS = bounded_pattern(_BEFORE, _EU_BARE, _AFTER)
_NL_ADDRESS = bounded_pattern(_BEFORE, _NL_LOCALITY, _AFTER)
# a British street whatever its street word (`Flat 8, Jane Ramp, Shawtown, LU74 8GA`, `2 Acacia
# Vista, Leeds, LS6 2AB`): a flat or a house number, capitalised words, a town and the
# postcode, which makes it an address
_UK_BARE = (
    rf"(?:(?:Flat|Studio|Apartment|Unit) [0-9]{{1,4}}[A-Za-z]?, (?:{_NUMBER} )?|{_NUMBER} )"
    rf"{_WORD}(?: {_WORD}){{0,2}}, {_CITY},? (?:{_UK_POSTCODE})"
)
_UK_ADDRESS = bounded_pattern(_NUMBER_BEFORE, _UK_BARE, _AFTER)
# What each of the patterns above cannot match without, found in one cheap pass (a literal or a
# short run of digits) so that most texts skip the pattern's own pass (on the bench's texts
# with a digit they cost 0.08-0.16 ms per 1,000 characters each): a continental postal code
# before a city or after a comma; a British postcode; a French street word
_EU_CODE_GATE = re2.compile(
    rb"[0-9]{4}(?:[0-9]|-[0-9]{3}| ?[A-Z]{2})?,? \p{Lu}|, [0-9]{4}", re2_options(CONFIG_MAX_MEM)
)
_UK_GATE = re2.compile(_UK_POSTCODE.encode(), re2_options(CONFIG_MAX_MEM))
_FR_GATE = re2.compile(rf"{_FR_WORDS} ".encode(), re2_options(CONFIG_MAX_MEM))
_FRENCH = bounded_pattern(_NUMBER_BEFORE, rf"{_FR_STREET}(?:{_EU_TAIL}|{_TAIL})", _AFTER)
_LOCALITY = bounded_pattern(
    _BEFORE,
    rf"{_CITY}, (?:(?:{_US_CODE}|{_STATE_NAMES}) {_ZIP}|(?:{_CA_CODE}) {_CA_POSTAL})"
    rf"|{_CITY},? (?:{_UK_POSTCODE})|(?:APO|FPO|DPO) (?:AA|AE|AP) {_ZIP}",
    _AFTER,
)
# a code that a state or province before it, its own shape (a British postcode: an area's
# letters, the space, a digit and two letters) or the words before it put in an address
# context; the words are part of the span: nothing before a match decides it
_UNAMBIGUOUS = "|".join(c for c in _US if c not in _AMBIGUOUS)
_POSTAL_CODE = bounded_pattern(
    _BEFORE,
    rf"(?:{_UNAMBIGUOUS}) {_ZIP}|(?:{_CA_CODE}) {_CA_POSTAL}|{_UK_POSTCODE}"
    r"|(?i:zip(?: ?code)?|post(?:al)? ?code)(?: is| number is)?:? ?#? ?"
    rf"(?:[0-9]{{3,5}}(?:-[0-9]{{4}})?(?: [A-Z]{{2}})?|{_CA_POSTAL}|{_UK_POSTCODE})",
    _AFTER,
)
# words that start a sentence or a phrase, not a street's name (`Chapter 3 The Road`)
_NOT_STREET_NAMES = frozenset(
    {"The", "A", "An", "And", "Or", "Of", "In", "On", "At", "To", "My", "AM", "PM"}
)


def _street_length(body: bytes) -> int:
    """A street match whose first name word is an article or preposition is none."""
    words = body.split(b" ", 2)
    name = words[1] if len(words) > 1 else b""
    return 0 if name.decode("utf-8", "replace") in _NOT_STREET_NAMES else len(body)


_CODE_IN_BARE = re.compile(r"[0-9]{4,5}(?: ?[A-Z]{2}\b|-[0-9]{3})?")
_LETTER_WORD = re.compile(r"[^\W\d_]+")


def _bare_length(body: bytes) -> int:
    """A street without a street word (`_EU_BARE`) or a Dutch postcode alone (`_NL_LOCALITY`)
    is none when its city's name, or every word of its street, is an ordinary English word
    (`Windows 10, 20000 Users`, `Table 2, 10000 Samples`, `2024 EU Summit`): without a street
    word, the shape alone is a reference, a count and a noun as often as a street and a city.
    The postal code is the body's last number of 4-5 digits; the city the word after it, or
    (`Benavente 648, Ourense, 19638`) the word before it."""
    ordinary = ordinary_words()
    text = body.decode("utf-8", "replace")
    codes = list(_CODE_IN_BARE.finditer(text))
    if not codes:  # (the patterns put one there)
        return 0
    code = codes[-1]
    after = _LETTER_WORD.findall(text[code.end() :])
    city = after[0] if after else (_LETTER_WORD.findall(text[: code.start()]) or [""])[-1]
    first_digit = next(i for i, ch in enumerate(text) if ch.isdigit())
    street = _LETTER_WORD.findall(text[:first_digit])
    if city.lower() in ordinary or (street and all(w.lower() in ordinary for w in street)):
        return 0
    return len(body)


def address_spans(text: str) -> list[Span]:
    """Addresses and postal codes in `text` (one piece between natural cuts, normalised), as
    (start, end, kind), sorted, none inside another: an address covers the city, state and
    code that are also found on their own."""
    t = Utf8Text(text)
    if len(t.data.translate(None, b"0123456789")) == len(t.data):
        return []  # every match holds a digit: most sentences cost one pass in C
    found: list[Span] = []
    streets = body_spans(_ADDRESS, t.data, _street_length)
    found.extend((s, e, "address") for s, e in t.spans(streets))
    found.extend((s, e, "address") for s, e in t.spans(body_spans(_OTHER, t.data)))
    for gate, rx, length in (
        (_EU_CODE_GATE, _EU_ADDRESS, None),
        (_EU_CODE_GATE, _EU_BARE_ADDRESS, _bare_length),
        (_EU_CODE_GATE, _NL_ADDRESS, _bare_length),
        (_UK_GATE, _UK_ADDRESS, None),
        (_FR_GATE, _FRENCH, None),
    ):
        if gate.search(t.data):
            found.extend((s, e, "address") for s, e in t.spans(body_spans(rx, t.data, length)))
    found.extend((s, e, "address") for s, e in t.spans(body_spans(_LOCALITY, t.data)))
    found.extend((s, e, "postal_code") for s, e in t.spans(body_spans(_POSTAL_CODE, t.data)))
    return _outermost(found)


def _outermost(found: list[Span]) -> list[Span]:
    """Sorted, without spans that overlap an earlier, longer one (an address first)."""
    found.sort(key=lambda f: (f[0], -f[1]))
    kept: list[Span] = []
    for span in found:
        if kept and span[0] < kept[-1][1]:
            if span[1] > kept[-1][1]:  # overlapping, reaching further: merge
                kept[-1] = (kept[-1][0], span[1], "address")
            continue
        kept.append(span)
    return kept
