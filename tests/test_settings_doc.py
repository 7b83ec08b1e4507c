"""docs/settings.md is the settings tables, generated; pdctl reads at most 12 variables."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "settings_doc.py"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("settings_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["settings_doc"] = module
    spec.loader.exec_module(module)
    return module


def test_the_page_is_the_tables() -> None:
    generator = _generator()
    page = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    assert page == generator.render(), "docs/settings.md is stale: python scripts/settings_doc.py"


def test_every_row_has_a_default_column_a_source_and_a_reason() -> None:
    generator = _generator()
    for _, module, attribute in generator.TABLES:
        rows = generator._rows(module, attribute)
        assert rows, f"{module}.{attribute} has no rows"
        for row in rows:
            assert row.name and row.source and len(row.reason) > 20, (module, row)


def test_at_most_twelve_pdctl_variables() -> None:
    names = _generator().variables()
    assert "PDCTL_RUN_SECRET" in names  # the hand-off is counted, not only tunables
    assert len(names) <= 12, sorted(names)
