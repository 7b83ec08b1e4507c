"""The typed topology: what a YAML file may say, with defaults and per-field checks.

Parsed once at the edge (`topology.load`) and passed down as a frozen value. Unknown
keys are errors (`extra="forbid"`) and types are strict (YAML `tp: "2"` is not an
integer). Rules that relate several fields live in `rules.py`, so each can point at
the key the user has to change; derived values (devices, ports, environment) are
computed by `resolve.py`, never stored back here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from pdctl.core import DeviceType
from pdctl.topology.source import kind_of

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

Backend = Literal["tcp", "mooncake", "nixl"]
Capability = Literal["mooncake.tent", "mooncake.rdma", "nixl.ucx", "nixl.libfabric", "triton"]
CAPABILITIES: tuple[str, ...] = Capability.__args__  # type: ignore[attr-defined]


def _text(value: Any) -> str:
    """A scalar that becomes text: environment values and extra arguments.

    YAML reads `1` as an integer and `on`/`yes` as booleans; numbers become their
    text, booleans are refused because their spelling is lost.
    """
    if isinstance(value, bool):
        raise PydanticCustomError(
            "pdctl",
            "the value is read as a boolean; write it as text",
            {"hint": "quote it, for example '1' or 'true' (YAML reads yes/no/on/off as booleans)"},
        )
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        if "\x00" in value:
            raise PydanticCustomError("pdctl", "contains a NUL character", {})
        return value
    raise PydanticCustomError(
        "pdctl", "the value must be text or a number, not {kind}", {"kind": kind_of(value)}
    )


def _env_name(name: str) -> str:
    if not ENV_NAME.match(name):
        raise PydanticCustomError(
            "pdctl",
            "'{name}' is not a valid environment variable name",
            {
                "name": name,
                "hint": "use letters, digits and underscores, not starting with a digit",
            },
        )
    return name


Text = Annotated[str, BeforeValidator(_text)]
EnvName = Annotated[str, AfterValidator(_env_name)]
EnvMap = dict[EnvName, Text]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, le=86_400)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSpec(Strict):
    """Which model the servers run. Either a built-in preset or a checkpoint path."""

    preset: Literal["tiny", "small"] = Field(
        "tiny",
        description="Built-in deterministic model: pdctl's servers draw its weights from the "
        "seed; engine vllm serves the same weights, written once as a Hugging Face Llama "
        "checkpoint under launcher.run_dir/models.",
    )
    path: str | None = Field(
        None,
        description="Local Hugging Face checkpoint directory (config.json + *.safetensors), "
        "relative to the topology file; the embedded engine serves Llama (Llama 3.x RoPE "
        "scaling included), Qwen2, Qwen3 and Mistral; for engines sglang and vllm also a hub "
        "id.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: float32 on cpu, bfloat16 on accelerators."
    )
    seed: int = Field(0, ge=0, description="Seed of the preset weights and of sampling.")

    @property
    def uses_preset(self) -> bool:
        return self.path is None


class RoleSpec(Strict):
    """One server role: its tensor parallelism, devices, replicas and overrides."""

    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel size of each replica.")
    devices: list[Annotated[int, Field(ge=0, le=1023)]] | None = Field(
        None,
        description="Physical device indices, tp x replicas of them (replica r takes the r-th "
        "group of tp). Omitted: assigned in order after the previous roles. Ignored on cpu.",
    )
    replicas: int = Field(1, ge=1, le=64, description="Independent servers of this role.")
    env: EnvMap = Field(default_factory=dict, description="Environment overrides of this role.")
    args: list[Text] = Field(
        default_factory=list, description="Extra engine arguments appended to the command."
    )
    port: Port | None = Field(None, description="Fixed HTTP port; allocated at launch if unset.")
    kv_pool_tokens: int | None = Field(
        None,
        ge=1,
        description="This role's KV pool in tokens per server, where it differs from "
        "serving.kv_pool_tokens (e.g. a decode pool so small that a freed page goes out "
        "again at once); embedded engine only.",
    )
    share_devices: bool = Field(
        False,
        description="Let ranks of this role share a device (devices may repeat, e.g. [0, 0]); "
        "its TP collectives then go over gloo through host memory. For trying a TP layout on "
        "fewer devices; embedded engine only.",
    )


class PrefillRole(RoleSpec):
    bootstrap_port: Port | None = Field(
        None, description="Fixed port of the bootstrap endpoint; allocated at launch if unset."
    )


class Roles(Strict):
    """The servers of the topology, by role."""

    prefill: PrefillRole = Field(description="Runs prompts and sends their KV (required).")
    decode: RoleSpec = Field(description="Receives KV and generates tokens (required).")
    encoder: RoleSpec | None = Field(None, description="Optional encoder role (EPD).")

    def items(self) -> list[tuple[str, RoleSpec]]:
        """Roles present, in launch order."""
        present: list[tuple[str, RoleSpec | None]] = [
            ("encoder", self.encoder),
            ("prefill", self.prefill),
            ("decode", self.decode),
        ]
        return [(name, spec) for name, spec in present if spec is not None]


class StagingSpec(Strict):
    """Staging: gather each decode rank's head slice into one buffer per transfer."""

    enabled: bool = Field(True, description="Use staging when prefill TP differs from decode TP.")
    pool_size_mb: float = Field(
        64, gt=0, le=1_048_576, description="Decode-side ring buffer per rank, in MiB."
    )
    segment_size_mb: float | None = Field(
        None,
        gt=0,
        le=1_048_576,
        description="Largest single write, in MiB; a bigger request goes in segments. "
        "Default: a quarter of the pool.",
    )

    @property
    def effective_segment_mb(self) -> float:
        return self.segment_size_mb if self.segment_size_mb is not None else self.pool_size_mb / 4


