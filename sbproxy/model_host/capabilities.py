"""The capability matrix (engines x accelerators x features) and the certification ledger.

Each cell of the matrix is one of:

* ``unsupported`` -- the code refuses it. The matrix finds out by asking the code: it plans a
  launch of a stand-in verified snapshot through the engine's own planner
  (:func:`~sbproxy.model_host.engines.plan_llama_launch`, the vLLM planners) or validates the
  engine configuration (``EnginesConfig``), and records the reason code that comes back
  (``engine_incompatible``, ``unsafe_argument``, ``invalid_config`` ...).
* ``planned`` -- the planner accepts it (the launch plans are covered by the engine tests),
  but no passing live check on that hardware is in the ledger.
* ``live`` -- the certification ledger holds a *passing* entry for that engine on that
  accelerator whose checks include the feature's check (``sbproxy certify`` writes them).

The ledger is ``docs/certification.jsonl`` (one JSON object a line, the machine-readable
twin) next to ``docs/certification.md`` (the same entries for people); both are only ever
appended to (:func:`append_entry`), never rewritten. The matrix reads the JSON twin.

The accelerators are those the device probe can describe a worker as
(:data:`~sbproxy.model_host.runtime.devices.PROBED_ACCELERATORS`); the engines are the two
drivers (``llama_cpp``, ``vllm``).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import ValidationError

from sbproxy.config import EnginesConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import CachedMetadata
from sbproxy.model_host.artifacts.cache import CachedFile
from sbproxy.model_host.engines import LaunchRequest, plan_llama_launch
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.vllm import plan_vllm_container, plan_vllm_uv
from sbproxy.model_host.runtime.devices import PROBED_ACCELERATORS

__all__ = [
    "ENGINES",
    "FEATURES",
    "FEATURE_CHECKS",
    "LEDGER_SCHEMA_VERSION",
    "Cell",
    "CellStatus",
    "LedgerError",
    "accelerators",
    "append_entry",
    "capability_matrix",
    "default_ledger_dir",
    "matrix_markdown",
    "read_ledger",
]

ENGINES: tuple[str, ...] = ("llama_cpp", "vllm")
"""The engine drivers (``sbproxy.model_host.engines``)."""

FEATURES: tuple[str, ...] = ("chat", "streaming", "multi_device", "rpc_split", "container")
"""The matrix's features. ``multi_device`` is tensor parallelism (vLLM) or the llama.cpp
row split across devices; ``rpc_split`` is llama.cpp's RPC split across hosts; the vLLM
"feature" of the issue is the ``vllm`` engine row itself."""

FEATURE_CHECKS: Mapping[str, str] = {
    "chat": "chat",
    "streaming": "stream",
    "multi_device": "multi_device",
    "rpc_split": "rpc_split",
    "container": "container",
}
"""Which ledger check, passing, makes a feature ``live``."""

LEDGER_SCHEMA_VERSION = 1

# A digest no real artifact has: the stand-in snapshot the planners are asked about.
_PROBE_DIGEST = "0" * 64
_PINNED_IMAGE = "example.invalid/vllm@sha256:" + "0" * 64


class CellStatus(StrEnum):
    """What is known of one engine x accelerator x feature combination."""

    LIVE = "live"
    PLANNED = "planned"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix.

    Attributes:
        engine: ``llama_cpp`` or ``vllm``.
        accelerator: ``cpu`` or ``cuda`` (:data:`PROBED_ACCELERATORS`).
        feature: One of :data:`FEATURES`.
        status: See :class:`CellStatus`.
        reason_code: The refusal's reason code (``unsupported`` only).
        detail: The refusal's message, or the ledger entry's date for ``live``.
    """

    engine: str
    accelerator: str
    feature: str
    status: CellStatus
    reason_code: str | None = None
    detail: str | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON view (``sbproxy capabilities --format json``)."""
        return {
            "engine": self.engine,
            "accelerator": self.accelerator,
            "feature": self.feature,
            "status": self.status.value,
            "reason_code": self.reason_code,
            "detail": self.detail,
        }


class LedgerError(SbproxyError):
    """The ledger file cannot be read or appended to (code ``ledger_invalid``)."""

    default_code = "ledger_invalid"
    default_retryable = False


def default_ledger_dir() -> Path:
    """``docs/`` of the checkout this package runs from (where the ledger is committed).

    An installed package has no checkout: there the directory does not exist, the ledger
    reads as empty and no cell is ``live``; pass the checkout's ``docs/`` explicitly.
    """
    return Path(__file__).resolve().parents[2] / "docs"


def accelerators() -> tuple[str, ...]:
    """The matrix's accelerator columns, as the device probe names them."""
    return tuple(accelerator.value for accelerator in PROBED_ACCELERATORS)


