"""The server's command line: the serving mode and ranks that share a device."""

from __future__ import annotations

import pytest

from pdctl.serve.args import parse

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
