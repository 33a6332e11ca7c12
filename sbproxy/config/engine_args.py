"""The allowlist of operator-supplied engine arguments (``extra_args``).

The runtime owns every flag that decides *what* an engine serves and *where* (model path,
host, port, devices, parallelism, memory limits). Operators may only add tuning flags from a
short allowlist; anything else is refused with reason code ``unsafe_argument``. The lists
follow the reference implementation's allowlist (reference section 8) so configurations move
between the two unchanged.

Accepted shapes: ``--flag``, ``--flag=value`` and ``--flag value``. Values must be non-empty,
must not start with ``-`` and must not contain NUL, CR or LF.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["RUNTIME_OWNED_FLAGS", "EngineKind", "check_engine_args"]

EngineKind = Literal["llama_cpp", "vllm"]

_U64_MAX = 2**64 - 1


def _u64(value: str) -> str | None:
    if not value.isdigit() or int(value) > _U64_MAX:
        return "must be a non-negative integer"
    return None


def _choice(*allowed: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if value not in allowed:
            return f"must be one of {', '.join(allowed)}"
        return None

    return check


# flag -> None for a boolean switch, or a checker returning an error for a bad value.
_ALLOWED: dict[EngineKind, dict[str, Callable[[str], str | None] | None]] = {
    "llama_cpp": {
        "--flash-attn": None,
        "--no-mmap": None,
        "--mlock": None,
        "--threads": _u64,
        "--batch-size": _u64,
        "--ubatch-size": _u64,
        "--seed": _u64,
    },
    "vllm": {
        "--enable-prefix-caching": None,
        "--disable-log-requests": None,
        "--enforce-eager": None,
        "--seed": _u64,
        "--dtype": _choice("auto", "half", "float16", "bfloat16", "float32"),
    },
}

# Flags the runtime sets itself; naming them explains the refusal better than "not allowed".
RUNTIME_OWNED_FLAGS = frozenset(
    {
        "--host",
        "--port",
        "--model",
        "-m",
        "--api-key",
        "--hf-repo",
        "--hf-file",
        "--model-url",
        "--mount",
        "--model-path",
        "--device",
        "--tensor-parallel-size",
        "--tp-size",
        "--mem-fraction-static",
        "--gpu-memory-utilization",
        "--max-seq-len",
        "--max-model-len",
        "--max-num-seqs",
        "--ctx-size",
        "-c",
        "--parallel",
        "-np",
        "--n-gpu-layers",
        "-ngl",
        "--cache-type-k",
        "--cache-type-v",
        "--served-model-name",
        "--cpu",
        # A split over hosts: the runtime points the leader at its tunnels (engines/rpc.py).
        "--rpc",
    }
)


def _bad_value(value: str) -> str | None:
    if not value:
        return "needs a non-empty value"
    if value.startswith("-"):
        return "has a value that starts with '-'"
    if any(ch in value for ch in "\x00\r\n"):
        return "has a value with a NUL, CR or LF character"
    return None


def check_engine_args(engine: EngineKind, args: Sequence[str]) -> list[tuple[int, str]]:
    """Check ``extra_args`` for one engine.

    Args:
        engine: The engine the arguments are for.
        args: The argument list as written in the configuration.

    Returns:
        ``(index, message)`` for every refused argument; empty when all are allowed. The
        index points at the flag (or at its separate value when only the value is bad).
    """
    allowed = _ALLOWED[engine]
    problems: list[tuple[int, str]] = []
    index = 0
    while index < len(args):
        token = args[index]
        flag, has_inline, inline = token.partition("=")
        if flag in RUNTIME_OWNED_FLAGS:
            problems.append(
                (index, f"{flag} is set by the runtime and cannot be overridden (unsafe_argument)")
            )
            index += 1
            continue
        if flag not in allowed:
            names = ", ".join(sorted(allowed))
            problems.append(
                (
                    index,
                    f"{token!r} is not an allowed {engine} argument (unsafe_argument); "
                    f"allowed: {names}",
                )
            )
            index += 1
            continue
        checker = allowed[flag]
        if checker is None:
            if has_inline:
                problems.append((index, f"{flag} is a switch and takes no value"))
            index += 1
            continue
        value_index = index
        if has_inline:
            value = inline
        elif index + 1 < len(args):
            value_index = index + 1
            value = args[value_index]
            index += 1
        else:
            problems.append((index, f"{flag} needs a value"))
            index += 1
            continue
        error = _bad_value(value) or checker(value)
        if error:
            problems.append((value_index, f"{flag} {error}"))
        index += 1
    return problems
