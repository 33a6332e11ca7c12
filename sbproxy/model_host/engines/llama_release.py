"""The ``engine_fetch`` workflow: download a pinned llama.cpp release archive and publish it.

Steps (idempotency key ``engine_fetch:<tag>-<infix>``):

1. ``download`` -- stream the archive (at most 512 MiB) into ``engines/staging/``, hashing
   SHA-256 as it arrives; a digest other than the pin fails with ``engine_blocked`` and
   nothing is kept. Transient network errors retry.
2. ``publish`` -- extract with ``tarfile``'s ``data`` filter into a staging directory, find
   ``llama-server`` (``build/bin``, ``bin``, the root, or up to six levels down), check that
   it answers ``--version``, write ``build.json`` and rename the directory to
   ``engines/llama.cpp/release-<tag>-<infix>/``.

Archives come from ``https://github.com/ggml-org/llama.cpp/releases/download/<tag>/``;
``SBPROXY_LLAMA_RELEASE_BASE_URL`` points at a mirror of that directory layout instead
(air-gapped sites, tests).

The download goes through the forward proxy that ``HTTPS_PROXY``/``HTTP_PROXY``/``ALL_PROXY``
name for the archive's URL, unless ``NO_PROXY`` matches its host, by the rules of the artifact
downloads (:mod:`sbproxy.model_host.artifacts.proxies`; the redirects GitHub answers with go
through the same proxy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field

from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.artifacts.download import read_timeout_s
from sbproxy.model_host.artifacts.errors import TransportError
from sbproxy.model_host.artifacts.proxies import proxy_settings, refused
from sbproxy.model_host.engines.archives import extract_safely
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.llama_build import BuildOutput, published_build, version_of
from sbproxy.model_host.registry import registry
from sbproxy.workflows import RetryPolicy, StepContext, WorkflowContext, step

__all__ = ["FetchInput", "engine_fetch_workflow", "published_release", "release_identity"]

MAX_ARCHIVE_BYTES = 512 * 1024 * 1024
_SEARCH_DEPTH = 6
BASE_URL_ENV = "SBPROXY_LLAMA_RELEASE_BASE_URL"
DEFAULT_BASE_URL = "https://github.com/ggml-org/llama.cpp/releases/download"


class FetchInput(BaseModel):
    """One pinned release archive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tag: str
    infix: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def release_identity(request: FetchInput) -> str:
    """Directory name of a published release."""
    return f"release-{request.tag}-{request.infix}"


