"""What an engine's own environment holds, asked of its interpreter in a child process.

vLLM and SGLang live in environments of their own (`engine_python`), not in pdctl's:
whether their modules are there, which versions are installed, and whether the KV
connector imports can only be learnt by that interpreter. `probe` runs it once with
a small script on stdin (nothing of pdctl is imported there) and reads one JSON line
back: `find_spec` for modules (cheap: nothing is imported), `importlib.metadata` for
versions, a real import for the connector (seconds; `pdctl doctor` only).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TypedDict

# A module pdctl names -> the import names that provide it (NIXL ships per CUDA major).
ALIASES: dict[str, tuple[str, ...]] = {"nixl": ("nixl", "nixl_cu12", "nixl_cu13")}

SCRIPT = r"""
import importlib, importlib.metadata, importlib.util, json, platform, sys
spec = json.loads(sys.stdin.read())
def found(names):
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            pass
    return False
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
def imported(target):
    module, _, attr = target.partition(":")
    try:
        loaded = importlib.import_module(module)
        if attr:
            getattr(loaded, attr)
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    return None
print(json.dumps({
    "python": platform.python_version(),
    "executable": sys.executable,
    "modules": {m: found(names) for m, names in spec["modules"].items()},
    "versions": {d: version(d) for d in spec["distributions"]},
    "imports": {t: imported(t) for t in spec["imports"]},
}))
"""


class EngineEnvJson(TypedDict):
    python: str
    python_version: str | None
    modules: dict[str, bool]
    versions: dict[str, str | None]
    imports: dict[str, str | None]
    error: str | None


@dataclass(frozen=True)
class EngineEnv:
    """What the interpreter said (or why it could not be asked: `error`)."""

    python: str
    version: str | None = None
    modules: dict[str, bool] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)
    imports: dict[str, str | None] = field(default_factory=dict)  # target -> error, or None
    error: str | None = None

    def to_json(self) -> EngineEnvJson:
        return {
            "python": self.python,
            "python_version": self.version,
            "modules": self.modules,
            "versions": self.versions,
            "imports": self.imports,
            "error": self.error,
        }


@lru_cache(maxsize=16)
def probe(
    python: str,
    modules: tuple[str, ...],
    distributions: tuple[str, ...] = (),
    imports: tuple[str, ...] = (),
    timeout: float = 120.0,
) -> EngineEnv:
    spec = {
        "modules": {m: list(ALIASES.get(m, (m,))) for m in modules},
        "distributions": list(distributions),
        "imports": list(imports),
    }
    try:
        done = subprocess.run(
            [python, "-c", SCRIPT],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        return EngineEnv(python, error=f"{python} does not exist")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return EngineEnv(python, error=f"{python} could not be asked: {exc}")
    try:
        data = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return EngineEnv(
            python, error=f"{python} failed (exit {done.returncode}): " + " | ".join(tail)
        )
    return EngineEnv(
        python,
        version=data.get("python"),
        modules=data.get("modules", {}),
        versions=data.get("versions", {}),
        imports=data.get("imports", {}),
    )
