"""The transport benchmark's rows and targets as JSON (no peer process: rows made here)."""

from __future__ import annotations

from dataclasses import fields

from pdctl.staging.transport.bench import Row, RowJson, targets


def test_a_row_is_its_json_field_for_field() -> None:
    row = Row("tcp (socket)", "4 KiB", 4096, 1.5, 0.25, 0.5, True, connect_ms=3.0)
    data = row.to_json()
    assert list(data) == [field.name for field in fields(Row)] == list(RowJson.__annotations__)
    assert data["first_ms"] is None and data["connect_ms"] == 3.0 and data["consistent"]


def test_targets_are_ratios_of_the_rows_present() -> None:
    rows = [
        Row("tcp (same-host direct)", "64 MiB", 64 << 20, 30.0, 2.0, 3.0, True),
        Row("nixl (ucx)", "64 MiB", 64 << 20, 20.0, 3.0, 4.0, True),
        Row("memcpy (ceiling)", "64 MiB", 64 << 20, 40.0, 1.5, 2.0, True),
        Row("tcp (same-host direct)", "4 KiB", 4096, 1.0, 0.02, 0.03, True),
        Row("nixl (ucx)", "4 KiB", 4096, 0.5, 0.04, 0.05, True),
    ]
    assert targets(rows) == {
        "size": "64 MiB",
        "direct_vs_best_library": 1.5,
        "direct_vs_memcpy": 0.75,
        "p50_4k_vs_nixl": 0.5,
    }
