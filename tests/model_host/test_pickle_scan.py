"""The pickle opcode scan refuses dangerous globals without ever unpickling."""

from __future__ import annotations

import collections
import os
import pickle
import zipfile
from pathlib import Path

import pytest

from sbproxy.model_host.artifacts.errors import PickleUnsafe
from sbproxy.model_host.artifacts.pickle_scan import (
    SAFE_GLOBALS,
    is_dangerous,
    scan_pickle_bytes,
    scan_pickle_file,
)


class _RunsEcho:
    """Pickles to a call of ``os.system``; only ever dumped here, never loaded."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo",))


class _OpensFile:
    """Pickles to ``open(path, "w")``: loading it creates the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def _unsafe(data: bytes, *, source: str = "model.bin") -> PickleUnsafe:
    with pytest.raises(PickleUnsafe) as info:
        scan_pickle_bytes(data, source=source)
    return info.value


def test_global_os_system_is_refused() -> None:
    error = _unsafe(b"cos\nsystem\n.", source="weights.pkl")
    assert error.code == "pickle_unsafe"
    assert not error.retryable
    assert "weights.pkl" in str(error)
    assert "os.system" in str(error)
    assert "safetensors" in str(error)
    assert error.details == {"path": "weights.pkl", "globals": "os.system"}


def test_torch_rebuild_tensor_global_is_safe() -> None:
    found = scan_pickle_bytes(b"ctorch._utils\n_rebuild_tensor_v2\n.", source="ok.pkl")
    assert found == ["torch._utils._rebuild_tensor_v2"]


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_ordered_dict_state_dict_is_safe(protocol: int) -> None:
    state = collections.OrderedDict(weight=[1.0, 2.0], bias=(3,), names={"a"})
    found = scan_pickle_bytes(pickle.dumps(state, protocol=protocol), source="sd.pkl")
    assert found[0] == "collections.OrderedDict"
    assert set(found) <= SAFE_GLOBALS


def test_reduce_to_os_system_is_refused() -> None:
    error = _unsafe(pickle.dumps(_RunsEcho(), protocol=4))
    # os.system is posix.system (nt.system on Windows) when pickled.
    assert any(name.endswith(".system") for name in str(error.details["globals"]).split(","))
    assert "dangerous" in str(error)


def test_stack_global_resolved_through_memo_get_is_refused() -> None:
    data = (
        b"\x80\x04"  # PROTO 4
        b"\x8c\x02os\x94"  # SHORT_BINUNICODE 'os'; MEMOIZE -> 0
        b"\x8c\x06system\x94"  # SHORT_BINUNICODE 'system'; MEMOIZE -> 1
        b"00"  # POP POP: the strings now live only in the memo
        b"h\x00h\x01"  # BINGET 0, BINGET 1
        b"\x93"  # STACK_GLOBAL
        b"\x8c\x04echo\x85R."  # ('echo',) REDUCE STOP
    )
    error = _unsafe(data)
    assert error.details["globals"] == "os.system"


def test_stack_global_resolved_through_put_and_long_binget_is_safe() -> None:
    data = (
        b"\x80\x04"
        b"\x8c\x0bcollections" + b"q\x05"  # BINPUT 5
        b"\x8c\x0bOrderedDict" + b"r\x07\x00\x00\x00"  # LONG_BINPUT 7
        b"00"
        b"j\x05\x00\x00\x00j\x07\x00\x00\x00"  # LONG_BINGET 5, LONG_BINGET 7
        b"\x93)R."  # STACK_GLOBAL EMPTY_TUPLE REDUCE STOP
    )
    assert scan_pickle_bytes(data, source="memo.pkl") == ["collections.OrderedDict"]


def test_stack_global_from_unknown_values_is_refused() -> None:
    # The module name is built at load time (a tuple), so the scan cannot resolve it.
    data = b"\x80\x04)\x8c\x06system\x93."
    error = _unsafe(data)
    assert "unresolved STACK_GLOBAL" in str(error)


def test_inst_and_extension_opcodes_are_refused() -> None:
    assert _unsafe(b"(isubprocess\nPopen\n.").details["globals"] == "subprocess.Popen"
    assert "copyreg extension" in str(_unsafe(b"\x80\x02\x82\x01."))


