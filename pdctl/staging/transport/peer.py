"""A stand-alone transport peer process, for cross-process tests and benchmarks.

    python -m pdctl.staging.transport.peer --backend tcp --size BYTES [--device cpu]

Registers one receive buffer, prints one JSON line {description, base, pid}, then
answers JSON commands read from stdin, one line each:

    {"cmd": "digest", "offset": o, "length": n}      -> {"sha256": hex}
    {"cmd": "wait", "message": hex, "timeout": s}    -> {"peer": name} or {"error": text}
    {"cmd": "fill", "value": v}                      -> {"ok": true}
    {"cmd": "exit"}                                  -> exits

The per-run secret comes from the environment (`settings.RUN_SECRET_VAR`), never argv.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
from typing import TypedDict

import torch

from pdctl.staging.settings import RUN_SECRET_VAR, run_secret
from pdctl.staging.transport import TransportConfig, TransportError, create_transport


class Hello(TypedDict):
    """The peer's first line: how to reach it, where its buffer starts, its process."""

    description: str  # the transport's description, base64
    base: int
    pid: int


class Command(TypedDict, total=False):
    """One command line (see the module docstring)."""

    cmd: str
    offset: int  # digest
    length: int  # digest
    message: str  # wait: the notification, hex
    timeout: float  # wait
    value: int  # fill


class Reply(TypedDict, total=False):
    """The answer to one command: one of these keys."""

    sha256: str
    peer: str
    error: str
    ok: bool


def run(args: argparse.Namespace) -> None:
    # The protocol owns the original stdout; libraries that print (NIXL logs to stdout)
    # are sent to stderr instead, so they cannot corrupt a reply.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    secret = run_secret(os.environ)
    config = TransportConfig(
        args.name,
        port=args.port,
        secret=secret,
        transfer_timeout_s=args.timeout,
        same_host_fast_path=not args.no_fast_path,
    )
    transport = create_transport(args.backend, config)
    buffer = torch.zeros(args.size, dtype=torch.uint8, device=args.device)  # [size], pages touched
    transport.register_tensor(buffer)
    base = buffer.data_ptr()
    description = base64.b64encode(transport.describe()).decode()
    hello = Hello(description=description, base=base, pid=os.getpid())
    print(json.dumps(hello), file=protocol, flush=True)
    for line in sys.stdin:
        command: Command = json.loads(line)
        kind = command.get("cmd")
        if kind == "exit":
            break
        reply: Reply
        if kind == "digest":
            start, length = int(command["offset"]), int(command["length"])
            data = buffer[start : start + length].cpu().numpy().tobytes()
            reply = {"sha256": hashlib.sha256(data).hexdigest()}
        elif kind == "wait":
            try:
                found = transport.wait_notification(
                    bytes.fromhex(command["message"]), float(command["timeout"])
                )
                reply = {"peer": found.peer}
            except TransportError as exc:
                reply = {"error": str(exc)}
        elif kind == "fill":
            buffer.fill_(int(command["value"]))
            reply = {"ok": True}
        else:
            reply = {"error": f"unknown command {kind!r}"}
        print(json.dumps(reply), file=protocol, flush=True)
    transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="a transport peer for tests and benchmarks")
    parser.add_argument("--backend", required=True, choices=["tcp", "mooncake", "nixl"])
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--name", default="peer")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--no-fast-path", action="store_true")
    run(parser.parse_args())


if __name__ == "__main__":
    main()


class PeerProcess:
    """Spawns `peer.py` and talks to it; every read is bounded; the process group is ours."""

    def __init__(
        self,
        backend: str,
        size: int,
        *,
        device: str = "cpu",
        name: str = "peer",
        fast_path: bool = True,
        secret: bytes = b"",
        timeout: float = 30.0,
        start_timeout: float = 60.0,
    ) -> None:
        import subprocess
        import tempfile

        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        argv = [sys.executable, "-m", "pdctl.staging.transport.peer", "--backend", backend]
        argv += ["--size", str(size), "--device", device, "--name", name, "--timeout", str(timeout)]
        if not fast_path:
            argv.append("--no-fast-path")
        env = {**os.environ, RUN_SECRET_VAR: secret.decode()}
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(
            argv, stdin=pipe, stdout=pipe, stderr=self.log, env=env, start_new_session=True
        )
        self._pending = b""
        hello: Hello = json.loads(self._line(start_timeout))
        self.description = base64.b64decode(hello["description"])
        self.base = int(hello["base"])
        self.pid = int(hello["pid"])

    def _line(self, timeout: float) -> bytes:
        """The peer's next line, waited for at most `timeout` seconds."""
        import select
        import time

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"the transport peer said nothing for {timeout:g} s; {self.stderr_tail()}"
                )
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise ConnectionError(f"the transport peer exited; {self.stderr_tail()}")
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def stderr_tail(self, size: int = 2000) -> str:
        self.log.seek(0)
        text = self.log.read().decode(errors="replace")
        return "its stderr ends: " + text[-size:]

    def command(self, read_timeout: float = 60.0, **command: object) -> Reply:
        """Send one command (its keys as keywords: `Command`); its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()
        reply: Reply = json.loads(self._line(read_timeout))
        return reply

    def sha256(self, offset: int, length: int) -> str:
        return str(self.command(cmd="digest", offset=offset, length=length)["sha256"])

    def wait_notification(self, message: bytes, timeout: float) -> Reply:
        return self.command(timeout + 10, cmd="wait", message=message.hex(), timeout=timeout)

    def kill(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.log.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
