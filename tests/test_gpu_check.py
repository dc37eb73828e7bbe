"""bench/gpu/check.sh kept honest on a CPU: a lent GPU session has 15 minutes, and a step that
fails there on a renamed flag or a summary grep that no longer matches costs minutes of them.
Here: the scripts parse, and check.sh's own rehearsal (CHECK_REHEARSE=1, bench/gpu/rehearse.sh)
of its cheapest step, bench/judge.py on tiny models, ends with the summary lines a GPU run keeps;
a step whose command line fails, or a summary grep without its line, fails the rehearsal by name.
`make gpu-rehearsal` rehearses every step (minutes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from generation import models
from tests.engine_support import skip_without_smollm2

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("check.sh", "setup.sh", "bundle.sh", "rehearse.sh")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_gpu_scripts_parse(script: str) -> None:
    done = subprocess.run(
        ["bash", "-n", str(ROOT / "bench/gpu" / script)], capture_output=True, text=True
    )
    assert (done.returncode, done.stderr) == (0, "")


def rehearse(work: Path, entry: str, **env: str) -> tuple[int, str, str]:
    """bench/gpu/rehearse.sh ENTRY in WORK: its exit status, its output, ENTRY's summary.txt."""
    skip_without_smollm2()
    models.prepare("smollm2-135m")  # bundle.sh copies its tokenizer files
    done = subprocess.run(
        ["bash", "bench/gpu/rehearse.sh", entry],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "CHECK_PYTHON": sys.executable,
            "GUARDSTREAM_CACHE": str(models.cache_root()),
            "REHEARSE_DIR": str(work),
            **env,
        },
    )
    summary = work / re.sub(r"[:,]", "-", entry) / "summary.txt"
    return done.returncode, done.stdout, summary.read_text()


def test_a_rehearsal_of_the_judge_step_keeps_its_summary_lines(tmp_path: Path) -> None:
    rc, output, summary = rehearse(tmp_path, "tests:judge")
    lines = summary.splitlines()
    assert rc == 0, summary
    assert "REHEARSAL: step" not in summary
    assert lines[0].endswith("part tests: judge")
    assert lines[1].startswith("REHEARSAL on the CPU: tiny models in ")
    assert re.fullmatch(r"--- setup: rc=0, \d+ s", lines[3])
    assert re.fullmatch(r"--- judge: rc=0, \d+ s", lines[5])
    kept = lines[6:-2]  # what the judge step's grep kept of its log
    # --profile: a line of figures, one of counts, a header and the top 10 ops per level
    assert [line[:16] for line in kept[:26]] == ["prof  1 stream :"] * 13 + [
        "prof  2 streams:"
    ] * 13
    assert [line.split()[0].split("=")[0] for line in kept[26:]] == [
        "incremental",
        "rejudging",
        "incremental",
        "2",
        "judge_tokens_ratio",
    ]
    assert kept[29].startswith("2 streams: ") and "the judged chunks/s of 1 stream" in kept[29]
    assert lines[-1] == "=== rehearsal passed"
    assert (tmp_path / "tests-judge/judge.json").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m135r", "m1p7r"]
    assert output.startswith("rehearsal of tests:judge: ") and ", 0 problems (" in output


def test_a_step_whose_command_fails_fails_the_rehearsal_by_name(tmp_path: Path) -> None:
    """A flag the bench does not have (session 12 lost a step to one): its rc, its --json file
    missing and every line the summary wanted of its log, each a REHEARSAL line; exit 1."""
    rc, output, summary = rehearse(tmp_path, "tests:judge", CHECK_REHEARSE_JUDGE="--no-such-flag")
    problems = [line for line in summary.splitlines() if line.startswith("REHEARSAL: step")]
    assert rc == 1
    assert problems == [
        "REHEARSAL: step judge: rc=2 (see judge.log)",
        f"REHEARSAL: step judge: no --json file {tmp_path}/tests-judge/judge.json",
        "REHEARSAL: step judge: no line matching '^ *(incremental|rejudging|re-judging)'",
        "REHEARSAL: step judge: no line matching 'streams: .*the judged'",
        "REHEARSAL: step judge: no line matching '^prof '",
        "REHEARSAL: step judge: no line matching '^judge_tokens_ratio'",
    ]
    assert summary.splitlines()[-1] == "=== rehearsal FAILED: 6 REHEARSAL lines above"
    assert output.splitlines()[1:] == problems


def test_the_rehearsal_hides_what_neither_the_image_nor_the_bundle_has(tmp_path: Path) -> None:
    """rehearse_site/sitecustomize.py: the venv here has every package; a rehearsal sees only
    the GPU image's (with what they require) and the bundle's wheels, as the lent machine will."""
    (tmp_path / "image.txt").write_text("torch\n")
    (tmp_path / "wheels.txt").write_text("confusable-homoglyphs==3.3.1\n")
    script = (
        "import importlib.util, torch, jinja2, confusable_homoglyphs\n"  # jinja2: torch needs it
        "print(importlib.util.find_spec('orjson'))\n"  # a probe: absent, as on the GPU
        "import orjson\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'bench/gpu/rehearse_site'}{os.pathsep}{ROOT}",
            "GUARDSTREAM_REHEARSE_BUNDLE": str(tmp_path),
        },
    )
    assert done.returncode == 1
    assert done.stdout == "None\n"
    assert done.stderr.splitlines()[-1] == (
        f"ModuleNotFoundError: orjson (orjson) is neither in the GPU image nor among "
        f"bench/gpu/bundle.sh's wheels ({tmp_path}): the lent machine would not have it"
    )
