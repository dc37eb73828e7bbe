"""How often ordinary text trips the seam windows' fail-closed rule for runs of mostly hidden
characters (`orchestrator/streaming/detector_queue.py`, SEAM_RAW_CHARS). Not part of `make test`.

    .venv/bin/python bench/hidden_runs.py [--token 16]

Each text is streamed through a redacting detector's window cuts as a slow engine gives them
(one window per --token characters, the carry judged again each time: the most cuts a stream
gets) with no detections; a text trips the rule when some cut falls in a whitespace-free run
that has SEAM_RAW_CHARS original characters with fewer than SEAM_RUN_CHARS visible ones, and
that run is then redacted as `obfuscated`. Reported per text: whether it tripped, and how many
of its characters the redaction covers. Texts: bench/quality.py's `everyday_data` (4,765
requests to an assistant), each alone and all of them as one answer; and model-ish outputs
made here: long whitespace-free runs a model writes (minified HTML and SVG, emoji ZWJ runs,
base64, a URL of percent escapes, JSON with escaped non-ASCII text, HTML references), and the
padded values the rule exists for.
"""

from __future__ import annotations

import argparse
import base64
import json
import random

from detectors.normalise import MARKUP_MOST
from orchestrator.streaming.detector_queue import _run_end, safe_end


def redacted_chars(text: str, token: int) -> int:
    """Characters of `text` the rule redacts when it is streamed `token` characters per window
    (0: it never trips). Mirrors `DetectorQueue._obscured`: from a tripped run's start to its
    end (the next whitespace)."""
    start = 0
    covered = 0
    until = -1  # the end of the run being redacted
    for end in range(token, len(text) + token, token):
        end = min(end, len(text))
        before = text[max(0, start - MARKUP_MOST) : start]
        safe, hidden_from = safe_end(text[start:end], start, (), before)
        if hidden_from is not None and hidden_from >= until:
            stop = _run_end(text, safe)
            until = len(text) if stop is None else stop
            covered += until - hidden_from
        start = safe
    return covered


def model_outputs() -> dict[str, str]:
    rng = random.Random(7)
    html_cards = "".join(
        f'<div class="card"><h2 class="t">Item {i}</h2><p class="d">Nice thing number {i}.</p>'
        f'<a href="/items/{i}" class="btn">View</a></div>'
        for i in range(200)
    )
    table = "<table>" + "".join(
        f"<tr><td>{i}</td><td>{rng.randint(0, 999)}</td><td>{rng.random():.3f}</td></tr>"
        for i in range(400)
    )
    spans = "".join(f'<span class="tok-{i % 7}">{c}</span>' for i, c in enumerate("x=1;" * 300))
    svg = '<svg viewBox="0 0 24 24">' + "".join(
        f'<path d="M{i} {i}L{i + 3} {i + 5}l2 2z" fill="#{i:06x}"/>' for i in range(300)
    )
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"
    flag = "\U0001f3f3\ufe0f\u200d\U0001f308"
    blob = base64.b64encode(rng.randbytes(12_000)).decode()
    url = "https://example.com/search?q=" + "".join(
        f"%{rng.randint(0x20, 0x7E):02X}" for _ in range(3000)
    )
    url_utf8 = "https://example.com/wiki/" + "caf%C3%A9_%E2%80%93_" * 400
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(3000))
    return {
        "minified HTML, cards (text with spaces)": html_cards,
        "minified HTML, table of numbers": table,
        "minified HTML, highlighted code spans": spans,
        "minified SVG, 300 paths": svg,
        "emoji ZWJ family x 1500": family * 1500,
        "emoji ZWJ rainbow flag x 1500": flag * 1500,
        "base64 blob (16 KB)": blob,
        "URL of percent escapes (ASCII)": url,
        "URL of percent escapes (UTF-8)": url_utf8,
        "CJK prose, 3000 characters": cjk,
        "JSON, CJK prose escaped (ensure_ascii)": json.dumps(cjk),
        "HTML references of CJK prose": "".join(f"&#{ord(c)};" for c in cjk),
        "padded e-mail: jo + <b></b> x 1300 + @example.com": "jo"
        + "<b></b>" * 1300
        + "@example.com now.",
        "padded e-mail: jo + ZWSP x 9000 + @example.com": "jo"
        + "\u200b" * 9000
        + "@example.com now.",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--token", type=int, default=16, help="characters per window")
    args = parser.parse_args()
    from bench.quality import everyday_data

    rows = everyday_data()
    tripped = [r for r in rows if redacted_chars(r.text, args.token)]
    whole = "\n".join(r.text for r in rows)
    print(f"everyday_data: {len(tripped)} of {len(rows)} texts tripped")
    print(
        f"everyday_data as one answer ({len(whole):,} chars): {redacted_chars(whole, 256)} redacted"
    )
    for name, text in model_outputs().items():
        n = redacted_chars(text, args.token)
        print(f"{name:55s} {len(text):7,d} chars  redacted {n:7,d} ({n / len(text):.0%})")


if __name__ == "__main__":
    main()
