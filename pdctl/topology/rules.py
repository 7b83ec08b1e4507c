"""Cross-field rules: what each key may be, given the others.

Each rule takes a validated `Topology` and yields `Issue`s that point at the key the
user should change, with a hint. Rules never raise and never mutate; the loader
collects every issue so a user sees all problems at once.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from pdctl.core import MODEL_PRESETS, ModelShape, read_checkpoint_shape
from pdctl.topology.env_rules import env_rules, transfer_rules
from pdctl.topology.issues import Issue, RuleContext
from pdctl.topology.model import Topology
from pdctl.topology.resolve import assign_devices, requirements

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


Rule = Callable[[Topology, RuleContext], Iterable[Issue]]


def model_path(topology: Topology, context: RuleContext) -> Path | None:
    """model.path as this machine reads it: `~` expanded, relative to the topology file."""
    if topology.model.path is None:
        return None
    return context.base_dir / Path(topology.model.path).expanduser()


def model_shape(topology: Topology, context: RuleContext) -> tuple[ModelShape | None, str]:
    """The model's shape when it can be known here, and how to name the model."""
    if topology.model.uses_preset:
        return MODEL_PRESETS[topology.model.preset], f"the {topology.model.preset} preset"
    path = model_path(topology, context)
    try:
        return read_checkpoint_shape(path), f"the checkpoint {topology.model.path}"  # type: ignore[arg-type]
    except (OSError, ValueError):
        return None, f"the checkpoint {topology.model.path}"


