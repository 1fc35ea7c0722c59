"""Charts for maintainers who would rather look than read summary.json (matplotlib, SVG).

acceptance.svg (cpu_e2e): each speculative engine's acceptance rate per draft position in this
run (bars, one colour per series) and, when there is history, acceptance length over the last
runs and this one (lines, same colours) with each series' floor dashed.
window.svg (gate): per step, one mark per run of the window it judged: clean, failure, 75, flaky,
not judged (no floors recorded for its vLLM version).

Figures are built without pyplot (no GUI backend is ever chosen, no global figure state) and
sized for a 1000-px wide Buildkite annotation. Text stays text (svg.fonttype none) and every
series carries an id (`<g id="bar:...">`, `line:`, `floor:`, `mark:`), so people and tests can
find them in the SVG.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

from specgate.ciside import drift, history
from specgate.contract import artifacts
from specgate.contract import summary as contract

WIDTH_IN = 10.4   # 748.8 pt = 998 px
STYLE: dict[RcKeyType, Any] = {"svg.fonttype": "none", "svg.hashsalt": "specgate", "font.size": 11,
                               "axes.titlesize": 12, "legend.fontsize": 10}
MARKS = {"clean": ("o", "tab:green"), "failure": ("X", "tab:red"), "75": ("^", "tab:orange"),
         "flaky": ("D", "tab:purple"), "not judged": ("s", "tab:gray")}


@dataclass
class Series:
    """One speculative engine of a run: what its tests measured."""
    key: str                    # the engine key: one model identity and speculative configuration
    label: str
    acceptance_len: float
    floor: float | None
    rates: list[float] | None   # acceptance rate per draft position


def series(summary: dict[str, Any]) -> dict[str, Series]:
    """A cpu_e2e summary's speculative engines, keyed by engine key (tests sharing one engine count once)."""
    engines = summary.get("engines") or []
    speculative = {key for key, phase in contract.phases_by_key(engines).items()
                   if phase["method"] not in (None, "none")}
    found: dict[str, Series] = {}
    for entry in summary["tests"]:
        key = next((k for k in entry.get("engines") or () if k in speculative), None)
        if key is None or not isinstance(entry.get("acceptance_len"), (int, float)):
            continue
        if key in found:
            found[key].floor = found[key].floor or entry.get("threshold")
            continue
        label = f"{entry.get('method')}: {_model(entry, key)}"
        taken = sum(s.label.split(" #")[0] == label for s in found.values())
        found[key] = Series(key, f"{label} #{taken + 1}" if taken else label, entry["acceptance_len"],
                            entry.get("threshold"), drift.position_rates(entry, engines))
    return found


def _model(entry: dict[str, Any], key: str) -> str:
    """The series' checkpoint (the draft, else the target): a hub checkpoint by the last part of
    its id, a fixture by its own name first, "<fixture> (stand-in for <hub id>)"."""
    target, draft = contract.model_labels({**entry, "key": key})
    name, shown = (entry.get("draft"), draft) if entry.get("draft") else (entry.get("target"), target)
    if shown is None or shown == name:
        return (name or "?").rsplit("/", 1)[-1]
    return shown


def _run_series(run: history.Run) -> dict[str, Series]:
    return {key: s for shard in run.shards for key, s in series(shard.summary).items()}


def _colors(keys: Sequence[str]) -> dict[str, Any]:
    colormap = matplotlib.colormaps["tab10"]
    assert isinstance(colormap, ListedColormap)  # tab10 is a list of ten colours
    palette = colormap.colors
    return {key: palette[i % len(palette)] for i, key in enumerate(keys)}


