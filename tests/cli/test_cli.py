"""The commands of this issue through Typer's CliRunner: output streams, JSON, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from pdctl import __version__
from pdctl.cli.app import app
from tests.conftest import CATALOG, REPO

BAD = REPO / "tests" / "topology" / "bad"
DEFAULT = REPO / "topologies" / "cpu-p1d2-tcp.yaml"


def test_version_and_help(cli) -> None:
    result = cli.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"pdctl {__version__}"
    result = cli.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("validate", "schema", "plan"):
        assert command in result.stdout


def test_validate_catalog_is_clean(cli) -> None:
    result = cli.invoke(app, ["validate", *map(str, CATALOG)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""  # diagnostics and progress go to stderr
    assert f"{len(CATALOG)} of {len(CATALOG)} topology file(s) valid" in result.stderr


def test_validate_reports_every_bad_file_with_position_and_exit_2(cli) -> None:
    files = [BAD / "quoted-integer.yaml", BAD / "unknown-key.yaml", DEFAULT]
    result = cli.invoke(app, ["validate", *map(str, files)])
    assert result.exit_code == 2
    assert (
        f"{files[0]}:6:9: roles.prefill.tp: expected an integer, got the text '2'" in result.stderr
    )
    assert "  hint: remove the quotes: 2" in result.stderr
    assert f"{files[1]}:6:5: roles.prefill.tpp: unknown key 'tpp'" in result.stderr
    assert "1 of 3 topology file(s) valid" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("missing.yaml", "no such file"),
        (".", "is a directory"),
    ],
)
def test_validate_bad_paths_get_clear_messages(
    cli, tmp_path: Path, target: str, message: str
) -> None:
    path = tmp_path / target
    result = cli.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert f"{path}: {message}" in result.stderr
    assert "Traceback" not in result.output


def test_validate_non_utf8_file(cli, tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\nroles: {}\n")
    result = cli.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert f"{path}:1:10: the file is not UTF-8 text (byte 0xe9 at offset 9)" in result.stderr


def test_validate_json_output_parses(cli) -> None:
    files = [BAD / "backend-typo.yaml", DEFAULT]
    result = cli.invoke(app, ["validate", "--json", *map(str, files)])
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert [entry["valid"] for entry in report] == [False, True]
    (issue,) = report[0]["issues"]
    assert issue["line"] == 6 and issue["column"] == 12 and issue["key"] == "transfer.backend"
    assert issue["hint"] == "did you mean 'nixl'?" and issue["severity"] == "error"


def test_global_flags_work_before_and_after_the_command(cli) -> None:
    before = cli.invoke(app, ["--json", "plan", str(DEFAULT)])
    after = cli.invoke(app, ["plan", str(DEFAULT), "--json"])
    assert before.exit_code == after.exit_code == 0
    assert json.loads(before.stdout) == json.loads(after.stdout)


def test_quiet_silences_progress_but_not_errors(cli) -> None:
    ok = cli.invoke(app, ["-q", "validate", str(DEFAULT)])
    assert ok.exit_code == 0 and ok.stderr == ""
    bad = cli.invoke(app, ["validate", "-q", str(BAD / "tp-zero.yaml")])
    assert bad.exit_code == 2 and "must be >= 1, got 0" in bad.stderr


def test_schema_is_json_schema_and_validates_the_catalog(cli) -> None:
    result = cli.invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    for path in CATALOG:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    assert schema["properties"]["roles"]["$ref"].endswith("/Roles")


def test_plan_json_describes_every_process(cli) -> None:
    result = cli.invoke(app, ["plan", "--json", str(DEFAULT)])
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["topology"] == "cpu-p1d2-tcp"
    assert [p["name"] for p in plan["processes"]] == ["prefill-0", "decode-0", "router"]
    decode = plan["processes"][1]
    assert [r["title"] for r in decode["ranks"]] == [
        "pdctl:cpu-p1d2-tcp:decode:tp0",
        "pdctl:cpu-p1d2-tcp:decode:tp1",
    ]
    assert all(port["allocated_at_launch"] for port in decode["ports"])
    assert {p["name"] for p in decode["ports"]} == {
        "http",
        "dist",
        "transport.tp0",
        "transport.tp1",
    }
    assert decode["command"][1:4] == ["-m", "pdctl.serve", "--role"]
    assert "--staging" in decode["command"]
    secret = next(e for e in decode["env"] if e["name"] == "PDCTL_RUN_SECRET")
    assert secret["secret"] and secret["value"] == "<secret, per run>"
    assert plan["router_url"] == "http://127.0.0.1:<router.http>"


def test_plan_human_output_shows_ports_env_and_commands(cli, make_topology) -> None:
    path = make_topology(env={"FOO": "bar"}, roles={"prefill": {"tp": 1, "port": 31000}})
    result = cli.invoke(app, ["plan", str(path)], env={"FOO": "old", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "--port 31000" in out  # fixed ports appear in the command line
    assert "--port <decode-0.http>" in out  # dynamic ones stay symbolic
    assert "FOO=bar  from env, parent had 'old'" in out
    assert "http=31000" in out and "http=at launch" in out
    assert "serving   deterministic (serving.deterministic): fixed-order kernels" in out
    vendor = cli.invoke(app, ["plan", str(make_topology(serving={"deterministic": False}))])
    assert "serving   deterministic off (serving.deterministic: false)" in vendor.stdout


def test_plan_of_a_bad_file_exits_2_without_traceback(cli) -> None:
    result = cli.invoke(app, ["plan", str(BAD / "port-conflict.yaml")])
    assert result.exit_code == 2
    assert "port 30001 is also used by roles.prefill.bootstrap_port" in result.stderr
    assert "Traceback" not in result.output


def test_unknown_command_and_option_are_usage_errors(cli) -> None:
    assert cli.invoke(app, ["frobnicate"]).exit_code == 2
    assert cli.invoke(app, ["plan", str(DEFAULT), "--frob"]).exit_code == 2


@pytest.mark.parametrize(
    "command", [["schema"], ["plan", "--json", "topologies/cpu-p1d2-tcp.yaml"]]
)
def test_a_reader_that_goes_away_ends_pdctl_quietly(command: list[str]) -> None:
    """`pdctl ... | head`: the pipe's read end is closed before pdctl writes, so its first
    write fails; it exits 141 (as a shell reports SIGPIPE) and prints no internal error."""
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "pdctl", *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before the first write
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141, stderr
    assert stderr == "", stderr