class TimeoutsSpec(Strict):
    """Bounds on every wait; a dead peer becomes an error naming it, never a hang."""

    connect_s: Seconds = Field(10, description="Connecting to a transport peer.")
    bootstrap_s: Seconds = Field(30, description="Waiting for every decode rank to register.")
    transfer_s: Seconds = Field(30, description="One KV transfer, from first write to notice.")
    request_s: Seconds = Field(120, description="One request through the router.")


class TransferSpec(Strict):
    """How KV cache moves from prefill to decode."""

    backend: Backend = Field("tcp", description="tcp (builtin), mooncake or nixl.")
    protocol: Literal["tcp", "rdma"] | None = Field(
        None, description="Mooncake only: tcp (default) or rdma."
    )
    ib_devices: list[str] = Field(
        default_factory=list, description="Mooncake rdma only: RDMA device names (mlx5_0, ...)."
    )
    nixl_backend: Literal["UCX", "LIBFABRIC"] | None = Field(
        None, description="NIXL only: the NIXL plugin (default UCX)."
    )
    staging: StagingSpec = Field(default_factory=StagingSpec, description="Staging buffers.")
    timeouts: TimeoutsSpec = Field(
        default_factory=TimeoutsSpec, description="Every wait is bounded by one of these."
    )

    @property
    def effective_protocol(self) -> str:
        return self.protocol or "tcp"


def _kind_shorthand(value: Any) -> Any:
    """`router: sglang-router` is short for `router: {kind: sglang-router}`."""
    return {"kind": value} if isinstance(value, str) else value


class RouterSpec(Strict):
    """The router clients talk to; `router: KIND` is short for `router: {kind: KIND}`."""

    kind: Literal["builtin", "sglang-router", "vllm-router"] = Field(
        "builtin",
        description="pdctl's router, the real sglang-router, or the real vllm-router (engine "
        "vllm; found beside engine_python).",
    )
    port: Port | None = Field(None, description="Fixed port; allocated at launch if unset.")
    env: EnvMap = Field(default_factory=dict, description="Environment overrides of the router.")
    args: list[Text] = Field(
        default_factory=list, description="Extra router arguments appended to the command."
    )


