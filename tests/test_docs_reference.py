"""docs/benchmarks.md is a reference, not a session log (CONVENTIONS.md, rule 17): per
benchmark the command and its latest figure with a date. History lives in git. The
rules are checked on the file itself and, so that they can fail, on a log."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

BENCHMARKS = REPO / "docs" / "benchmarks.md"
MAX_LINES = 600
LOG_HEADING = re.compile(r"\b(sessions?|calls?|stops?)\s+\d+", re.IGNORECASE)
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


def log_headings(text: str) -> list[str]:
    """Headings that name a session, a call or a stop by number."""
    headings = [m.group(2) for m in map(HEADING.match, text.splitlines()) if m]
    return [h for h in headings if LOG_HEADING.search(h)]


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, text) of every level-2 section, its subsections included, and of every
    level-3 section on its own; the text starts with the heading's line. Text under
    the title, before the first section, is left out."""
    found: list[tuple[str, str]] = []
    open_: dict[int, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        m = HEADING.match(line)
        level = len(m.group(1)) if m else 0
        if level in (1, 2, 3):
            for closed in [lv for lv in open_ if lv >= level]:
                heading, body = open_.pop(closed)
                found.append((heading, "\n".join(body)))
            if level == 1:
                continue
            open_[level] = (m.group(2), [])
        for _, body in open_.values():
            body.append(line)
    found.extend((heading, "\n".join(body)) for heading, body in open_.values())
    return found


def undated_sections(text: str) -> list[str]:
    return [heading for heading, body in sections(text) if not DATE.search(body)]


SESSION_LOG = """# Benchmarks

## Staging (`pdctl bench staging`)

2026-11-30, dev: gather 0.61.

## Session 9 (2026-12-01)

### Call 3: the tests

454 passed.

### Stop 2

## Reruns (session 8, quiet machine)

Nothing dated here.
"""


def test_the_rules_catch_a_session_log() -> None:
    assert log_headings(SESSION_LOG) == [
        "Session 9 (2026-12-01)",
        "Call 3: the tests",
        "Stop 2",
        "Reruns (session 8, quiet machine)",
    ]
    assert undated_sections(SESSION_LOG) == [
        "Call 3: the tests",
        "Stop 2",
        "Reruns (session 8, quiet machine)",
    ]
    heading, text = sections(SESSION_LOG)[0]
    assert heading == "Staging (`pdctl bench staging`)"
    assert text == "## Staging (`pdctl bench staging`)\n\n2026-11-30, dev: gather 0.61.\n"


@pytest.fixture(scope="module")
def reference() -> str:
    return BENCHMARKS.read_text(encoding="utf-8")


def test_benchmarks_has_no_session_headings(reference: str) -> None:
    assert log_headings(reference) == [], "history lives in git, not in docs/benchmarks.md"


def test_benchmarks_stays_short(reference: str) -> None:
    assert len(reference.splitlines()) < MAX_LINES  # the before-stop hook's bar too


def test_every_benchmark_section_has_a_dated_figure(reference: str) -> None:
    assert len(sections(reference)) >= 10
    assert undated_sections(reference) == []
