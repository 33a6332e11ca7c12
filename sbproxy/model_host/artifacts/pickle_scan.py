"""Opcode scan of pickle files: which globals would unpickling import, and are they safe?

Loading a pickle imports and calls whatever globals it names (``os.system`` included), so a
``pickle``-format artifact is scanned before its snapshot is published. The scan walks the
opcode stream with :func:`pickletools.genops` and never unpickles anything.

What is read:

* ``GLOBAL`` and ``INST`` name their global in the opcode argument.
* ``STACK_GLOBAL`` (protocol 4+) takes module and name from the stack; the scan simulates the
  stack and the memo (``PUT``/``BINPUT``/``LONG_BINPUT``/``MEMOIZE`` and
  ``GET``/``BINGET``/``LONG_BINGET``) to recover the two strings. When they cannot be
  recovered the global is reported as unresolved, which is unsafe.
* ``EXT1``/``EXT2``/``EXT4`` name a global through the ``copyreg`` extension registry, which
  the scan cannot see: unsafe.
* A stream may hold several pickles back to back; each is scanned with a fresh stack and memo.
  Bytes that do not parse as a complete pickle make the whole file unsafe (fail closed), with
  one exception: the legacy (pre-zip) ``torch.save`` format is five pickles followed by raw
  storage bytes that are never unpickled, so after its magic-number pickle exactly five pickles
  are scanned.
* A zip archive (a file starting with ``PK\\x03\\x04``, the test :func:`torch.load` itself uses)
  is the PyTorch zip format: every ``*.pkl`` member is scanned.

The safe set is drawn from two sources and kept deliberately small:

* PyTorch's ``weights_only`` unpickler (``torch/_weights_only_unpickler.py``,
  ``_get_allowed_globals``): ``collections.OrderedDict``, the ``torch._utils._rebuild_*``
  tensor and parameter functions (only the three plain ones), ``torch.Size``, the typed
  ``torch.*Storage`` classes, dtypes, ``_codecs.encode`` (how protocol-2 pickles spell bytes)
  and the ``builtins`` constructors ``set``, ``bytearray``, ``complex``;
* picklescan's ``_safe_globals`` (``picklescan/scanner.py``): the same storages plus
  ``numpy.ndarray``, ``numpy.dtype`` and ``numpy.(_)core.multiarray._reconstruct``;

plus the remaining plain container constructors (``frozenset``, ``dict``, ``list``,
``tuple``, ``bytes``, ``slice``), which run no code. Everything else is refused;
:data:`ALWAYS_REFUSED_MODULES` and the code-running builtins are reported as dangerous.
"""

from __future__ import annotations

import io
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import IO

from sbproxy.model_host.artifacts.errors import PickleUnsafe

__all__ = [
    "ALWAYS_REFUSED_MODULES",
    "SAFE_GLOBALS",
    "is_dangerous",
    "scan_pickle_bytes",
    "scan_pickle_file",
]

_TORCH_STORAGES = (
    "DoubleStorage",
    "FloatStorage",
    "HalfStorage",
    "BFloat16Storage",
    "LongStorage",
    "IntStorage",
    "ShortStorage",
    "CharStorage",
    "ByteStorage",
    "BoolStorage",
    "ComplexFloatStorage",
    "ComplexDoubleStorage",
)
_TORCH_DTYPES = (
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
# Python 2 era pickles (protocol < 3) spell ``builtins`` as ``__builtin__``; the unpickler maps
# it back, so both spellings name the same harmless constructors.
_BUILTIN_CONSTRUCTORS = (
    "set",
    "frozenset",
    "dict",
    "list",
    "tuple",
    "bytearray",
    "bytes",
    "complex",
    "slice",
)

SAFE_GLOBALS: frozenset[str] = frozenset(
    {
        "collections.OrderedDict",
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch.Size",
        # numpy pickles at protocol 2 encode raw array bytes as ``_codecs.encode(str, "latin1")``.
        "_codecs.encode",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        *(f"torch.{name}" for name in _TORCH_STORAGES),
        *(f"torch.{name}" for name in _TORCH_DTYPES),
        *(f"builtins.{name}" for name in _BUILTIN_CONSTRUCTORS),
        *(f"__builtin__.{name}" for name in _BUILTIN_CONSTRUCTORS),
    }
)
"""Globals a pickle may reference (``module.name``); every other global is refused."""

ALWAYS_REFUSED_MODULES: frozenset[str] = frozenset(
    {"os", "nt", "posix", "subprocess", "socket", "sys", "runpy", "shutil", "webbrowser"}
)
"""Modules whose every global is refused; reported as dangerous rather than merely unknown."""

_DANGEROUS_BUILTINS = frozenset(
    {"eval", "exec", "getattr", "setattr", "__import__", "open", "compile", "breakpoint"}
)

# ``torch.serialization.MAGIC_NUMBER``: the first pickle of a legacy ``torch.save`` file.
_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# magic number, protocol version, sys info, the object, the storage keys.
_TORCH_LEGACY_PICKLES = 5
_ZIP_MAGIC = b"PK\x03\x04"

_STRING_OPCODES = frozenset(
    {
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "UNICODE",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
    }
)
_PUT_OPCODES = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPCODES = frozenset({"GET", "BINGET", "LONG_BINGET"})
_EXT_OPCODES = frozenset({"EXT1", "EXT2", "EXT4"})
_INT_OPCODES = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})

