"""A picture of the engine-state timeline: running / finishing / draining / idle over steps, with jobs in
flight. Needs matplotlib (the ``plot`` extra: ``pip install 'kvfsm[plot]'``); imported only when drawing.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.machines.names import EngineState

if TYPE_CHECKING:  # the engine needs torch; drawing a timeline does not
    from kvfsm.engine.core import StepRecord

__all__ = ["STATE_COLOURS", "PlotUnavailable", "legend_entries", "plot_timeline", "require_matplotlib", "state_runs"]

STATE_COLOURS: dict[EngineState, str] = {
    EngineState.RUNNING: "#2e7d32",
    EngineState.FINISHING: "#f9a825",
    EngineState.DRAINING: "#ef6c00",
    EngineState.IDLE: "#9e9e9e",
    EngineState.SHUTTING_DOWN: "#6a1b9a",
    EngineState.STOPPED: "#212121",
}


#: The states of the engine's normal cycle: always in the legend, so a picture says when one never occurred.
CYCLE_STATES: tuple[EngineState, ...] = (
    EngineState.RUNNING,
    EngineState.FINISHING,
    EngineState.DRAINING,
    EngineState.IDLE,
)
_INSTALL_HINT = "matplotlib is not installed; install the extra with: pip install 'kvfsm[plot]'"


class PlotUnavailable(KvfsmError, RuntimeError):
    """matplotlib is not installed; the message says how to install the extra."""


def require_matplotlib() -> None:
    """PlotUnavailable now, before any work, if a picture could not be drawn later."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable(_INSTALL_HINT)


def legend_entries(records: Sequence[StepRecord]) -> list[tuple[EngineState, str]]:
    """``(state, label)`` for the legend: the cycle states (running, finishing, draining, idle) and every
    other state the records pass through (after those, in enum order), each with its number of steps."""
    counts = {state: 0 for state in EngineState}
    for rec in records:
        counts[rec.state] += 1
    shown = [*CYCLE_STATES, *(s for s in EngineState if s not in CYCLE_STATES and counts[s])]
    return [(s, f"{s.value} ({counts[s]} step{'' if counts[s] == 1 else 's'})") for s in shown]


def state_runs(records: Sequence[StepRecord]) -> list[tuple[EngineState, int, int]]:
    """Maximal runs of one engine state: ``(state, first step, last step)``, in order."""
    runs: list[tuple[EngineState, int, int]] = []
    for rec in records:
        if runs and runs[-1][0] is rec.state and runs[-1][2] == rec.step - 1:
            state, first, _ = runs[-1]
            runs[-1] = (state, first, rec.step)
        else:
            runs.append((rec.state, rec.step, rec.step))
    return runs


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as exc:
        raise PlotUnavailable(_INSTALL_HINT) from exc
    matplotlib.use("Agg")  # files only, never a window
    return importlib.import_module("matplotlib.pyplot")


def plot_timeline(
    records: Sequence[StepRecord],
    path: str | Path,
    *,
    title: str = "engine state over steps",
    markers: Sequence[tuple[int, str]] = (),
    zoom: tuple[int, int] | None = None,
    zoom_title: str = "",
) -> Path:
    """Draw the states (a coloured band per step) above the jobs in flight and requests scheduled.

    ``markers`` are ``(step, label)`` pairs drawn as vertical lines (e.g. the start of each turn).
    ``zoom`` = ``(first step, last step)`` adds a panel on the right with those steps at a readable width
    (a few steps in a long run, such as a drain). The legend lists the cycle states (running, finishing,
    draining, idle) and every other state drawn, with their step counts. Writes a PNG (or any format
    matplotlib knows from the suffix) and returns its path.
    """
    if not records:
        raise ConfigError("no step records to draw; expected the engine's timeline after at least one step")
    zoomed = [r for r in records if zoom is not None and zoom[0] <= r.step <= zoom[1]]
    if zoom is not None and not zoomed:
        raise ConfigError(f"zoom {zoom} holds no step of the timeline; expected a range within its steps")
    plt = _pyplot()
    patches = importlib.import_module("matplotlib.patches")
    if zoomed:
        fig, axes = plt.subplots(
            2,
            2,
            figsize=(12, 3.8),
            sharex="col",
            sharey="row",
            gridspec_kw={"height_ratios": [1, 3], "width_ratios": [4, 1]},
            constrained_layout=True,
        )
        band, jobs = axes[0][0], axes[1][0]
        _draw(axes[0][1], axes[1][1], zoomed, [m for m in markers if zoomed[0].step <= m[0] <= zoomed[-1].step])
        axes[0][1].set_title(zoom_title or f"steps {zoomed[0].step} to {zoomed[-1].step}", fontsize=9)
    else:
        fig, (band, jobs) = plt.subplots(
            2, 1, figsize=(10, 3.8), sharex=True, gridspec_kw={"height_ratios": [1, 3]}, constrained_layout=True
        )
    _draw(band, jobs, records, markers)
    entries = legend_entries(records)
    band.set_ylabel("state", rotation=0, ha="right", va="center")
    band.legend(
        handles=[patches.Patch(color=STATE_COLOURS[s], label=label) for s, label in entries],
        loc="upper center",
        bbox_to_anchor=(0.5, 1.55),
        ncol=len(entries),
        frameon=False,
    )
    band.set_title(title, pad=28)
    jobs.set_ylabel("count")
    jobs.legend(loc="upper right", frameon=False, fontsize=8, ncol=3)
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _draw(band: Any, jobs: Any, records: Sequence[StepRecord], markers: Sequence[tuple[int, str]]) -> None:
    """The state bands and the counts of ``records`` on one pair of axes."""
    steps = [r.step for r in records]
    for state, first, last in state_runs(records):
        band.axvspan(first - 0.5, last + 0.5, color=STATE_COLOURS[state], linewidth=0)
    band.set_yticks([])
    jobs.step(steps, [r.jobs_in_flight for r in records], where="mid", label="jobs in flight", color="#1565c0")
    jobs.step(
        steps, [len(r.scheduled) for r in records], where="mid", label="requests scheduled", color="#2e7d32", alpha=0.7
    )
    flushed = [(r.step, r.flushed) for r in records if r.flushed]
    if flushed:
        jobs.scatter(
            *zip(*flushed, strict=True), marker="v", color="#c62828", label="jobs flushed (blocking)", zorder=3
        )
    for step, label in markers:
        for ax in (band, jobs):
            ax.axvline(step - 0.5, color="black", linewidth=0.8, linestyle=":")
        jobs.annotate(label, (step - 0.4, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=8)
    jobs.set_xlabel("engine step")
    jobs.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    top = max(max(r.jobs_in_flight for r in records), max(len(r.scheduled) for r in records), 1)
    jobs.set_ylim(0, max(top * 1.35 + 0.5, jobs.get_ylim()[1]))  # room for the legend and the turn labels
    jobs.grid(axis="y", alpha=0.3)