def _stand_in(root: Path, fmt: str) -> tuple[Path, CachedMetadata]:
    """A verified snapshot of one empty file in ``fmt`` (the planners check files exist)."""
    name = "model.gguf" if fmt == "gguf" else "model.safetensors"
    snapshot = root / fmt / _PROBE_DIGEST
    snapshot.mkdir(parents=True)
    (snapshot / name).write_bytes(b"")
    metadata = CachedMetadata(
        artifact_digest=_PROBE_DIGEST,
        catalog_revision="capabilities",
        logical_model="capabilities",
        variant_id="capabilities",
        format=fmt,
        quant="none",
        source="capabilities",
        revision="0",
        files=(CachedFile(path=name, size_bytes=0, sha256="0" * 64, blake3="0" * 64),),
        total_size_bytes=0,
        context_length=2048,
        stability="preview",
        pickle_allowed=False,
        created_at_ms=0,
        last_accessed_ms=0,
    )
    return snapshot, metadata


def _devices(accelerator: str, count: int) -> tuple[int, ...]:
    return () if accelerator == "cpu" else tuple(range(count))


def _planner(engine: str, root: Path) -> Callable[..., object]:
    """``plan(accelerator, devices=..., extra_args=..., container=...)`` for ``engine``."""
    snapshot, metadata = _stand_in(root, "gguf" if engine == "llama_cpp" else "safetensors")

    def plan(
        accelerator: str,
        *,
        devices: tuple[int, ...],
        extra_args: tuple[str, ...] = (),
        container: bool = False,
    ) -> object:
        request = LaunchRequest(
            deployment="capabilities",
            generation=1,
            metadata=metadata,
            snapshot=snapshot,
            port=8000,
            ctx_size=2048,
            max_concurrency=1,
            accelerator=accelerator,
            devices=devices,
            extra_args=extra_args,
            # vLLM sizes its memory share from these; any plausible pair plans.
            gpu_memory_bytes=2**30,
            device_memory_bytes=2**34,
        )
        if engine == "llama_cpp":
            if container:
                # The configuration refuses it before any planner is reached.
                EnginesConfig.model_validate(
                    {"llama_cpp": {"launch": "container", "image": _PINNED_IMAGE}}
                )
            return plan_llama_launch(request, executable=Path("/llama-server"))
        if container:
            return plan_vllm_container(request, runtime=Path("/docker"), image=_PINNED_IMAGE)
        return plan_vllm_uv(request, uv=Path("/uv"), version="0.10.0", env_root=root / "uv")

    return plan


def _asked(
    plan: Callable[..., object], accelerator: str, feature: str
) -> tuple[CellStatus, str | None, str | None]:
    try:
        _feature_plan(plan, accelerator, feature)
    except EngineError as exc:
        return CellStatus.UNSUPPORTED, exc.code, exc.message
    except ValidationError as exc:
        # What `sbproxy config check` reports for the same document.
        message = "; ".join(str(error["msg"]) for error in exc.errors())
        return CellStatus.UNSUPPORTED, "invalid_config", message
    return CellStatus.PLANNED, None, None


def _feature_plan(plan: Callable[..., object], accelerator: str, feature: str) -> object:
    """Ask the planner for ``feature`` on ``accelerator`` (raises what the code refuses)."""
    one = _devices(accelerator, 1)
    if feature == "multi_device":
        return plan(accelerator, devices=(0, 1))
    if feature == "rpc_split":
        # llama.cpp's RPC split needs --rpc <host:port>; the launcher would have to accept it.
        return plan(accelerator, devices=one, extra_args=("--rpc",))
    if feature == "container":
        return plan(accelerator, devices=one, container=True)
    # chat and streaming are two kinds of request to the same planned server.
    return plan(accelerator, devices=one)


def _planned_cells(root: Path) -> list[Cell]:
    cells: list[Cell] = []
    for engine in ENGINES:
        plan = _planner(engine, root)
        for accelerator in accelerators():
            for feature in FEATURES:
                status, code, detail = _asked(plan, accelerator, feature)
                cells.append(Cell(engine, accelerator, feature, status, code, detail))
    return cells


def capability_matrix(ledger: Sequence[Mapping[str, object]]) -> list[Cell]:
    """Every cell, in :data:`ENGINES` x :func:`accelerators` x :data:`FEATURES` order.

    Args:
        ledger: The ledger's entries (:func:`read_ledger`); a ``planned`` cell becomes
            ``live`` only when a passing entry for its engine and accelerator has a passing
            check :data:`FEATURE_CHECKS` names for it.

    Returns:
        One :class:`Cell` per combination.
    """
    with tempfile.TemporaryDirectory(prefix="sbproxy-capabilities-") as scratch:
        cells = _planned_cells(Path(scratch))
    return [_with_ledger(cell, ledger) for cell in cells]


def _with_ledger(cell: Cell, ledger: Sequence[Mapping[str, object]]) -> Cell:
    if cell.status is not CellStatus.PLANNED:
        return cell
    wanted = FEATURE_CHECKS[cell.feature]
    for entry in reversed(ledger):
        if (
            entry.get("engine") == cell.engine
            and entry.get("accelerator") == cell.accelerator
            and entry.get("outcome") == "passed"
            and any(
                isinstance(check, Mapping) and check.get("name") == wanted and check.get("ok")
                for check in _sequence(entry.get("checks"))
            )
        ):
            when = str(entry.get("recorded_at", ""))
            return Cell(cell.engine, cell.accelerator, cell.feature, CellStatus.LIVE, None, when)
    return cell