_REMEDIATION = (
    "Do not load this file. Use a safetensors (or GGUF) variant of the model instead, or a "
    "pickle whose only globals are tensor and container constructors."
)


class _Malformed(Exception):
    """The stream is not a well-formed pickle; turned into :class:`PickleUnsafe`."""


class _Unknown:
    """A stack or memo value the scan does not track (anything but a string)."""


_UNKNOWN = _Unknown()
_MARK = object()


def is_dangerous(global_name: str) -> bool:
    """Whether ``module.name`` is in a module or builtin that is always refused."""
    module, _, name = global_name.rpartition(".")
    root = module.split(".", 1)[0]
    if root in ALWAYS_REFUSED_MODULES:
        return True
    return module in {"builtins", "__builtin__"} and name in _DANGEROUS_BUILTINS


def scan_pickle_bytes(data: bytes, *, source: str) -> list[str]:
    """Scan an in-memory pickle stream (one or more concatenated pickles).

    Args:
        data: The pickle bytes (a PyTorch zip archive is scanned member by member).
        source: What the bytes are, for the error message (a file name or path).

    Returns:
        The globals referenced, as ``module.name``, in order of first reference, without
        duplicates. Every one is in :data:`SAFE_GLOBALS`.

    Raises:
        PickleUnsafe: ``pickle_unsafe`` when a global is outside the safe set or cannot be
            resolved, or when the bytes are not a well-formed pickle.
    """
    if data.startswith(_ZIP_MAGIC):
        return _scan_zip(io.BytesIO(data), source=source)
    return _scan_checked(io.BytesIO(data), source=source)


def scan_pickle_file(path: Path) -> list[str]:
    """Scan a pickle file on disk without loading it.

    A file starting with the zip local-header magic is the PyTorch zip format (``.pt``,
    ``.pth``, ``.bin``): every ``*.pkl`` member is scanned. Anything else is read as a plain
    pickle stream, straight from the file (no full read into memory).

    Args:
        path: The file to scan.

    Returns:
        The globals referenced, as in :func:`scan_pickle_bytes`.

    Raises:
        PickleUnsafe: ``pickle_unsafe``, as in :func:`scan_pickle_bytes`.
        OSError: The file cannot be read.
    """
    with path.open("rb") as stream:
        if stream.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC:
            stream.seek(0)
            return _scan_zip(stream, source=str(path))
        stream.seek(0)
        return _scan_checked(stream, source=str(path))


def _scan_zip(stream: IO[bytes], *, source: str) -> list[str]:
    try:
        archive = zipfile.ZipFile(stream)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise _unsafe_malformed(
            source, f"it starts like a zip archive but is not one ({exc})"
        ) from exc
    found: list[str] = []
    with archive:
        for member in archive.infolist():
            if member.is_dir() or not member.filename.endswith(".pkl"):
                continue
            label = f"{source} (member {member.filename})"
            try:
                with archive.open(member) as member_stream:
                    globals_ = _scan_checked(member_stream, source=label)
            except (
                zipfile.BadZipFile,
                OSError,
                ValueError,
                NotImplementedError,
                RuntimeError,
            ) as exc:
                raise _unsafe_malformed(
                    label, f"the archive member cannot be read ({exc})"
                ) from exc
            found.extend(name for name in globals_ if name not in found)
    return found


def _scan_checked(stream: IO[bytes], *, source: str) -> list[str]:
    try:
        found = _scan_stream(stream)
    except _Malformed as exc:
        raise _unsafe_malformed(source, str(exc)) from None
    unsafe = [name for name in found if name not in SAFE_GLOBALS]
    if unsafe:
        dangerous = [name for name in unsafe if is_dangerous(name)]
        kind = "dangerous" if dangerous else "unsafe"
        raise PickleUnsafe(
            f"Pickle file {source} references {kind} globals: {', '.join(unsafe)}; loading it "
            "could run arbitrary code, so it was refused.",
            remediation=_REMEDIATION,
            details={"path": source, "globals": ",".join(unsafe)},
        )
    return found


def _unsafe_malformed(source: str, why: str) -> PickleUnsafe:
    return PickleUnsafe(
        f"Pickle file {source} could not be scanned: {why}; an unreadable pickle is refused.",
        remediation=_REMEDIATION,
        details={"path": source, "globals": ""},
    )


