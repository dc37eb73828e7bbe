"""How often a benign answer cut short loses its tail to the PII guardrail (DESIGN 4.6a: an
answer the model did not end withholds a tail that could be the beginning of an entity,
`detectors/regex_pii.py` `open_tail(..., cut=True)`). Not part of `make test`.

    .venv/bin/python -m bench.cut_tails [--per-text 3] [--seed 1] [--splits dev,test]

Texts: bench/quality.py's everyday requests (`everyday_data`), its technical document snippets
(`docs_data`, versions and numbers) and bench/pii_intl.py's sentences of numbers that are no PII
(`number_data`: orders, amounts, dates, versions), each kept only where the `regex` detector
finds nothing in the whole text (so any withheld tail is a false one). Each is cut at token
points as a model's tokenizer makes them (a GPT-2-style pre-tokenizer with one digit a token,
as SmolLM2's: the most cuts inside numbers), `--per-text` random ones per text and every one;
a cut is a false withhold when `open_tail` flags its tail. Reported per set and split
(`split_of`: dev, test), before (the open-stream evidence, `cut=False`: what a `length` end
released until now) and after (`cut=True`), with the withheld tails most often seen.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import Counter

import regex

import detectors
from bench.pii_intl import number_data
from bench.quality import docs_data, everyday_data, split_of
from detectors.regex_pii import open_tail

# one pre-token: a word with the space before it, one digit, a run of punctuation, whitespace
_PRE_TOKEN = regex.compile(
    r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)


def token_ends(text: str) -> list[int]:
    """Where each token of `text` ends (a cut after it), the text's end excluded."""
    return [m.end() for m in _PRE_TOKEN.finditer(text)][:-1]


async def benign(texts: list[str]) -> list[str]:
    """The texts the `regex` detector finds nothing in."""
    found = await detectors.build("regex").detect(texts, {})
    return [t for t, hits in zip(texts, found, strict=True) if not hits]


def measure(texts: list[str], per_text: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    out: dict[str, object] = {"texts": len(texts)}
    for name, points in (
        ("random", lambda ends: rng.sample(ends, min(per_text, len(ends)))),
        ("every", lambda ends: ends),
    ):
        cuts = before = after = 0
        tails: Counter[str] = Counter()
        for text in texts:
            for end in points(token_ends(text)):
                cut = text[:end]
                cuts += 1
                before += open_tail(cut) is not None
                tail = open_tail(cut, cut=True)
                if tail is not None:
                    after += 1
                    tails[f"{cut[tail[0] :][-24:]!r} ({tail[1]})"] += 1
        out[name] = {
            "cuts": cuts,
            "before": before,
            "after": after,
            "before_rate": round(before / max(cuts, 1), 5),
            "after_rate": round(after / max(cuts, 1), 5),
            "tails": tails.most_common(8),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-text", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--splits", default="dev,test", help="dev: choose rules; test: report")
    args = parser.parse_args()
    sets = {
        "everyday requests": [r.text for r in everyday_data()],
        "document snippets": [r.text for r in docs_data("check")],
        "non-PII numbers": number_data(400),
    }
    for set_name, texts in sets.items():
        kept = asyncio.run(benign(texts))
        for split in args.splits.split(","):
            part = [t for t in kept if split_of(t) == split]
            row = measure(part, args.per_text, args.seed)
            print(f"\n== {set_name}, {split}: {row['texts']} benign texts (of {len(texts)})")
            for name in ("random", "every"):
                r = row[name]
                assert isinstance(r, dict)
                print(
                    f"  {name} token points: {r['cuts']} cuts, false withholds before "
                    f"{r['before']} ({100 * r['before_rate']:.2f}%), after {r['after']} "
                    f"({100 * r['after_rate']:.2f}%)"
                )
            every = row["every"]
            assert isinstance(every, dict)
            for tail, n in every["tails"]:
                print(f"    {n:5d}  {tail}")


if __name__ == "__main__":
    main()
