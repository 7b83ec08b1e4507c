"""`pdctl schema`: the topology JSON Schema on stdout, for editors and CI linters."""

from __future__ import annotations

import typer

from pdctl import console
from pdctl.topology.schema import topology_json_schema


def schema(ctx: typer.Context) -> None:
    """Print the JSON Schema of topology files."""
    console.emit_json(topology_json_schema())