def check_model(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    """One way to name the model. Whether a checkpoint is one the engine runs, or a hub
    id it resolves, is the engine's (`Engine.model_issues`)."""
    if topology.model.path is not None and "preset" in topology.model.model_fields_set:
        yield Issue(("model", "path"), "set either model.preset or model.path, not both")


def check_tp(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    shape, what = model_shape(topology, context)
    if shape is None:
        return
    for role, spec in topology.roles.items():
        if role == "encoder":  # the embedded encoder model has its own heads
            continue  # the engine's own rules (`Engine.check`) know its encoder
        problem = shape.tp_problem(spec.tp)
        if problem:
            sizes = ", ".join(str(tp) for tp in shape.valid_tp_sizes(16))
            yield Issue(
                ("roles", role, "tp"),
                f"{problem} ({what})",
                f"TP sizes that work with this model: {sizes}",
            )


def check_devices(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    explicit_count = topology.requires.device_count
    for role, spec in topology.roles.items():
        if spec.devices is None:
            continue
        where = ("roles", role, "devices")
        if topology.device == "cpu":
            yield Issue(where, "is ignored on cpu: every rank runs on the CPU", severity="warning")
            continue
        needed = spec.tp * spec.replicas
        if len(spec.devices) != needed:
            yield Issue(
                where,
                f"lists {len(spec.devices)} device(s) but tp {spec.tp} x replicas "
                f"{spec.replicas} needs {needed}",
                "give one device index per rank, or remove devices to assign them in order",
            )
        seen: set[int] = set()
        for position, index in enumerate(spec.devices):
            if index in seen and not spec.share_devices:
                yield Issue(
                    (*where, position),
                    f"device {index} is listed twice; each rank of {role} needs its own device",
                    f"to run several ranks on one device on purpose, set "
                    f"roles.{role}.share_devices: true",
                )
            seen.add(index)
            if explicit_count is not None and index >= explicit_count:
                yield Issue(
                    (*where, position),
                    f"device {index} does not exist when requires.device_count is "
                    f"{explicit_count} (indices 0..{explicit_count - 1})",
                )
    yield from _shared_device_issues(topology)
    if topology.device == "cpu" or explicit_count is None:
        return
    assigned = assign_devices(topology)
    derived = [
        index
        for role, spec in topology.roles.items()
        if spec.devices is None
        for group in assigned[role]
        for index in group
    ]
    if derived and max(derived) >= explicit_count:
        yield Issue(
            ("requires", "device_count"),
            f"roles without devices are assigned indices up to {max(derived)}, but "
            f"device_count is {explicit_count}",
            "raise device_count, or set roles.<role>.devices so that roles share devices",
        )


def _shared_device_issues(topology: Topology) -> Iterator[Issue]:
    for role, spec in topology.roles.items():
        if not spec.share_devices:
            continue
        where = ("roles", role, "share_devices")
        if topology.device == "cpu":
            yield Issue(
                where, "has no effect on cpu: every rank runs on the CPU", severity="warning"
            )
        elif spec.devices is None or len(set(spec.devices)) == len(spec.devices):
            yield Issue(
                where,
                f"no device of {role} is shared: list a device more than once in "
                f"roles.{role}.devices (e.g. [0, 0])",
                severity="warning",
            )


def check_ports(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    fixed: list[tuple[tuple[str, ...], int]] = []
    for role, spec in topology.roles.items():
        if spec.port is not None:
            fixed.append((("roles", role, "port"), spec.port))
        bootstrap = getattr(spec, "bootstrap_port", None)
        if bootstrap is not None:
            fixed.append((("roles", role, "bootstrap_port"), bootstrap))
        if spec.replicas > 1:
            for key in ("port", "bootstrap_port"):
                if getattr(spec, key, None) is not None:
                    yield Issue(
                        ("roles", role, key),
                        f"a fixed port cannot serve {spec.replicas} replicas",
                        "remove it so that each replica gets a port at launch",
                    )
    if topology.router.port is not None:
        fixed.append((("router", "port"), topology.router.port))
    owners: dict[int, tuple[str, ...]] = {}
    for path, port in fixed:
        if port in owners:
            yield Issue(path, f"port {port} is also used by {'.'.join(owners[port])}")
        owners.setdefault(port, path)
        if port < 1024:
            yield Issue(
                path, f"port {port} is privileged; binding it needs root", severity="warning"
            )


def check_serving(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    serving = topology.serving
    if serving.chunked_prefill_tokens % serving.page_size:
        yield Issue(
            ("serving", "chunked_prefill_tokens"),
            f"{serving.chunked_prefill_tokens} is not a multiple of serving.page_size "
            f"({serving.page_size})",
            "prefill chunks end on page boundaries",
        )
    pools: list[tuple[tuple[str, ...], int | None]] = [
        (("serving", "kv_pool_tokens"), serving.kv_pool_tokens)
    ]
    pools += [
        (("roles", name, "kv_pool_tokens"), r.kv_pool_tokens) for name, r in topology.roles.items()
    ]
    for where, pool in pools:
        if pool is not None and pool < serving.chunked_prefill_tokens:
            yield Issue(
                where,
                f"{pool} tokens cannot hold one prefill chunk of {serving.chunked_prefill_tokens}",
            )


def check_staging_fits(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    staging = topology.transfer.staging
    if staging.segment_size_mb is not None and staging.segment_size_mb > staging.pool_size_mb:
        yield Issue(
            ("transfer", "staging", "segment_size_mb"),
            f"{staging.segment_size_mb:g} MiB is larger than the pool "
            f"({staging.pool_size_mb:g} MiB)",
            "a segment must fit in the decode ring",
        )
    if "enabled" in staging.model_fields_set and staging.enabled and not topology.uses_staging:
        yield Issue(
            ("transfer", "staging", "enabled"),
            f"staging is unused: prefill and decode both run TP {topology.roles.decode.tp}, "
            "so pages go directly",
            severity="warning",
        )
    shape, _ = model_shape(topology, context)
    if shape is None or not topology.uses_staging:
        return
    decode_tp = topology.roles.decode.tp
    heads = max(1, shape.num_kv_heads // decode_tp)
    dtype_bytes = DTYPE_BYTES[topology.effective_dtype]
    page_bytes = 2 * shape.num_layers * heads * shape.head_dim * dtype_bytes
    page_bytes *= topology.serving.page_size
    segment_bytes = staging.effective_segment_mb * 2**20
    if segment_bytes < page_bytes:
        key = "segment_size_mb" if staging.segment_size_mb is not None else "pool_size_mb"
        yield Issue(
            ("transfer", "staging", key),
            f"a segment of {segment_bytes / 1024:.0f} KiB cannot hold one KV page of a decode "
            f"rank ({page_bytes / 1024:.0f} KiB: {shape.num_layers} layers x K,V x {heads} "
            f"heads x {shape.head_dim} x {dtype_bytes} B x page {topology.serving.page_size})",
            "raise the size or lower serving.page_size",
        )


def check_roles(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    verify = topology.verify
    if verify.concurrency > verify.num_prompts:
        yield Issue(
            ("verify", "concurrency"),
            f"{verify.concurrency} exceeds verify.num_prompts ({verify.num_prompts}); "
            "only that many requests run at once",
            severity="warning",
        )


def check_host(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    host = topology.host
    if host == "localhost":
        return
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        yield Issue(("host",), f"'{host}' is not an IP address", "use 127.0.0.1 or this host's IP")
        return
    if not address.is_loopback:
        yield Issue(
            ("host",),
            f"listeners bind {host}, reachable from the network",
            "bootstrap and control endpoints need the per-run secret; the model API does not",
            severity="warning",
        )


def check_requirements(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    backend = topology.transfer.backend
    for position, capability in enumerate(topology.requires.capabilities):
        family = capability.split(".")[0]
        if family in ("mooncake", "nixl") and family != backend:
            yield Issue(
                ("requires", "capabilities", position),
                f"{capability} is required but transfer.backend is {backend}",
                severity="warning",
            )
    requirements(topology)  # derivation must not fail on any valid topology


def check_faults(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    """Faults must have something to act on (the engine's rules say whether it can act)."""
    for index, fault in enumerate(topology.faults):
        where = ("faults", index)
        needs_encoder = fault.name == "corrupt-embedding" or (
            fault.name == "kill-role" and fault.role == "encoder"
        )
        if needs_encoder and topology.roles.encoder is None:
            yield Issue((*where, "name"), f"{fault.name} needs an encoder role")
        if fault.name == "drop-scatter" and not topology.uses_staging:
            yield Issue(
                (*where, "name"),
                "drop-scatter needs staging (prefill TP differs from decode TP, staging on)",
                "with equal TP the pages go directly and there is no scatter to drop",
            )


def check_launcher(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    """Ray's keys mean nothing to the local launcher; roles pinned must exist."""
    launcher = topology.launcher
    if launcher.kind == "local":
        ray_keys: tuple[tuple[str, object], ...] = (
            ("address", "auto"),
            ("placement", "spread"),
            ("resources", {}),
        )
        for key, default in ray_keys:
            if getattr(launcher, key) != default:
                yield Issue(
                    ("launcher", key),
                    f"launcher.{key} applies to kind: ray, not local",
                    "set launcher.kind: ray, or remove the key",
                )
    for role in launcher.resources:
        if role != "router" and getattr(topology.roles, role, None) is None:
            yield Issue(("launcher", "resources", role), f"there is no {role} role to place")


RULES: tuple[Rule, ...] = (
    check_model,
    check_tp,
    check_devices,
    check_ports,
    check_serving,
    check_staging_fits,
    check_roles,
    check_host,
    check_requirements,
    transfer_rules,
    env_rules,
    check_faults,
    check_launcher,
)


def run_rules(topology: Topology, context: RuleContext) -> list[Issue]:
    return [issue for rule in RULES for issue in rule(topology, context)]
