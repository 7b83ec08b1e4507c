"""The server's command line: the serving mode and ranks that share a device."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pdctl.serve.args import parse
from pdctl.serve.settings import ROWS, ServeSettings

BASE = ["--role", "decode", "--port", "1", "--device", "cuda"]


def test_deterministic_is_the_default_and_the_vendor_path_an_explicit_opt_out() -> None:
    assert parse(BASE).deterministic is True
    assert parse([*BASE, "--deterministic"]).deterministic is True
    assert parse([*BASE, "--no-deterministic"]).deterministic is False


def test_rank_devices_name_each_ranks_device_in_the_mask() -> None:
    shared = parse([*BASE, "--tp", "2", "--rank-devices", "0,0"])
    assert shared.rank_devices == (0, 0) and shared.shares_devices
    own = parse([*BASE, "--tp", "2", "--rank-devices", "0,1"])
    assert not own.shares_devices and not parse([*BASE, "--tp", "2"]).shares_devices


@pytest.mark.parametrize(
    ("value", "message"),
    [("0,x", "comma-separated device indices"), ("0", "needs 2 indices"), ("0,-1", ">= 0")],
)
def test_bad_rank_devices_are_refused_with_the_reason(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse([*BASE, "--tp", "2", "--rank-devices", value])
    assert message in capsys.readouterr().err


def test_cuda_graphs_are_on_by_default_and_off_by_flag() -> None:
    assert parse(BASE).cuda_graphs is True
    assert parse([*BASE, "--no-cuda-graphs"]).cuda_graphs is False


def test_the_settings_table_defaults_and_flags() -> None:
    """Every row of serve/settings.py is a flag with the table's default."""
    defaults = parse(BASE).settings
    assert defaults == ServeSettings()
    assert defaults.switch_interval_us == 500 and defaults.bells and defaults.notify_at == "write"
    changed = parse(
        [*BASE, "--switch-interval-us", "100", "--no-bells", "--notify-at", "token",
         "--tp-gather", "collective", "--no-fork-ranks", "--no-native-attention",
         "--cuda-schedule", "blocking"]
    ).settings  # fmt: skip
    assert changed == ServeSettings(
        switch_interval_us=100, cuda_schedule="blocking", native_attention=False,
        fork_ranks=False, tp_gather="collective", bells=False, notify_at="token",
    )  # fmt: skip
    table = {row.name for row in ROWS}
    assert table == {f.name for f in fields(ServeSettings)} | {"cuda_graphs"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--switch-interval-us", "0"], "microseconds between 1 and 1000000"),
        (["--switch-interval-us", "fast"], "microseconds between 1 and 1000000"),
        (["--switch-interval-us", "2000000"], "microseconds between 1 and 1000000"),
        (["--notify-at", "later"], "invalid choice: 'later'"),
        (["--tp-gather", "mpi"], "invalid choice: 'mpi'"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse([*BASE, *argv])
    err = capsys.readouterr().err
    assert argv[0] in err and message in err
