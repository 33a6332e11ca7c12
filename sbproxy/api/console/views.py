"""Pure helpers of the console's pages: SVG charts, display formats, job subjects.

Nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from markupsafe import Markup, escape

__all__ = [
    "Series",
    "chart_svg",
    "format_age_ms",
    "format_bytes",
    "format_ms",
    "subject_label",
]

ARTIFACT_SUBJECT: Final = "artifact:sha256:"
DIGEST_SHOWN: Final = 12


def artifact_name(job_input: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(digest, "model:variant")`` from a pull job's input (its ``artifact``), else
    ``None``."""
    artifact = job_input.get("artifact")
    if not isinstance(artifact, Mapping):
        return None
    digest, model, variant = (
        artifact.get("digest"),
        artifact.get("logical_model"),
        artifact.get("variant_id"),
    )
    if not all(isinstance(v, str) and v for v in (digest, model, variant)):
        return None
    return str(digest), f"{model}:{variant}"


def subject_label(
    subject: str | None, job_input: Mapping[str, Any], names: Mapping[str, str]
) -> str:
    """What a job acts on, as an operator names it.

    ``artifact:sha256:<digest>`` becomes the artifact's ``model:variant`` (from the job's own
    input, else ``names``: digest -> ``model:variant`` from the cache and other pulls), or
    ``sha256:<first 12 hex>…`` when nothing names it; any other subject is shown as it is.
    The page keeps the whole subject in the cell's ``title`` and on the job's page.
    """
    if subject is None:
        return "-"
    if not subject.startswith(ARTIFACT_SUBJECT):
        return subject
    digest = subject.removeprefix(ARTIFACT_SUBJECT)
    own = artifact_name(job_input)
    if own is not None and own[0] == digest:
        return own[1]
    return names.get(digest) or f"sha256:{digest[:DIGEST_SHOWN]}…"


def format_bytes(value: int | None) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units); ``None`` -> ``-``."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - the loop returns at GiB


def format_ms(value: int | None) -> str:
    """Epoch milliseconds as ``YYYY-MM-DD HH:MM:SS`` UTC; ``None`` -> ``-``."""
    if value is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value / 1000))


def format_age_ms(value: int | None) -> str:
    """A duration in milliseconds for people: ``850 ms``, ``4.2 s``, ``3 min 5 s``,
    ``2 h 10 min``; ``None`` -> ``-``."""
    if value is None:
        return "-"
    if value < 1000:
        return f"{value} ms"
    seconds = value / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


@dataclass(frozen=True)
class Series:
    """One line of a chart: ``points`` are ``(epoch ms, value)``, oldest first."""

    name: str
    points: Sequence[tuple[int, float]]
    css_class: str


def chart_svg(
    series: Sequence[Series],
    *,
    start_ms: int,
    end_ms: int,
    title: str,
    unit: str,
    width: int = 560,
    height: int = 140,
) -> Markup:
    """An inline SVG line chart of ``series`` over ``[start_ms, end_ms]``; the y axis runs
    from 0 to the largest value shown (at least 1). Points outside the window are left out.
    """
    pad_left, pad_right, pad_top, pad_bottom = 44, 8, 18, 18
    inner_w = width - pad_left - pad_right
    inner_h = height - pad_top - pad_bottom
    span = max(1, end_ms - start_ms)
    shown = [[(t, v) for t, v in s.points if start_ms <= t <= end_ms] for s in series]
    top = max([1.0, *(v for points in shown for _, v in points)])

    def x(t: int) -> float:
        return pad_left + (t - start_ms) / span * inner_w

    def y(v: float) -> float:
        return pad_top + inner_h - v / top * inner_h

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" aria-label="{escape(title)}">',
        f'<text x="{pad_left}" y="12" class="chart-title">{escape(title)}</text>',
        f'<line x1="{pad_left}" y1="{pad_top + inner_h}" x2="{width - pad_right}" '
        f'y2="{pad_top + inner_h}" class="axis"/>',
        f'<line x1="{pad_left}" y1="{pad_top}" x2="{pad_left}" y2="{pad_top + inner_h}" '
        'class="axis"/>',
        f'<text x="{pad_left - 4}" y="{pad_top + 4}" class="tick" text-anchor="end">'
        f"{top:.0f}</text>"
        if top >= 100
        else f"{top:.3g}</text>",
        f'<text x="{pad_left - 4}" y="{pad_top + inner_h}" class="tick" text-anchor="end">0</text>',
        f'<text x="{width - pad_right}" y="{height - 4}" class="tick" text-anchor="end">now</text>',
        f'<text x="{pad_left}" y="{height - 4}" class="tick">-{span // 60000} min</text>',
        f'<text x="{width // 2}" y="{height - 4}" class="tick" text-anchor="middle">'
        f"{escape(unit)}</text>",
    ]
    for entry, points in zip(series, shown, strict=True):
        if not points:
            continue
        coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points)
        css = escape(entry.css_class)
        parts.append(
            f'<polyline class="series {css}" points="{coords}" fill="none">'
            f"<title>{escape(entry.name)}</title></polyline>"
        )
        parts.extend(
            f'<circle class="series {css}" cx="{x(t):.1f}" cy="{y(v):.1f}" r="2"/>'
            for t, v in points[-60:]
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every interpolated text is escaped above
