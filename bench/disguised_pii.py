"""PII written in a disguised form (digits spelt as words, one per space or line, look-alike
letters among digits, a number over table cells, e-mails spaced or in words) against the
`regex` built-in (`detectors.regex_pii.find_pii`): the share found whole per form, false finds
in text that holds no PII (bench/quality.py's everyday requests, Python's standard-library
docstrings, bench/pii_intl.py's sentences of numbers that are no phone) and the cost.

Run against another checkout by pointing PYTHONPATH at it (the script only imports
`detectors`): `PYTHONPATH=/work/main python bench/disguised_pii.py` is the before.

    python -m bench.disguised_pii [--values 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

KINDS = ["email", "phone", "ssn", "credit_card", "ipv4", "ipv6"]
WORDS = "zero one two three four five six seven eight nine".split()
LEET = str.maketrans("1052", "lOSZ")


def _luhn_complete(prefix: str) -> str:
    for d in "0123456789":
        n = prefix + d
        total = 0
        for i, ch in enumerate(reversed(n)):
            x = int(ch) * (2 if i % 2 else 1)
            total += x - 9 if x > 9 else x
        if total % 10 == 0:
            return n
    raise AssertionError


def values(n: int, seed: int = 7) -> list[tuple[str, list[str]]]:
    """(kind, digit groups) for `n` phones, SSNs and cards each."""
    rng = random.Random(seed)
    out: list[tuple[str, list[str]]] = []
    for _ in range(n):
        out.append(
            (
                "phone",
                [
                    str(rng.randint(201, 989)),
                    str(rng.randint(200, 999)),
                    f"{rng.randint(0, 9999):04d}",
                ],
            )
        )
        out.append(
            (
                "ssn",
                [
                    f"{rng.randint(1, 665):03d}",
                    f"{rng.randint(1, 99):02d}",
                    f"{rng.randint(1, 9999):04d}",
                ],
            )
        )
        card = _luhn_complete("4" + "".join(str(rng.randint(0, 9)) for _ in range(14)))
        out.append(("credit_card", [card[i : i + 4] for i in range(0, 16, 4)]))
    return out


def forms(groups: list[str]) -> dict[str, str]:
    """The disguised spellings of one number."""
    spelt = [" ".join(WORDS[int(d)] for d in g) for g in groups]
    digits = "".join(groups)
    return {
        "words, grouped": ", ".join(spelt),
        "words, ungrouped": " ".join(spelt),
        "digits one per space": " ".join(digits),
        "digits one per line": "\n".join(digits),
        "look-alike letters": "-".join(groups).translate(LEET),
        "table cells": "\n| " + " | ".join(groups) + " |\n",
    } | script_forms(groups)


# Digits of other writing systems (each a code point per ASCII digit): a model asked to write a
# number "in Arabic digits" or "in bold" writes it so, and a reader reads the number
_ZERO_AT = {
    "Arabic-Indic digits": 0x0660,
    "Extended Arabic-Indic digits": 0x06F0,
    "Devanagari digits": 0x0966,
    "Bengali digits": 0x09E6,
    "Thai digits": 0x0E50,
    "full-width digits": 0xFF10,
    "mathematical bold digits": 0x1D7CE,
    "mathematical monospace digits": 0x1D7F6,
}
SCRIPT_DIGITS: dict[str, str] = {
    name: "".join(chr(zero + d) for d in range(10)) for name, zero in _ZERO_AT.items()
} | {
    "circled digits": "\u24ea\u2460\u2461\u2462\u2463\u2464\u2465\u2466\u2467\u2468",
    "superscript digits": "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079",
    "subscript digits": "".join(chr(0x2080 + d) for d in range(10)),
    "digits with full stop": "\U0001f100" + "".join(chr(0x2488 + d) for d in range(9)),
}
# words for the digits in German, French, Spanish, Italian and Portuguese
NUMBER_WORDS = {
    "German words": "null eins zwei drei vier f\u00fcnf sechs sieben acht neun",
    "French words": "z\u00e9ro un deux trois quatre cinq six sept huit neuf",
    "Spanish words": "cero uno dos tres cuatro cinco seis siete ocho nueve",
    "Italian words": "zero uno due tre quattro cinque sei sette otto nove",
    "Portuguese words": "zero um dois tr\u00eas quatro cinco seis sete oito nove",
}


def _tags(text: str) -> str:
    """`text` in Unicode tag characters (U+E0020-U+E007E): invisible copies of ASCII."""
    return "".join(chr(0xE0000 + ord(c)) for c in text)


# a form whose value is written onto the words around it, as Chinese is written (no spaces)
GLUED = "glued to "


def script_forms(groups: list[str]) -> dict[str, str]:
    """One number in other writing systems' digits, other languages' words and invisible or
    reordering characters."""
    dashed = "-".join(groups)
    out = {
        name: dashed.translate(str.maketrans("0123456789", digits))
        for name, digits in SCRIPT_DIGITS.items()
    }
    scripts = list(SCRIPT_DIGITS.values())
    out["mixed digit scripts"] = "".join(
        scripts[i % len(scripts)][int(c)] if c.isdigit() else c for i, c in enumerate(dashed)
    )
    for name, words in NUMBER_WORDS.items():
        spelt = words.split()
        out[name] = ", ".join(" ".join(spelt[int(d)] for d in g) for g in groups)
    cjk = "\u3007\u4e00\u4e8c\u4e09\u56db\u4e94\u516d\u4e03\u516b\u4e5d"
    out["Chinese numerals"] = dashed.translate(str.maketrans("0123456789", cjk))
    out[GLUED + "Chinese words"] = dashed
    out["keycap digits"] = "".join(c + "\ufe0f\u20e3" if c.isdigit() else c for c in dashed)
    out["variation selectors"] = "\ufe0e".join(dashed)
    out["right-to-left override"] = "\u202e" + dashed[::-1] + "\u202c"
    # in a right-to-left isolate, digit groups parted by spaces are drawn right to left
    out["right-to-left isolate"] = "\u2067" + " ".join(reversed(groups)) + "\u2069"
    out["tag characters"] = _tags(dashed)
    return out


def emails(n: int, seed: int = 9) -> list[tuple[str, dict[str, str]]]:
    rng = random.Random(seed)
    names = "john mary lee ana olga wei raj tom kim sam".split()
    hosts = "example mailhost acme postbox inbox".split()
    tlds = "com org net io de".split()
    out = []
    for _ in range(n):
        a, b = rng.choice(names), f"{rng.choice(names)}{rng.randint(1, 99)}"
        user = f"{a}.{b}" if rng.random() < 0.5 else f"{a}{b}"
        host, tld = rng.choice(hosts), rng.choice(tlds)
        out.append(
            (
                f"{user}@{host}.{tld}",
                {
                    "e-mail spaced": user.replace(".", " . ") + f" @ {host} . {tld}",
                    "e-mail in words": user.replace(".", " dot ") + f" at {host} dot {tld}",
                    "e-mail reversed": f"{user}@{host}.{tld}"[::-1],
                }
                | email_forms(user, host, tld),
            )
        )
    return out


# a host name of letters outside ASCII, and its punycode (IDNA) form
_IDN = {"example": "ex\u00e4mple", "mailhost": "m\u00e4ilhost", "acme": "\u00e1cme"}


# Latin letters spelt in Cyrillic and Greek (a transliteration: what a name in those scripts
# is made of, not look-alikes)
_CYRILLIC = str.maketrans(
    "abdegijklmnoprstuvyz",
    "\u0430\u0431\u0434\u0435\u0433\u0438\u0439\u043a\u043b\u043c\u043d\u043e\u043f\u0440\u0441\u0442\u0443\u0432\u044b\u0437",
)
_GREEK = str.maketrans(
    "abdegiklmnoprstuxyz",
    "\u03b1\u03b2\u03b4\u03b5\u03b3\u03b9\u03ba\u03bb\u03bc\u03bd\u03bf\u03c0\u03c1\u03c3\u03c4\u03c5\u03be\u03c5\u03b6",
)


def email_forms(user: str, host: str, tld: str) -> dict[str, str]:
    """One e-mail address with its `@` and `.` in other characters or words, in other
    alphabets, in tag characters or reordered."""
    address = f"{user}@{host}.{tld}"
    idn = _IDN.get(host, host + "\u00f1")
    math_bold = {c: chr(0x1D41A + ord(c) - ord("a")) for c in "abcdefghijklmnopqrstuvwxyz"}
    return {
        "e-mail full-width @": address.replace("@", "\uff20"),
        "e-mail small @": address.replace("@", "\ufe6b"),
        "e-mail (at) (dot)": user.replace(".", "(dot)") + f"(at){host}(dot){tld}",
        "e-mail [at] [dot]": user.replace(".", " [dot] ") + f" [at] {host} [dot] {tld}",
        "e-mail AT DOT": user.replace(".", " DOT ") + f" AT {host} DOT {tld}",
        "e-mail circled a for @": address.replace("@", " \u24d0 "),
        "e-mail full-width": "".join(
            chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in address
        ),
        "e-mail math bold letters": "".join(math_bold.get(c, c) for c in address),
        "e-mail IDN domain": f"{user}@{idn}.{tld}",
        "e-mail punycode domain": f"{user}@{idn.encode('idna').decode()}.{tld}",
        "e-mail Unicode local part": user.replace("o", "\u00f6") + f"@{host}.{tld}",
        "e-mail CJK local part": f"\u5c71\u7530{user[-2:]}@{host}.{tld}",
        "e-mail Cyrillic": user.translate(_CYRILLIC)
        + "@\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444",
        "e-mail Greek local part": user.translate(_GREEK) + f"@{host}.{tld}",
        "e-mail Japanese domain": f"{user}@\u4f8b\u3048.jp",
        "e-mail right-to-left override": "\u202e" + address[::-1] + "\u202c",
        "e-mail tag characters": _tags(address),
    }


def _drawn(ch: str) -> bool:
    """A character of a value that a find must cover: a letter or digit, or the invisible
    copy of one (a tag character)."""
    return ch.isalnum() or (0xE0030 <= ord(ch) <= 0xE007A and chr(ord(ch) - 0xE0000).isalnum())


def recall(find_pii: Any, n: int) -> dict[str, dict[str, int]]:
    """Per form: how many values a detection covers whole (every letter and digit)."""
    found: dict[str, Counter[str]] = {}

    def judge(form: str, value: str) -> None:
        if form.startswith(GLUED):
            text = f"\u8bf7\u62e8\u6253{value}\u3002\u8c22\u8c22"
        else:
            text = f"Sure, here it is: {value}. Anything else?"
        at = text.index(value)
        covered = [False] * len(value)
        for d in find_pii(text, KINDS, {}):
            for i in range(max(d.start, at), min(d.end, at + len(value))):
                covered[i - at] = True
        whole = all(ok or not _drawn(value[i]) for i, ok in enumerate(covered))
        found.setdefault(form, Counter())["whole" if whole else "missed"] += 1

    for _, groups in values(n):
        for form, value in forms(groups).items():
            judge(form, value)
    for _, spelt in emails(n):
        for form, value in spelt.items():
            judge(form, value)
    return {form: dict(c) for form, c in found.items()}


def stdlib_docstrings() -> list[str]:
    from bench.train_injection import STDLIB_MODULES

    docs: dict[str, None] = {}
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(v for _, v in inspect.getmembers(module))]:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc:
                docs.setdefault(doc, None)
    return list(docs)


UNSPACED_LANGUAGES = ("chinese", "traditionalchinese", "japanese", "korean", "thai")


def unspaced_conversations() -> list[str]:
    """chatterbot-corpus's conversations in languages written without spaces between words (and
    Korean, whose particles are written onto the word before): every statement, deduplicated.
    What `regex_pii._UNSPACED` changes the reading of."""
    import yaml
    from chatterbot_corpus import corpus

    root = Path(corpus.DATA_DIRECTORY)
    texts: dict[str, None] = {}
    for language in UNSPACED_LANGUAGES:
        for path in sorted((root / language).glob("*.yml")):
            for turns in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations", []):
                for turn in turns:
                    if isinstance(turn, str) and turn.strip():
                        texts.setdefault(turn, None)
    return list(texts)


def unspaced_addresses(n: int = 200, seed: int = 5) -> list[str]:
    """Faker's postal addresses and dates in zh_CN, zh_TW, ja_JP, ko_KR and th_TH (no PII of
    the `regex` kinds: house numbers, postcodes and dates written onto the words around them,
    the numbers a Chinese or Japanese text holds most)."""
    from faker import Faker

    out = []
    for locale in ("zh_CN", "zh_TW", "ja_JP", "ko_KR", "th_TH"):
        fake = Faker(locale)
        fake.seed_instance(seed)
        out.extend(f"{fake.address()}\n{fake.date()}" for _ in range(n))
    return out


def false_finds(find_pii: Any, texts: list[str]) -> dict[str, Any]:
    found = [(t, d) for t in texts for d in find_pii(t, KINDS, {})]
    start = time.process_time()
    for _ in range(3):
        for t in texts:
            find_pii(t, KINDS, {})
    ms = (time.process_time() - start) / 3 * 1000
    chars = sum(map(len, texts))
    return {
        "texts": len(texts),
        "chars": chars,
        "finds": len(found),
        "per_kind": dict(Counter(d.detection for _, d in found)),
        "finds_text": sorted(d.text for _, d in found),
        "cpu_ms_per_1k_chars": round(ms / chars * 1000, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import detectors
    from bench.pii_intl import number_data
    from bench.quality import everyday_data
    from detectors.regex_pii import find_pii

    print(f"detectors from {Path(detectors.__file__).parent}; load {os.getloadavg()[0]:.2f}")
    out: dict[str, Any] = {"recall": recall(find_pii, args.values)}
    for form, c in out["recall"].items():
        total = sum(c.values())
        print(f"  {form:24s} found whole {c.get('whole', 0)}/{total}")
    sets = {
        "everyday requests": [r.text for r in everyday_data()],
        "stdlib docstrings": stdlib_docstrings(),
        "non-phone numbers": number_data(400),
        "zh/ja/ko/th conversations": unspaced_conversations(),
        "zh/ja/ko/th addresses": unspaced_addresses(),
    }
    out["false_finds"] = {}
    for name, texts in sets.items():
        f = false_finds(find_pii, texts)
        out["false_finds"][name] = f
        print(
            f"  {name}: {f['texts']} texts, {f['chars']} chars: {f['finds']} finds "
            f"{f['per_kind']}; {f['cpu_ms_per_1k_chars']} CPU ms/1k chars"
        )
    print(f"load after {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
