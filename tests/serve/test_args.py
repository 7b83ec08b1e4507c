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


def test_cuda_graphs_are_on_by_default_and_off_by_flag_or_environment(monkeypatch) -> None:
    monkeypatch.delenv("PDCTL_CUDA_GRAPHS", raising=False)
    assert parse(BASE).cuda_graphs is True
    assert parse([*BASE, "--no-cuda-graphs"]).cuda_graphs is False
    for value, enabled in (("0", False), ("off", False), ("1", True), (" True ", True)):
        monkeypatch.setenv("PDCTL_CUDA_GRAPHS", value)
        assert parse(BASE).cuda_graphs is enabled, value
    monkeypatch.setenv("PDCTL_CUDA_GRAPHS", "1")
    assert parse([*BASE, "--no-cuda-graphs"]).cuda_graphs is False


def test_a_bad_cuda_graphs_variable_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setenv("PDCTL_CUDA_GRAPHS", "maybe")
    with pytest.raises(SystemExit):
        parse([*BASE, "--no-cuda-graphs"])  # checked even when the flag turns them off
    assert "PDCTL_CUDA_GRAPHS takes 0 or 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, 0.0005), ({"PDCTL_SWITCH_INTERVAL_US": "100"}, 0.0001)],
)
def test_the_pd_servers_switch_interval(environ, expected) -> None:  # type: ignore[no-untyped-def]
    from pdctl.serve.__main__ import switch_interval_s

    assert switch_interval_s(environ) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["0", "fast", "-5", "2000000"])
def test_a_bad_switch_interval_is_refused_naming_the_variable(text) -> None:  # type: ignore[no-untyped-def]
    from pdctl.serve.__main__ import switch_interval_s

    with pytest.raises(SystemExit, match="PDCTL_SWITCH_INTERVAL_US"):
        switch_interval_s({"PDCTL_SWITCH_INTERVAL_US": text})