def acceptance_figure(record: dict[str, Any], past: Sequence[history.Run]) -> Figure:
    """This run's per-position acceptance, and acceptance length over `past` (newest first) and this run."""
    now = series(record)
    timeline = [_run_series(run) for run in reversed(past)] + [now]
    keys = list(now) + [k for points in timeline for k in points if k not in now]
    keys = list(dict.fromkeys(keys))
    colors = _colors(keys)
    fig = Figure(figsize=(WIDTH_IN, 8.0 if past else 4.5), layout="constrained")
    bars = fig.add_subplot(2, 1, 1) if past else fig.add_subplot()
    host = record.get("host") or {}
    bars.set_title(f"Acceptance rate per draft position, this run (vLLM {record.get('vllm_version')}, "
                   f"{host.get('cores')} cores)")
    drawn = [(s, s.rates) for s in now.values() if s.rates]
    width = 0.8 / max(len(drawn), 1)
    for i, (s, rates) in enumerate(drawn):
        positions = [p + 1 - 0.4 + width * (i + 0.5) for p in range(len(rates))]
        container = bars.bar(positions, rates, width, label=s.label, color=colors[s.key])
        for p, patch in enumerate(container.patches, start=1):
            patch.set_gid(f"bar:{s.label}:position {p}")
    if drawn:
        bars.set_xticks(range(1, max(len(rates) for _, rates in drawn) + 1))
        bars.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        bars.text(0.5, 0.5, "no speculative engine drafted in this run", ha="center", va="center",
                  transform=bars.transAxes)
    bars.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1.05))
    if past:
        _lengths(fig.add_subplot(2, 1, 2), [run.label for run in reversed(past)] + ["this run"], timeline, keys,
                 colors, {**{k: s for points in timeline for k, s in points.items()}, **now})
    return fig


def _lengths(ax: Any, labels: list[str], timeline: list[dict[str, Series]], keys: list[str],
             colors: dict[str, Any], latest: dict[str, Series]) -> None:
    ax.set_title(f"Acceptance length over the last {len(labels) - 1} run(s) and this one (floors dashed)")
    for key in keys:
        s = latest[key]
        values = [points[key].acceptance_len if key in points else math.nan for points in timeline]
        (line,) = ax.plot(range(len(labels)), values, marker="o", color=colors[key], label=s.label)
        line.set_gid(f"line:{s.label}")
        if s.floor is not None:
            ax.axhline(s.floor, color=colors[key], linestyle="--", linewidth=1).set_gid(f"floor:{s.label}")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set(ylabel="1 + accepted / drafts")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))


def window_figure(steps: Sequence[tuple[str, str, Sequence[tuple[str, str]]]]) -> Figure:
    """(step, verdict line, [(run label, mark)] oldest first) per step: one row of marks each."""
    fig = Figure(figsize=(WIDTH_IN, 1.0 + 1.7 * max(len(steps), 1)), layout="constrained")
    for index, (step, verdict, marks) in enumerate(steps, start=1):
        ax = fig.add_subplot(len(steps), 1, index)
        ax.set_title(f"{step}: {verdict}", loc="left")
        for x, (label, mark) in enumerate(marks):
            shape, color = MARKS[mark]
            (point,) = ax.plot([x], [0], marker=shape, color=color, markersize=14, linestyle="none")
            point.set_gid(f"mark:{step}:{label}:{mark}")
        # Rotated, so 20 run labels ("build 1234") stay apart on one axis.
        ax.set_xticks(range(len(marks)), [label for label, _ in marks], rotation=45, ha="right")
        ax.set(yticks=[], xlim=(-0.6, max(len(marks), 1) - 0.4), xlabel="run, oldest left")
        if not marks:
            ax.text(0.5, 0.5, "no runs in the history", ha="center", va="center", transform=ax.transAxes)
    fig.legend([Line2D([], [], marker=shape, color=color, linestyle="none", markersize=10)
                for shape, color in MARKS.values()], list(MARKS), loc="outside upper right", ncols=len(MARKS))
    return fig


def write(path: Path, figure: Any, *args: Any) -> Path:
    """Render figure(*args) to an SVG file at path (atomically)."""
    with matplotlib.rc_context(STYLE):
        buffer = io.StringIO()
        figure(*args).savefig(buffer, format="svg", metadata={"Date": None})
    artifacts.write_atomic(path, buffer.getvalue())
    return path