class LauncherSpec(Strict):
    """Where and how processes start; `launcher: KIND` is short for `{kind: KIND}`."""

    kind: Literal["local", "ray"] = Field(
        "local", description="local: this host; ray: the nodes of a Ray cluster."
    )
    startup_timeout_s: Seconds = Field(120, description="Until every process is ready.")
    run_dir: str = Field("runs", description="Logs and run state, relative to the working dir.")
    address: str = Field(
        "auto",
        max_length=300,
        description="ray: auto (RAY_ADDRESS or the cluster started on this host), local "
        "(start one here), host:port of the GCS, or ray://host:port.",
    )
    placement: Literal["spread", "pack"] = Field(
        "spread", description="ray: spread the servers across nodes, or pack them together."
    )
    resources: dict[
        Annotated[str, Field(pattern=r"^(prefill|decode|encoder|router)$")],
        dict[Annotated[str, Field(min_length=1, max_length=100)], Annotated[float, Field(gt=0)]],
    ] = Field(
        default_factory=dict,
        description="ray: Ray resources each server of a role needs, which picks its node "
        "(e.g. {prefill: {node-a: 0.01}} or {decode: {GPU: 2}}).",
    )


class ServingSpec(Strict):
    """Engine settings shared by every role; the engines map them to their flags."""

    page_size: int = Field(16, ge=1, le=1024, description="Tokens per KV page.")
    max_running_requests: int = Field(32, ge=1, le=65_536, description="Decode batch limit.")
    chunked_prefill_tokens: int = Field(512, ge=1, le=1_048_576, description="Prefill chunk.")
    kv_pool_tokens: int | None = Field(
        None, ge=1, description="KV pool size in tokens per server; derived if unset."
    )
    overlap: bool = Field(True, description="Schedule the next batch while one runs.")
    max_model_len: int | None = Field(
        None,
        ge=1,
        le=16_777_216,
        description="Longest prompt plus answer a server takes (vllm: --max-model-len, sglang: "
        "--context-length); default: the model's.",
    )
    args: list[Text] = Field(
        default_factory=list,
        description="Extra engine arguments for every server of the topology, the colocated "
        "reference included (roles.<role>.args reach that role's servers only).",
    )
    deterministic: bool = Field(
        True,
        description="Batch-invariant serving: the same tokens whatever the batch, chunking, "
        "prefix hit or TP split (embedded: fixed-order kernels, Triton products on CUDA and "
        "XPU, one thread on cpu; sglang: --enable-deterministic-inference; vllm: "
        "VLLM_BATCH_INVARIANT=1 on cuda and xpu, refused on cpu where vLLM 0.32 fails its "
        "first request with it). false: the vendor fast path, and verify reports engine "
        "numerics without failing on them.",
    )


class RequiresSpec(Strict):
    """What this machine must have; unmet requirements make the topology skip."""

    device_count: int | None = Field(
        None, ge=0, le=1024, description="Devices of the topology's type; derived if unset."
    )
    min_free_memory_gb: float | None = Field(None, gt=0, description="Free memory per device.")
    modules: list[Annotated[str, Field(pattern=MODULE_NAME)]] = Field(
        default_factory=list, description="Importable Python modules (mooncake.engine, nixl)."
    )
    capabilities: list[Capability] = Field(
        default_factory=list, description="Capabilities reported by `pdctl doctor`."
    )


class VerifySpec(Strict):
    """Defaults of `pdctl verify` for this topology; command-line flags override them."""

    num_prompts: int = Field(12, ge=1, le=100_000, description="Prompts in the workload.")
    concurrency: int = Field(8, ge=1, le=4096, description="Requests in flight at once.")
    max_new_tokens: int = Field(16, ge=1, le=65_536, description="Tokens generated per prompt.")
    prefix_hit: bool = Field(True, description="Run the radix-cache prefix-hit pass.")
    reference: bool = Field(False, description="Compare with a colocated reference server.")
    seed: int = Field(0, ge=0, description="Seed of the workload.")


FaultName = Literal[
    "corrupt-kv",
    "drop-scatter",
    "delay-transfer",
    "kill-role",
    "corrupt-embedding",
    "perturb-prefix-hit",
    "abort-transfer",
]
FAULT_NAMES: tuple[str, ...] = FaultName.__args__  # type: ignore[attr-defined]


