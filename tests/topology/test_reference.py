"""The README's topology reference is complete and current."""

from __future__ import annotations

from pdctl.topology.model import Topology
from pdctl.topology.reference import BEGIN, END, reference_markdown, rows
from tests.conftest import REPO


def test_readme_reference_matches_the_models() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(BEGIN) : readme.index(END) + len(END)]
    assert section == reference_markdown(), "run: python scripts/update_readme_reference.py"


def test_every_key_is_described() -> None:
    keys = [key for key, _, _, _ in rows()]
    assert all(description for _, _, _, description in rows())
    for name in Topology.model_fields:
        assert f"`{name}`" in keys
    assert "`transfer.staging.pool_size_mb`" in keys and "`roles.prefill.bootstrap_port`" in keys
