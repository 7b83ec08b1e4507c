"""Regenerate the topology reference table inside README.md (between its markers)."""

from __future__ import annotations

import sys
from pathlib import Path

from pdctl.topology.reference import BEGIN, END, reference_markdown

README = Path(__file__).resolve().parent.parent / "README.md"


def updated(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + reference_markdown() + text[end:]


if __name__ == "__main__":
    text = README.read_text(encoding="utf-8")
    new = updated(text)
    if "--check" in sys.argv:
        sys.exit(0 if new == text else "README.md's topology reference is out of date")
    README.write_text(new, encoding="utf-8")