def _fault_shorthand(value: Any) -> Any:
    """`- corrupt-kv` is short for `- {name: corrupt-kv}`."""
    return {"name": value} if isinstance(value, str) else value


class FaultSpec(Strict):
    """A fault the servers inject on purpose, to prove `pdctl verify` catches it."""

    name: FaultName = Field(
        description="corrupt-kv: flip KV bytes after prefill digested them; drop-scatter: "
        "decode skips a scatter; delay-transfer: prefill waits past the transfer timeout; "
        "kill-role: a role dies after some requests; corrupt-embedding: encoder only; "
        "perturb-prefix-hit: every server computing a prompt on a radix-cache hit picks its "
        "second-best first token (an engine not invariant to a prefix hit: the colocated "
        "reference has it too, so it is engine numerics, not PD); abort-transfer: decode "
        "aborts a room (as a client gone, or as a failed receive) while prefill's write "
        "to it is in flight, and the write lands after decode gave up."
    )
    every: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="Every Nth transfer (1: all); abort-transfer: one room in N, by its id.",
    )
    after: int = Field(
        3,
        ge=0,
        le=1_000_000,
        description="kill-role: die once this many requests finished; abort-transfer: "
        "abort no room among the first this many.",
    )
    role: Literal["prefill", "decode", "encoder", "router"] = Field(
        "decode", description="kill-role: which role dies."
    )
    seconds: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="delay-transfer: how long (default: past the timeout); "
        "abort-transfer: how long after the abort the write lands (default 0.1).",
    )


class Topology(Strict):
    """A prefill/decode serving topology: roles, transfer, router, checks."""

    model_config = ConfigDict(title="pdctl topology")

    name: str = Field(
        pattern=NAME_PATTERN, description="Used in process titles, run directories and reports."
    )
    description: str = Field("", description="One line for reports and `pdctl plan`.")
    suites: list[Annotated[str, Field(pattern=NAME_PATTERN)]] = Field(
        default_factory=list, description="Tags that select this topology in `pdctl nightly`."
    )
    engine: Literal["embedded", "sglang", "vllm"] = Field(
        "embedded",
        description="embedded: pdctl's own servers; sglang: real SGLang servers; vllm: real "
        "vLLM servers.",
    )
    engine_python: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="The Python interpreter of the engine's own environment (sglang, vllm): a "
        "path (relative to the topology file, ~ expanded) or a command on PATH. Default: "
        "python3 on PATH. The embedded engine always runs in pdctl's interpreter.",
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model every role runs.")
    device: DeviceType = Field("cpu", description="Device type every role runs on.")
    host: str = Field("127.0.0.1", description="Address every listener binds.")
    roles: Roles = Field(description="prefill and decode (required), encoder (optional).")
    transfer: TransferSpec = Field(default_factory=TransferSpec, description="KV transfer.")
    router: Annotated[RouterSpec, BeforeValidator(_kind_shorthand)] = Field(
        default_factory=RouterSpec,
        description="builtin, sglang-router or vllm-router, or a mapping.",
    )
    env: EnvMap = Field(default_factory=dict, description="Environment of every process.")
    requires: RequiresSpec = Field(
        default_factory=RequiresSpec, description="Machine requirements (else: skip)."
    )
    verify: VerifySpec = Field(default_factory=VerifySpec, description="verify defaults.")
    serving: ServingSpec = Field(default_factory=ServingSpec, description="Engine settings.")
    launcher: Annotated[LauncherSpec, BeforeValidator(_kind_shorthand)] = Field(
        default_factory=LauncherSpec, description="local, or a mapping."
    )
    faults: list[Annotated[FaultSpec, BeforeValidator(_fault_shorthand)]] = Field(
        default_factory=list,
        description="Faults injected on purpose (off unless listed here or given with "
        "`pdctl verify --inject`).",
    )

    @property
    def uses_staging(self) -> bool:
        """Staging runs when enabled and the TP layouts differ."""
        return self.transfer.staging.enabled and self.roles.prefill.tp != self.roles.decode.tp

    @property
    def effective_dtype(self) -> str:
        if self.model.dtype != "auto":
            return self.model.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
