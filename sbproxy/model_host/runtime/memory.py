"""Memory estimate of one deployment generation, and the GGUF header facts it is built from.

Admission reserves ``weights + KV cache + runtime overhead + safety margin`` bytes on the
selected device (spec "Admission and residency"; reference 7.4, ``fit.rs``). The model's
shape -- layers, KV heads, key/value head sizes, trained context -- comes from the GGUF
header of the verified artifact, read by :func:`read_gguf_header`.

Why a parser of our own: ``gguf.GGUFReader`` materialises every metadata array, and the
262,144-entry vocabulary of Gemma 3 makes it take ~13 s on the 253 MB file (measured here,
gguf 0.19). The estimate needs eight scalars, so this module walks the key/value section
once and seeks over array values without decoding them.

Everything here is pure policy except that one header read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO, Final

from sbproxy.config import KvQuant
from sbproxy.errors import SbproxyError

__all__ = [
    "DEFAULT_KV_FRACTION",
    "GGUF_MAGIC",
    "KV_BYTES_PER_ELEMENT",
    "RUNTIME_OVERHEAD",
    "GgufError",
    "GgufFacts",
    "MemoryEstimate",
    "estimate_memory",
    "kv_bytes_per_element",
    "read_gguf_header",
]

GGUF_MAGIC: Final = b"GGUF"
"""First four bytes of every GGUF file (ggml ``docs/gguf.md``: ``0x47 0x47 0x55 0x46``)."""

RUNTIME_OVERHEAD: Final = Fraction(15, 100)
"""Share of ``weights + KV`` added for compute buffers and the runtime itself.

Source: the reference's ``DEFAULT_OVERHEAD = 1.15`` (``fit.rs``), i.e. 15 % on top.
"""

KV_BYTES_PER_ELEMENT: Final[dict[KvQuant, Fraction]] = {
    KvQuant.F16: Fraction(2),
    # llama.cpp ``block_q8_0``: one f16 scale + 32 int8 values = 34 bytes per 32 elements.
    KvQuant.INT8: Fraction(34, 32),
    # The llama.cpp driver maps an fp8 KV cache to ``q8_0`` too (``--cache-type-k q8_0``).
    KvQuant.FP8: Fraction(34, 32),
    # llama.cpp ``block_q4_0``: one f16 scale + 16 bytes of packed nibbles = 18 bytes / 32.
    KvQuant.INT4: Fraction(18, 32),
}
"""Bytes one K or V element occupies in the cache, by ``kv_quant`` (``auto`` is f16)."""

DEFAULT_KV_FRACTION: Final = Fraction(1, 4)
"""KV bytes per concurrent sequence, as a share of the weights, when the shape is unknown.

