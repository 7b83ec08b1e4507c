"""The pdctl command line: mounts one module per command and the global flags."""

from __future__ import annotations

from typing import Annotated

import typer

from pdctl import __version__
from pdctl.cli.bench import bench_app
from pdctl.cli.bench_soak import soak
from pdctl.cli.common import JsonOption, Options, PdctlGroup, QuietOption, VerboseOption, options
from pdctl.cli.doctor import doctor
from pdctl.cli.down import down
from pdctl.cli.logs import logs
from pdctl.cli.nightly import nightly
from pdctl.cli.plan import plan
from pdctl.cli.schema import schema
from pdctl.cli.status import status
from pdctl.cli.up import up
from pdctl.cli.validate import validate
from pdctl.cli.verify import verify

app = typer.Typer(
    cls=PdctlGroup,
    name="pdctl",
    help="Bring up, verify and benchmark prefill/decode disaggregated LLM-serving topologies.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pdctl {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    ctx: typer.Context,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Global flags apply to every command."""
    ctx.obj = Options()
    options(ctx, json, verbose, quiet)


app.command()(validate)
app.command()(schema)
app.command()(plan)
app.command()(up)
app.command()(status)
app.command()(logs)
app.command()(down)
app.command()(verify)
app.command()(nightly)
app.command()(doctor)
bench_app.command("soak")(soak)
app.add_typer(bench_app, name="bench")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
