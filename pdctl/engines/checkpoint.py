"""What an engine asks of `model.path`: a checkpoint it can read, or a name it resolves.

The topology's rules read the model's shape wherever one can be read (TP sizes); which
checkpoints an engine runs, and whether a path that names nothing on this machine is a
Hugging Face hub id, is the engine's to say (`Engine.model_issues`). Messages name the
path as the topology wrote it; `ModelPath.local` is where this machine reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pdctl.core import CheckpointRefused
from pdctl.topology.issues import Issue

KEY = ("model", "path")


@dataclass(frozen=True)
class ModelPath:
    """model.path twice: as written in the topology, and as this machine reads it
    (`~` expanded, relative to the topology file's folder)."""

    written: str
    local: Path


def checkpoint_issues(
    model: ModelPath, read: Callable[[Path], object], refused_hint: str | None = None
) -> Iterator[Issue]:
    """A local checkpoint `read` must accept: a folder holding a usable config.json. A
    folder that is not there is a warning (`pdctl up` fails where it is missing)."""
    written = model.written
    if not model.local.is_dir():
        yield Issue(
            KEY,
            f"checkpoint directory '{model.local}' does not exist on this machine",
            "`pdctl up` will fail here; paths are relative to the topology file",
            severity="warning",
        )
        return
    try:
        read(model.local)
    except CheckpointRefused as exc:
        yield Issue(KEY, f"'{written}/config.json': {exc}", refused_hint)
    except FileNotFoundError:
        yield Issue(
            KEY,
            f"'{written}' has no config.json, so it is not a Hugging Face checkpoint",
            "point model.path at the directory holding config.json and *.safetensors",
        )
    except OSError as exc:
        yield Issue(KEY, f"cannot read '{written}/config.json': {exc.strerror}")
    except ValueError as exc:
        yield Issue(KEY, f"'{written}/config.json' is not a usable config: {exc}")