def test_second_concatenated_pickle_is_scanned() -> None:
    benign = pickle.dumps(collections.OrderedDict(), protocol=4)
    error = _unsafe(benign + b"cbuiltins\neval\n.")
    assert error.details["globals"] == "builtins.eval"


def test_truncated_pickle_is_refused() -> None:
    data = pickle.dumps(collections.OrderedDict(a=1), protocol=4)
    error = _unsafe(data[:-3], source="cut.pkl")
    assert "could not be scanned" in str(error)
    assert "cut.pkl" in str(error)


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"not a pickle"])
def test_garbage_is_refused(data: bytes) -> None:
    _unsafe(data)


def test_trailing_garbage_after_a_pickle_is_refused() -> None:
    _unsafe(pickle.dumps([1, 2], protocol=2) + b"\x00garbage")


def test_legacy_torch_format_stops_after_five_pickles() -> None:
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    header = magic + b"".join(pickle.dumps(v, protocol=2) for v in (1001, {"little_endian": True}))
    body = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n)R." + pickle.dumps(["0"], protocol=2)
    raw_storage = b"\x00\x01\xff raw float bytes, never unpickled"
    assert scan_pickle_bytes(header + body + raw_storage, source="old.bin") == [
        "torch._utils._rebuild_tensor_v2"
    ]
    # The five pickles are still scanned.
    _unsafe(header + b"cos\nsystem\n." + pickle.dumps(["0"], protocol=2) + raw_storage)


def test_zip_format_member_with_malicious_pickle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data/0", b"\x00" * 16)
        archive.writestr("archive/data.pkl", pickle.dumps(_RunsEcho(), protocol=2))
        archive.writestr("archive/version", b"3\n")
    with pytest.raises(PickleUnsafe) as info:
        scan_pickle_file(path)
    assert "archive/data.pkl" in str(info.value)
    assert str(path) in str(info.value)


def test_zip_format_with_benign_pickles_lists_every_member(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02ctorch\nFloatStorage\n.")
        archive.writestr("archive/extra.pkl", pickle.dumps(collections.OrderedDict(), 4))
        archive.writestr("archive/data/0", b"cos\nsystem\n.")  # raw storage: not a pickle member
    assert scan_pickle_file(path) == ["torch.FloatStorage", "collections.OrderedDict"]
    assert scan_pickle_bytes(path.read_bytes(), source="model.pt") == [
        "torch.FloatStorage",
        "collections.OrderedDict",
    ]


def test_broken_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.pt"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    with pytest.raises(PickleUnsafe) as info:
        scan_pickle_file(path)
    assert "zip" in str(info.value)


def test_plain_pickle_file_is_scanned_from_disk(tmp_path: Path) -> None:
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps(collections.OrderedDict(x=1), protocol=5))
    assert scan_pickle_file(path) == ["collections.OrderedDict"]


def test_scan_never_executes_the_pickle(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(pickle.dumps(_OpensFile(target), protocol=4))

    with pytest.raises(PickleUnsafe):
        scan_pickle_file(payload)
    with pytest.raises(PickleUnsafe):
        scan_pickle_bytes(payload.read_bytes(), source="payload.pkl")
    assert not target.exists()

    # The payload is live: actually loading it does create the file.
    opened = pickle.loads(payload.read_bytes())  # noqa: S301 - proving the payload works
    opened.close()
    assert target.exists()


@pytest.mark.parametrize(
    "name",
    [
        "os.system",
        "posix.system",
        "subprocess.Popen",
        "builtins.eval",
        "builtins.exec",
        "builtins.getattr",
        "builtins.__import__",
        "__builtin__.open",
        "builtins.compile",
        "socket.socket",
        "sys.modules",
        "runpy.run_path",
        "shutil.rmtree",
        "webbrowser.open",
        "torch.storage._load_from_bytes",
    ],
)
def test_dangerous_globals_are_never_in_the_safe_set(name: str) -> None:
    assert name not in SAFE_GLOBALS
    module, _, attr = name.rpartition(".")
    _unsafe(f"c{module}\n{attr}\n.".encode())
    if not name.startswith("torch."):
        assert is_dangerous(name)