Used only for artifacts without header facts (safetensors without a parsed config). It is
a rough stand-in in the range of small chat models at full context: Qwen2.5-0.5B's f16 KV
for one 32,768-token sequence (2 x 24 layers x 2 heads x 64 x 2 B x 32,768 = 384 MiB) is
0.38 of its 0.99 GB f16 weights; 7-8B models at 8k context sit nearer 0.06.
"""

_SUPPORTED_VERSIONS: Final = frozenset({2, 3})
# A sanity bound: real files have a few dozen keys; a huge count means a corrupt header.
_MAX_KV_COUNT: Final = 1 << 20
# Per-layer integer arrays (e.g. head_count_kv per layer) are decoded up to this length.
_MAX_LAYER_ARRAY: Final = 1 << 16
_CHUNK: Final = 1 << 20

# GGUF metadata value types (``gguf_metadata_value_type``) and their fixed sizes in bytes.
_STRING: Final = 8
_ARRAY: Final = 9
_FIXED_SIZES: Final[dict[int, int]] = {
    0: 1,  # uint8
    1: 1,  # int8
    2: 2,  # uint16
    3: 2,  # int16
    4: 4,  # uint32
    5: 4,  # int32
    6: 4,  # float32
    7: 1,  # bool
    10: 8,  # uint64
    11: 8,  # int64
    12: 8,  # float64
}
_INT_FORMATS: Final[dict[int, str]] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    10: "Q",
    11: "q",
}

_ARCHITECTURE_KEY: Final = "general.architecture"
# Suffixes after ``<architecture>.`` of the keys the estimate reads.
_SHAPE_SUFFIXES: Final = (
    "block_count",
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
)


class GgufError(SbproxyError):
    """A GGUF header cannot be read (code ``artifact_not_ready``).

    Raised for an unreadable file, a wrong magic, an unsupported version, a header cut short,
    or a header lacking a key the memory estimate needs. ``details`` carries ``path``.
    """

    default_code = "artifact_not_ready"


@dataclass(frozen=True, slots=True)
class GgufFacts:
    """Model shape read from a GGUF header.

    Attributes:
        architecture: ``general.architecture``, e.g. ``"gemma3"``; prefixes the other keys.
        version: GGUF format version (2 or 3).
        tensor_count: Number of tensors the file declares.
        block_count: Transformer layers (``<arch>.block_count``).
        head_count: Attention (query) heads (``<arch>.attention.head_count``).
        head_count_kv: Key/value heads (``<arch>.attention.head_count_kv``; equals
            ``head_count`` when absent, i.e. no grouped-query attention).
        key_length: Elements per key head (``<arch>.attention.key_length``; default
            ``embedding_length // head_count``, as llama.cpp does).
        value_length: Elements per value head (``<arch>.attention.value_length``; same
            default as ``key_length``).
        embedding_length: Hidden size (``<arch>.embedding_length``).
        context_length: Trained context in tokens (``<arch>.context_length``).

    Per-layer arrays (some architectures store ``head_count``/``head_count_kv`` per layer)
    are reduced to their maximum, which can only overestimate memory.
    """

    architecture: str
    version: int
    tensor_count: int
    block_count: int
    head_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    embedding_length: int
    context_length: int


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one generation needs on each selected device.

    Attributes:
        weight_bytes: Model weights.
        kv_bytes: KV cache for every concurrent sequence.
        runtime_overhead_bytes: Compute buffers and runtime (:data:`RUNTIME_OVERHEAD`).
        safety_margin_bytes: ``safety_margin`` x the three above.
        total_bytes: The sum of the four; the amount residency reserves.

    Raises:
        ValueError: a component is negative or ``total_bytes`` is not their sum.
    """

    weight_bytes: int
    kv_bytes: int
    runtime_overhead_bytes: int
    safety_margin_bytes: int
    total_bytes: int

    def __post_init__(self) -> None:
        parts = (
            self.weight_bytes,
            self.kv_bytes,
            self.runtime_overhead_bytes,
            self.safety_margin_bytes,
        )
        if any(part < 0 for part in parts):
            raise ValueError(f"memory estimate components must be >= 0, got {parts}")
        if sum(parts) != self.total_bytes:
            raise ValueError(f"total_bytes {self.total_bytes} is not the sum of {parts}")

    @classmethod
    def from_total(cls, total_bytes: int) -> MemoryEstimate:
        """An estimate of ``total_bytes`` all counted as weights (tests, legacy accounting)."""
        return cls(
            weight_bytes=total_bytes,
            kv_bytes=0,
            runtime_overhead_bytes=0,
            safety_margin_bytes=0,
            total_bytes=total_bytes,
        )

    def to_dict(self) -> dict[str, int]:
        """The five fields, for status JSON."""
        return {
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "runtime_overhead_bytes": self.runtime_overhead_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "total_bytes": self.total_bytes,
        }


def kv_bytes_per_element(kv_quant: KvQuant, format_quant: str | None = None) -> Fraction:
    """Bytes one cached K or V element takes.

    Args:
        kv_quant: The deployment's ``kv_quant``; ``auto`` keeps the engine default.
        format_quant: The artifact's quantisation label (``"q4_k_m"``, ``"fp8"`` ...), if any.

    Returns:
        :data:`KV_BYTES_PER_ELEMENT` for an explicit ``kv_quant``. For ``auto``: 1 byte when
        the weights are FP8 (engines then keep an fp8 cache; reference 7.4), else 2 (f16).
    """
    if kv_quant is KvQuant.AUTO:
        if format_quant is not None and "fp8" in format_quant.lower():
            return Fraction(1)
        return KV_BYTES_PER_ELEMENT[KvQuant.F16]
    return KV_BYTES_PER_ELEMENT[kv_quant]


def estimate_memory(
    *,
    weights_bytes: int,
    facts: GgufFacts | None,
    seq_len: int,
    concurrency: int,
    kv_quant: KvQuant,
    safety_margin: float,
    format_quant: str | None = None,
    tensor_parallel: int = 1,
) -> MemoryEstimate:
    """Estimate the bytes one generation reserves on each of its devices.

    Formula (reference 7.4, with the artifact's real sizes in place of catalog parameters)::

        weight   = weights_bytes / tensor_parallel
        kv       = layers x kv_heads x (key_length + value_length) x bytes_per_element
                   x seq_len x concurrency / tensor_parallel
        overhead = (weight + kv) x 0.15
        margin   = (weight + kv + overhead) x safety_margin
        total    = weight + kv + overhead + margin      (each term truncated to int)

    ``key_length + value_length`` is the reference's ``2 x head_dim`` when both are equal.
    ``weights_bytes`` is the artifact's file size: a GGUF is already quantised, so its
    bytes are what the engine maps. Concurrency scales only the KV term (and through it
    overhead and margin); the weights are shared by every sequence.

    Without ``facts`` (an artifact that is not GGUF), ``kv`` is
    ``weights x DEFAULT_KV_FRACTION x concurrency / tensor_parallel``.

    Args:
        weights_bytes: Size of the weight files in bytes (> 0).
        facts: Model shape from :func:`read_gguf_header`, or ``None``.
        seq_len: Context tokens per sequence (>= 1); clamped to ``facts.context_length``
            as the reference does, since the model was not trained past it.
        concurrency: Sequences served at once (the deployment's ``max_concurrency``, >= 1).
        kv_quant: KV-cache element type (see :func:`kv_bytes_per_element`).
        safety_margin: Fraction added on top, in ``[0, 1)`` (``model_host.safety_margin``).
        format_quant: The artifact's quantisation label, used when ``kv_quant`` is ``auto``.
        tensor_parallel: Devices the generation is split across (>= 1); the result is per
            device.

    Returns:
        The five-part :class:`MemoryEstimate`; ``total_bytes`` equals the sum of the parts.

    Raises:
        ValueError: an argument is out of range (a caller bug, not an operator error).
    """
    if weights_bytes <= 0:
        raise ValueError(f"weights_bytes must be > 0, got {weights_bytes}")
    if seq_len < 1 or concurrency < 1 or tensor_parallel < 1:
        raise ValueError(
            "seq_len, concurrency and tensor_parallel must be >= 1, got "
            f"{seq_len}, {concurrency}, {tensor_parallel}"
        )
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin}")

    weight = Fraction(weights_bytes, tensor_parallel)
    if facts is None:
        kv = Fraction(weights_bytes) * DEFAULT_KV_FRACTION * concurrency / tensor_parallel
    else:
        tokens = min(seq_len, facts.context_length)
        per_token = (
            facts.block_count
            * facts.head_count_kv
            * (facts.key_length + facts.value_length)
            * kv_bytes_per_element(kv_quant, format_quant)
        )
        kv = per_token * tokens * concurrency / tensor_parallel
    overhead = (weight + kv) * RUNTIME_OVERHEAD
    margin = (weight + kv + overhead) * Fraction(safety_margin)

    weight_bytes, kv_bytes = int(weight), int(kv)
    overhead_bytes, margin_bytes = int(overhead), int(margin)
    return MemoryEstimate(
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        runtime_overhead_bytes=overhead_bytes,
        safety_margin_bytes=margin_bytes,
        total_bytes=weight_bytes + kv_bytes + overhead_bytes + margin_bytes,
    )


