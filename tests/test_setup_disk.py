"""scripts/disk.sh: a fresh environment is refused early, with the sizes, on a full disk."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def need_disk(target: Path, gib: int) -> subprocess.CompletedProcess[str]:
    script = f'. {REPO / "scripts" / "disk.sh"}; need_disk setup "$1" {gib}'
    return subprocess.run(
        ["bash", "-c", script, "need_disk", str(target)], capture_output=True, text=True
    )


def test_refuses_with_the_sizes_when_the_disk_is_short(tmp_path: Path) -> None:
    target = tmp_path / "not" / "yet" / ".venv"  # its parents do not exist yet either
    done = need_disk(target, 10**9)
    assert done.returncode == 1
    assert f"setup: {target} needs about {10**9} GiB of disk and {tmp_path} has" in done.stderr
    assert "MiB free" in done.stderr and "fix: free some space" in done.stderr


def test_passes_quietly_when_there_is_room(tmp_path: Path) -> None:
    done = need_disk(tmp_path / ".venv", 0)
    assert (done.returncode, done.stderr) == (0, "")


def test_both_setups_check_before_creating_their_environment() -> None:
    for name in ("setup.sh", "setup_vllm.sh"):
        text = (REPO / "scripts" / name).read_text()
        assert text.index("need_disk ") < text.index('-m venv "$VENV"'), name
