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
    }


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
                },
            )
        )
    return out


def recall(find_pii: Any, n: int) -> dict[str, dict[str, int]]:
    """Per form: how many values a detection covers whole (every letter and digit)."""
    found: dict[str, Counter[str]] = {}

    def judge(form: str, value: str) -> None:
        text = f"Sure, here it is: {value}. Anything else?"
        at = text.index(value)
        covered = [False] * len(value)
        for d in find_pii(text, KINDS, {}):
            for i in range(max(d.start, at), min(d.end, at + len(value))):
                covered[i - at] = True
        whole = all(ok or not value[i].isalnum() for i, ok in enumerate(covered))
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