def _scan_stream(stream: IO[bytes]) -> list[str]:
    """Walk every pickle in ``stream``; return the globals named, including unresolved ones."""
    found: list[str] = []
    index = 0
    limit: int | None = None
    while limit is None or index < limit:
        if index > 0 and not _more(stream):
            break
        try:
            globals_, constants = _scan_one(stream)
        except (_Malformed, ValueError, struct.error, EOFError) as exc:
            where = "the stream" if index == 0 else f"pickle #{index + 1} of the stream"
            raise _Malformed(f"{where} is not a well-formed pickle ({exc})") from None
        if index == 0 and constants == [_TORCH_LEGACY_MAGIC] and not globals_:
            limit = _TORCH_LEGACY_PICKLES
        found.extend(name for name in globals_ if name not in found)
        index += 1
    return found


def _more(stream: IO[bytes]) -> bool:
    if not stream.read(1):
        return False
    stream.seek(-1, io.SEEK_CUR)
    return True


def _scan_one(stream: IO[bytes]) -> tuple[list[str], list[object]]:
    """Scan one pickle (up to and including its STOP).

    Returns the globals it names and, for recognising the legacy torch header, the arguments
    of the integer opcodes it contains.
    """
    machine = _StackMachine()
    for opcode, arg, pos in pickletools.genops(stream):
        machine.step(opcode, arg, pos)
    if not machine.stopped:
        raise ValueError("pickle exhausted before seeing STOP")
    return machine.found, machine.constants


class _StackMachine:
    """Tracks just enough of the unpickler's stack and memo to resolve STACK_GLOBAL."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.constants: list[object] = []
        self.stopped = False
        self._stack: list[object] = []
        self._memo: dict[int, object] = {}

    def step(self, opcode: pickletools.OpcodeInfo, arg: object, pos: int | None) -> None:
        name = opcode.name
        stack = self._stack
        if name in _STRING_OPCODES:
            stack.append(arg if isinstance(arg, str) else _UNKNOWN)
        elif name == "MEMOIZE":
            _need(stack, 1, name)
            self._memo[len(self._memo)] = stack[-1]
        elif name in _PUT_OPCODES:
            _need(stack, 1, name)
            self._memo[_int_arg(arg, name)] = stack[-1]
        elif name in _GET_OPCODES:
            stack.append(self._memo.get(_int_arg(arg, name), _UNKNOWN))
        elif name == "DUP":
            _need(stack, 1, name)
            stack.append(stack[-1])
        elif name == "STACK_GLOBAL":
            _need(stack, 2, name)
            global_name, module = stack.pop(), stack.pop()
            if isinstance(module, str) and isinstance(global_name, str):
                self.found.append(f"{module}.{global_name}")
            else:
                self.found.append(f"<unresolved STACK_GLOBAL at byte {pos}>")
            stack.append(_UNKNOWN)
        else:
            self._note(name, arg, pos)
            _apply_generic(opcode, stack)

    def _note(self, name: str, arg: object, pos: int | None) -> None:
        if name in {"GLOBAL", "INST"}:
            self.found.append(_global_arg(arg, name))
        elif name in _EXT_OPCODES:
            self.found.append(f"<copyreg extension {arg} at byte {pos}>")
        elif name in _INT_OPCODES:
            self.constants.append(arg)
        elif name == "STOP":
            self.stopped = True


def _apply_generic(opcode: pickletools.OpcodeInfo, stack: list[object]) -> None:
    """Pop what ``opcode`` consumes and push placeholders for what it produces."""
    before = opcode.stack_before
    if pickletools.markobject in before or (before and before[-1] is pickletools.stackslice):
        while True:
            if not stack:
                raise _Malformed(f"{opcode.name} found no MARK on the stack")
            if stack.pop() is _MARK:
                break
        below = before.index(pickletools.markobject) if pickletools.markobject in before else 0
        _need(stack, below, opcode.name)
        del stack[len(stack) - below :]
    else:
        _need(stack, len(before), opcode.name)
        del stack[len(stack) - len(before) :]
    stack.extend(
        _MARK if item is pickletools.markobject else _UNKNOWN for item in opcode.stack_after
    )


def _need(stack: list[object], count: int, opcode: str) -> None:
    if len(stack) < count:
        raise _Malformed(f"{opcode} needs {count} stack items but the stack holds {len(stack)}")


def _int_arg(arg: object, opcode: str) -> int:
    if not isinstance(arg, int):
        raise _Malformed(f"{opcode} has a non-integer memo index")
    return arg


def _global_arg(arg: object, opcode: str) -> str:
    if not isinstance(arg, str) or " " not in arg:
        raise _Malformed(f"{opcode} has an unreadable argument")
    module, name = arg.split(" ", 1)
    return f"{module}.{name}"
