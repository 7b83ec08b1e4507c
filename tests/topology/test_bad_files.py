"""Each file under bad/ declares, in its header, the exact diagnostics it must produce.

Header lines `# expect: LINE:COL: KEY: MESSAGE` and `# hint: HINT` (after the
expect line it belongs to) list every issue, in order, errors and warnings alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.launch.plan import load_checked
from pdctl.topology import TopologyError

BAD = sorted((Path(__file__).parent / "bad").glob("*.yaml"))


def expectations(path: Path) -> list[tuple[str, str | None]]:
    expected: list[tuple[str, str | None]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# expect: "):
            expected.append((line.removeprefix("# expect: "), None))
        elif line.startswith("# hint: "):
            expected[-1] = (expected[-1][0], line.removeprefix("# hint: "))
    return expected


def test_catalogue_is_large_and_every_file_declares_expectations() -> None:
    assert len(BAD) >= 30
    for path in BAD:
        assert expectations(path), f"{path.name} has no '# expect:' header"


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_file_gives_its_precise_diagnostics(path: Path) -> None:
    with pytest.raises(TopologyError) as caught:
        load_checked(path)
    found = [
        (issue.headline().removeprefix(f"{path}:"), issue.hint) for issue in caught.value.issues
    ]
    assert found == expectations(path)
    for issue in caught.value.issues:
        assert issue.file == str(path)
        assert issue.line is not None and issue.line >= 1