def _sequence(value: object) -> Sequence[object]:
    return value if isinstance(value, list) else []


def read_ledger(path: Path) -> list[dict[str, object]]:
    """The entries of the JSON ledger at ``path``, oldest first (none when it is absent).

    Raises:
        LedgerError: ``ledger_invalid`` naming the line that is not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise LedgerError(f"cannot read the ledger {path}: {exc.strerror}") from None
    entries: list[dict[str, object]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = None
        if not isinstance(entry, dict):
            raise LedgerError(
                f"{path}:{number} is not a JSON object",
                remediation="Restore the file from git; the ledger is only ever appended to.",
            )
        entries.append(entry)
    return entries


_MD_HEADER = """# Certification ledger

What was validated live, on which hardware, with what evidence. `sbproxy certify` appends one
section per check run (and the same entry, one JSON object a line, to `certification.jsonl`,
which `sbproxy capabilities` reads); earlier entries are never rewritten.
"""


def append_entry(entry: Mapping[str, object], *, json_path: Path, markdown_path: Path) -> None:
    """Append ``entry`` to the JSON ledger and its section to the Markdown ledger.

    Both files are opened for appending only; what they held before is left byte for byte.
    The JSON ledger is read first, so an entry is never added after a corrupt line.

    Raises:
        LedgerError: ``ledger_invalid`` when the JSON ledger is unreadable or corrupt, or a
            file cannot be written.
    """
    read_ledger(json_path)
    line = json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n"
    try:
        with json_path.open("a", encoding="utf-8") as out:
            out.write(line)
        fresh = not markdown_path.exists()
        with markdown_path.open("a", encoding="utf-8") as out:
            if fresh:
                out.write(_MD_HEADER)
            out.write(_entry_markdown(entry))
    except OSError as exc:
        raise LedgerError(f"cannot append to the ledger: {exc}") from None


def _entry_markdown(entry: Mapping[str, object]) -> str:
    lines = [
        "",
        f"## {entry.get('recorded_at')}: {entry.get('engine')} on {entry.get('accelerator')}"
        f" -- {entry.get('outcome')}",
        "",
    ]
    if entry.get("reason"):
        lines.append(f"Reason: {entry.get('reason')}")
        lines.append("")
    for key in ("commit", "hardware", "engine_build", "model"):
        value = entry.get(key)
        if value is not None:
            lines.append(f"- {key}: `{json.dumps(value, sort_keys=True)}`")
    checks = _sequence(entry.get("checks"))
    if checks:
        lines += ["", "| check | result | seconds | evidence |", "| --- | --- | --- | --- |"]
        for check in checks:
            if isinstance(check, Mapping):
                result = "pass" if check.get("ok") else "FAIL"
                lines.append(
                    f"| {check.get('name')} | {result} | {check.get('seconds')} | "
                    f"{str(check.get('evidence', '')).replace('|', '/')} |"
                )
    return "\n".join(lines) + "\n"


def matrix_markdown(cells: Iterable[Cell]) -> str:
    """``docs/capabilities.md``: one table per engine (accelerators x features)."""
    cells = list(cells)
    columns = accelerators()
    out = [
        "# Capability matrix",
        "",
        "Generated by `sbproxy capabilities --format markdown > docs/capabilities.md`; a test",
        "fails when this file is not what the command prints. Do not edit it by hand.",
        "",
        "- `live`: a passing live check on that hardware is in the certification ledger",
        "  (`docs/certification.md`, written by `sbproxy certify`).",
        "- `planned`: the engine's launch planner accepts it and its plans are tested, but it",
        "  was never run live here.",
        "- `unsupported`: the code refuses it; the reason code is what the planner or the",
        "  configuration check raises (see docs/troubleshooting.md).",
        "",
        "Accelerators are those the device probe knows (NVIDIA GPUs through NVML, else the",
        "CPU); Apple Metal and AMD hosts are probed as CPU workers.",
    ]
    if not any(c.accelerator == "cuda" and c.status is CellStatus.LIVE for c in cells):
        out += [
            "",
            "No GPU has been certified here yet: every CUDA cell the code accepts is",
            "`planned`, not `live`, until `sbproxy certify` passes on a GPU machine and its",
            "entry is committed.",
        ]
    for engine in ENGINES:
        out += ["", f"## {engine}", "", "| feature | " + " | ".join(columns) + " |"]
        out.append("| --- |" + " --- |" * len(columns))
        for feature in FEATURES:
            row = [
                _cell_text(cell)
                for accelerator in columns
                for cell in cells
                if (cell.engine, cell.accelerator, cell.feature) == (engine, accelerator, feature)
            ]
            out.append(f"| {feature} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def _cell_text(cell: Cell) -> str:
    if cell.status is CellStatus.UNSUPPORTED:
        return f"unsupported (`{cell.reason_code}`)"
    return cell.status.value