def read_gguf_header(path: str | os.PathLike[str]) -> GgufFacts:
    """Read the model shape from a GGUF file's header, without loading arrays or tensors.

    Layout (ggml ``docs/gguf.md``, versions 2 and 3): magic ``GGUF``; ``uint32`` version;
    ``uint64`` tensor count; ``uint64`` key/value count; then each pair as a string key,
    a ``uint32`` value type and the value. Strings are a ``uint64`` byte length and UTF-8
    bytes; arrays are a ``uint32`` element type, a ``uint64`` count and the elements. Files
    are little-endian unless written big-endian (version 3 allows both; detected from the
    version field). Array values are skipped by seeking over fixed-size elements or over
    each string's length, so the cost is one pass over the header (Gemma 3 270M: ~6 MB).

    Args:
        path: The ``.gguf`` file.

    Returns:
        The shape facts; optional keys defaulted as :class:`GgufFacts` documents.

    Raises:
        GgufError: code ``artifact_not_ready`` -- the file cannot be opened, the magic is not
            ``GGUF``, the version is not 2 or 3, the header ends early, or
            ``general.architecture``, ``block_count``, ``attention.head_count``,
            ``embedding_length`` or ``context_length`` is missing or not a positive integer.
    """
    where = Path(path)
    try:
        with where.open("rb") as handle:
            reader = _HeaderReader(handle, size=os.fstat(handle.fileno()).st_size, path=where)
            return reader.read()
    except OSError as exc:
        raise GgufError(
            f"cannot read GGUF file {where}: {exc.strerror or exc}.",
            remediation="Re-run `sbproxy models pull` so the artifact is verified again.",
            details={"path": str(where)},
        ) from exc


