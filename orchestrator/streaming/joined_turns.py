"""A conversation's user turns judged across their boundaries by the input classifiers (DESIGN
4.8): each message is judged on its own, and an instruction cut into turns is not in any of
them. One word per user message passed the shipped `injection` whole (a text of fewer than two
words is not judged by its MiniLM heads, and no one word is an instruction), while the model
reads the turns one after another. So the user turns' texts, joined by spaces (as one text:
an instruction cut in two reads as it was written; line breaks between the halves made the
classifier read ordinary requests cut in two as injections more often), are judged
in windows that hold a boundary between turns: any instruction of up to TURN_WINDOW_STEP
characters lies whole in one of them, whatever the turns it is cut into.

Only classifiers judge them (a span detector's entity cut into turns is no entity the model is
shown whole: each turn is rendered as its own message). Windows sit at fixed offsets of the
joined text (multiples of TURN_WINDOW_STEP), so the history of a conversation, resent with
each turn, gives the same windows again (a tenant's verdict cache answers them), and the
windows cost at most twice the user text. A window's finding is reported on each user turn it
overlaps, whole (a classifier's verdict is on the text it read), and only for a detector that
flagged none of those turns alone.
"""

from __future__ import annotations

from dataclasses import replace

from ..api.input_pieces import InputPiece
from ..clients.registry import ChunkerRegistry, RequestedDetector
from .findings import Finding
from .text_judgement import judge_pieces
from .verdict_cache import TenantVerdicts

# A turn of more words is judged alone as a text that says something: joining it to its
# neighbours added false alarms on ordinary conversations (a benign request cut into two
# user messages: 13 of 200 flagged judged per turn, 22 joined whole) and catches nothing a
# per-turn judgement misses (cut in two, every attack of the bench was caught per turn).
SHORT_TURN_WORDS = 6
TURN_WINDOW_CHARS = 512
TURN_WINDOW_STEP = 256
JOINED_TURNS_FIELD = "joined user turns"  # the windows' pieces (never reported as such)


def turn_windows(pieces: list[InputPiece]) -> list[tuple[str, list[InputPiece]]]:
    """The windows of the user turns' joined text that hold a boundary between two turns, and
    the turns each overlaps, over each run of two or more consecutive short user turns (of at
    most SHORT_TURN_WORDS words: a fragment that says nothing alone)."""
    out: list[tuple[str, list[InputPiece]]] = []
    run: list[InputPiece] = []
    for p in [p for p in pieces if p.user_turn and p.text.strip()]:
        if len(p.text.split()) <= SHORT_TURN_WORDS:
            run.append(p)
            continue
        out += _run_windows(run)
        run = []
    return out + _run_windows(run)


def _run_windows(turns: list[InputPiece]) -> list[tuple[str, list[InputPiece]]]:
    """`turn_windows` over one run of consecutive short user turns."""
    if len(turns) < 2:
        return []
    joined = " ".join(p.text for p in turns)
    placed: list[tuple[int, int]] = []  # each turn's [start, end) in `joined`
    at = 0
    for p in turns:
        placed.append((at, at + len(p.text)))
        at += len(p.text) + 1
    out: list[tuple[str, list[InputPiece]]] = []
    first = 0  # the first turn that may overlap the next window
    for lo in range(0, max(1, len(joined) - TURN_WINDOW_STEP), TURN_WINDOW_STEP):
        hi = lo + TURN_WINDOW_CHARS
        while placed[first][1] <= lo:
            first += 1
        k = first
        while k + 1 < len(placed) and placed[k + 1][0] < hi:
            k += 1
        if k > first:  # a boundary inside: two turns or more
            out.append((joined[lo:hi], turns[first : k + 1]))
    return out


async def judge_joined_turns(
    pieces: list[InputPiece],
    findings: list[Finding],
    detectors: list[RequestedDetector],
    chunkers: ChunkerRegistry,
    verdicts: TenantVerdicts | None = None,
) -> list[Finding]:
    """The classifiers' findings on `turn_windows`, each on the user turns its window overlaps
    (spans: the whole turn); `findings` are the pieces' own: a detector that flagged one of a
    window's turns alone adds nothing there."""
    classifiers = [d for d in detectors if d.judges_chunks]
    windows = turn_windows(pieces) if classifiers else []
    if not windows:
        return []
    own = {(f.detector_id, f.message_index) for f in findings if f.field is None}
    judged = [
        InputPiece(text, message_index=k, field=JOINED_TURNS_FIELD)
        for k, (text, _) in enumerate(windows)
    ]
    found = await judge_pieces(judged, classifiers, chunkers, verdicts)
    out: dict[tuple[str, int | None], Finding] = {}
    for f in found:
        turns = windows[f.message_index or 0][1]
        if f.unjudged or any((f.detector_id, t.message_index) in own for t in turns):
            continue
        for t in turns:
            key = (f.detector_id, t.message_index)
            if key not in out or out[key].score < f.score:
                out[key] = replace(
                    f,
                    start=0,
                    end=len(t.text),
                    text=t.text,
                    message_index=t.message_index,
                    field=None,
                )
    return list(out.values())