def archive_url(request: FetchInput) -> str:
    """Where the archive is downloaded from (the mirror base when configured)."""
    base = (os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/")
    return f"{base}/{request.tag}/llama-{request.tag}-bin-{request.infix}.tar.gz"


def published_release(layout: CacheLayout, request: FetchInput) -> BuildOutput | None:
    """The published release, if its marker and binary are present."""
    return published_build(layout, release_identity(request))


def _staging_archive(layout: CacheLayout, request: FetchInput) -> Path:
    return layout.engines / "staging" / f"{release_identity(request)}.tar.gz"


@step("download", retry=RetryPolicy(max_attempts=5, initial_delay_s=1.0, max_delay_s=15.0))
async def download_archive(ctx: StepContext, request: FetchInput) -> str:
    """Download and verify the archive.

    Idempotency: a verified archive already in staging is kept; otherwise the file is
    rewritten from the start.

    Raises:
        ProxyError: ``invalid_proxy`` for a proxy variable that cannot be used.
        TransportError: ``transport`` (retryable) when the host or the proxy cannot be
            reached, or the proxy answers ``CONNECT`` with a 5xx.
        HttpStatusError: ``http_status`` when the proxy refuses (407 or another 4xx).
        EngineError: ``engine_provision_failed`` for a status other than 200 (retryable
            for 429 and 5xx) or an oversized archive; ``engine_blocked`` for a digest other
            than the pin.
    """
    layout = ctx.resource(ArtifactCache).layout
    target = _staging_archive(layout, request)
    target.parent.mkdir(parents=True, exist_ok=True)
    url = archive_url(request)
    digest = hashlib.sha256()
    received = 0
    proxy = proxy_settings().for_url(url)
    import aiohttp  # only this step needs it: `models pull` starts without it

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=15.0, sock_read=read_timeout_s())
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session,
            session.get(
                url,
                proxy=proxy.shown if proxy is not None else None,
                # aiohttp sends proxy_headers only with a CONNECT (https); a plain http GET
                # through the proxy carries them itself (aiohttp drops them on a redirect to
                # another origin, so an authenticating proxy then answers 407).
                proxy_headers=proxy.headers() if proxy is not None else None,
                headers=proxy.headers() if proxy is not None and url.startswith("http:") else None,
            ) as response,
        ):
            if proxy is not None and response.status == 407:
                raise refused(proxy, url, response.status, response.reason or "")
            if response.status != 200:
                retryable = response.status == 429 or response.status >= 500
                raise EngineError(
                    f"GET {url} answered HTTP {response.status}",
                    code="engine_provision_failed",
                    retryable=retryable,
                )
            with target.open("wb") as sink:
                async for block in response.content.iter_chunked(1024 * 1024):
                    received += len(block)
                    if received > MAX_ARCHIVE_BYTES:
                        raise EngineError(
                            f"{url} is larger than {MAX_ARCHIVE_BYTES} bytes",
                            code="engine_provision_failed",
                        )
                    digest.update(block)
                    sink.write(block)
                    ctx.check_cancelled()
    except aiohttp.ClientHttpProxyError as exc:
        assert proxy is not None  # noqa: S101 - only a proxied GET meets a proxy's answer
        raise refused(proxy, url, exc.status, exc.message) from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        via = f" through the proxy {proxy.shown} (from {proxy.variable})" if proxy else ""
        raise TransportError(f"GET {url}{via}: {type(exc).__name__}: {exc}") from exc
    if digest.hexdigest() != request.sha256:
        target.unlink(missing_ok=True)
        raise EngineError(
            f"{url} has SHA-256 {digest.hexdigest()}, not the pinned {request.sha256}",
            code="engine_blocked",
            remediation="The release archive changed upstream; nothing was installed.",
        )
    return str(target)


def _find_server(root: Path) -> Path | None:
    for candidate in (root / "build" / "bin", root / "bin", root):
        if (candidate / "llama-server").is_file():
            return candidate / "llama-server"
    for path in root.rglob("llama-server"):
        if path.is_file() and len(path.relative_to(root).parts) <= _SEARCH_DEPTH:
            return path
    return None


def _unpack(archive: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as bundle:
        extract_safely(archive, bundle, target)
    server = _find_server(target)
    if server is None:
        raise EngineError(f"{archive} has no llama-server", code="engine_provision_failed")
    server.chmod(0o755)
    return server


@step("publish")
async def publish_release(ctx: StepContext, request: FetchInput) -> BuildOutput:
    """Unpack, check ``--version``, publish atomically.

    Idempotency: an already published release is returned as is; a leftover staging
    directory is replaced.
    """
    layout = ctx.resource(ArtifactCache).layout
    existing = published_release(layout, request)
    if existing is not None:
        return existing
    identity = release_identity(request)
    final = layout.engines / "llama.cpp" / identity
    staging = layout.engines / "llama.cpp" / f".staging-{identity}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    server = await anyio.to_thread.run_sync(_unpack, _staging_archive(layout, request), staging)
    version = await anyio.to_thread.run_sync(version_of, server)
    relative = server.relative_to(staging)
    output = BuildOutput(
        identity=identity,
        directory=str(final),
        executable=str(final / relative),
        version=version,
    )
    marker = {**output.model_dump(), "archive_sha256": request.sha256, "url": archive_url(request)}
    (staging / "build.json").write_text(json.dumps(marker, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    _staging_archive(layout, request).unlink(missing_ok=True)
    return output


@registry.workflow("engine_fetch", version=1)
async def engine_fetch_workflow(ctx: WorkflowContext, request: FetchInput) -> BuildOutput:
    """Download, verify and publish a pinned llama.cpp release."""
    await ctx.step(download_archive, request)
    return await ctx.step(publish_release, request)