class _Truncated(Exception):
    """The header ends before a value it declares."""


class _HeaderReader:
    """One forward pass over a GGUF header through a large read buffer."""

    def __init__(self, handle: BinaryIO, *, size: int, path: Path) -> None:
        self._handle = handle
        self._size = size
        self._path = path
        self._buffer = b""
        self._pos = 0  # position inside _buffer
        self._consumed = 0  # file offset of _buffer[0]
        self._endian = "<"

    # -- errors ------------------------------------------------------------------------

    def _fail(self, problem: str) -> GgufError:
        return GgufError(
            f"{self._path} is not a usable GGUF file: {problem}.",
            remediation=(
                "Re-run `sbproxy models pull` to verify the artifact, or choose a variant "
                "whose GGUF was written by a current llama.cpp converter."
            ),
            details={"path": str(self._path)},
        )

    # -- buffered primitives -----------------------------------------------------------

    def _ensure(self, count: int) -> None:
        if len(self._buffer) - self._pos >= count:
            return
        if self._consumed + self._pos + count > self._size:
            raise _Truncated  # also keeps a corrupt length from sizing a huge read
        rest = self._buffer[self._pos :]
        more = self._handle.read(max(count - len(rest), _CHUNK))
        self._consumed += self._pos
        self._buffer = rest + more
        self._pos = 0
        if len(self._buffer) < count:
            raise _Truncated

    def _take(self, count: int) -> bytes:
        self._ensure(count)
        start = self._pos
        self._pos += count
        return self._buffer[start : self._pos]

    def _unpack(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        self._ensure(size)
        (value,) = struct.unpack_from(self._endian + fmt, self._buffer, self._pos)
        self._pos += size
        return int(value)

    def _skip(self, count: int) -> None:
        available = len(self._buffer) - self._pos
        if count <= available:
            self._pos += count
            return
        target = self._consumed + self._pos + count
        if target > self._size:
            raise _Truncated
        self._handle.seek(target)
        self._consumed = target
        self._buffer = b""
        self._pos = 0

    def _skip_strings(self, count: int) -> None:
        # The hot loop: the Gemma vocabulary holds 262,144 strings. Walk the buffer with
        # unpack_from and refill only when a length or a string crosses its end.
        length_format = struct.Struct(self._endian + "Q")
        remaining = count
        while remaining:
            buffer, pos, end = self._buffer, self._pos, len(self._buffer)
            while remaining and pos + 8 <= end:
                (length,) = length_format.unpack_from(buffer, pos)
                if pos + 8 + length > end:
                    break
                pos += 8 + length
                remaining -= 1
            self._pos = pos
            if remaining:
                self._skip(self._unpack("Q"))
                remaining -= 1

    def _string(self) -> bytes:
        return self._take(self._unpack("Q"))

    # -- values ------------------------------------------------------------------------

    def _skip_value(self, value_type: int) -> None:
        if value_type in _FIXED_SIZES:
            self._skip(_FIXED_SIZES[value_type])
        elif value_type == _STRING:
            self._skip(self._unpack("Q"))
        elif value_type == _ARRAY:
            element_type = self._unpack("I")
            self._skip_elements(element_type, self._unpack("Q"))
        else:
            raise self._fail(f"unknown metadata value type {value_type}")

    def _skip_elements(self, element_type: int, count: int) -> None:
        if element_type in _FIXED_SIZES:
            self._skip(_FIXED_SIZES[element_type] * count)
        elif element_type == _STRING:
            self._skip_strings(count)
        elif element_type == _ARRAY:
            for _ in range(count):
                self._skip_value(_ARRAY)
        else:
            raise self._fail(f"unknown array element type {element_type}")

    def _integer(self, value_type: int) -> int | None:
        """Read an integer scalar, or the maximum of a per-layer integer array.

        Returns ``None`` (with the value skipped) for any other type.
        """
        if value_type in _INT_FORMATS:
            return self._unpack(_INT_FORMATS[value_type])
        if value_type != _ARRAY:
            self._skip_value(value_type)
            return None
        element_type = self._unpack("I")
        count = self._unpack("Q")
        if element_type in _INT_FORMATS and 0 < count <= _MAX_LAYER_ARRAY:
            fmt = _INT_FORMATS[element_type]
            raw = self._take(struct.calcsize(fmt) * count)
            return int(max(struct.unpack(f"{self._endian}{count}{fmt}", raw)))
        self._skip_elements(element_type, count)
        return None

    # -- the header --------------------------------------------------------------------

    def read(self) -> GgufFacts:
        try:
            return self._read()
        except _Truncated:
            raise self._fail(
                f"the header ends early (file is {self._size} bytes; the download may be "
                "incomplete)"
            ) from None

    def _read(self) -> GgufFacts:
        version, tensor_count, kv_count = self._prologue()
        architecture: str | None = None
        integers: dict[str, int] = {}
        not_integers: set[str] = set()
        for _ in range(kv_count):
            key = self._text("a metadata key")
            value_type = self._unpack("I")
            if key == _ARCHITECTURE_KEY and value_type == _STRING:
                architecture = self._text(_ARCHITECTURE_KEY)
            elif key.endswith(_SHAPE_SUFFIXES):
                number = self._integer(value_type)
                if number is None:
                    not_integers.add(key)
                else:
                    integers[key] = number
            else:
                self._skip_value(value_type)
        if not architecture:
            raise self._fail(f"{_ARCHITECTURE_KEY} is missing")
        return self._facts(architecture, version, tensor_count, integers, not_integers)

    def _prologue(self) -> tuple[int, int, int]:
        """Check the magic and version; return ``(version, tensor_count, kv_count)``."""
        if self._take(4) != GGUF_MAGIC:
            raise self._fail("the file does not start with the GGUF magic")
        version = self._unpack("I")
        if version & 0xFFFF == 0:  # a big-endian file read as little-endian
            self._endian = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in _SUPPORTED_VERSIONS:
            raise self._fail(f"GGUF version {version} is not supported (only 2 and 3)")
        tensor_count = self._unpack("Q")
        kv_count = self._unpack("Q")
        if kv_count > _MAX_KV_COUNT:
            raise self._fail(f"it declares {kv_count} metadata keys")
        return version, tensor_count, kv_count

    def _text(self, what: str) -> str:
        try:
            return self._string().decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(f"{what} is not UTF-8") from None

    def _facts(
        self,
        architecture: str,
        version: int,
        tensor_count: int,
        integers: dict[str, int],
        not_integers: set[str],
    ) -> GgufFacts:
        def value(suffix: str, default: int | None = None) -> int:
            key = f"{architecture}.{suffix}"
            if key in not_integers:
                raise self._fail(f"{key} is not an integer")
            found = integers.get(key, default)
            if found is None:
                raise self._fail(f"{key} is missing")
            if found < 1:
                raise self._fail(f"{key} is {found} (or defaults to it), not a positive integer")
            return found

        head_count = value("attention.head_count")
        embedding_length = value("embedding_length")
        head_size = embedding_length // head_count
        key_length = value("attention.key_length", head_size)
        return GgufFacts(
            architecture=architecture,
            version=version,
            tensor_count=tensor_count,
            block_count=value("block_count"),
            head_count=head_count,
            head_count_kv=value("attention.head_count_kv", head_count),
            key_length=key_length,
            value_length=value("attention.value_length", head_size),
            embedding_length=embedding_length,
            context_length=value("context_length"),
        )
