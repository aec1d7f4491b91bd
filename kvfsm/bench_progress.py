"""Progress for long runs (bench, demo): rich if installed, else tqdm, else plain lines; all on stderr.

``rich`` and ``tqdm`` are optional (the ``progress`` extra). ``enabled=False`` (``--quiet``, ``--json``)
prints nothing at all, so stdout stays clean for scripts.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "progress_backend"]


def progress_backend() -> str:
    """Which library the progress display uses: "rich", "tqdm" or "plain"."""
    for name in ("rich", "tqdm"):
        if importlib.util.find_spec(name) is not None:
            return name
    return "plain"


class Progress:
    """A task bar over ``total`` units: ``advance(note)`` after each one; use as a context manager."""

    def __init__(
        self,
        total: int,
        description: str,
        *,
        enabled: bool = True,
        backend: str | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.total = total
        self.description = description
        self.enabled = enabled
        self.backend = backend or progress_backend()
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._t0 = time.perf_counter()
        self._impl: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        if self.backend == "rich":
            rp: Any = importlib.import_module("rich.progress")
            console: Any = importlib.import_module("rich.console").Console
            BarColumn, MofNCompleteColumn = rp.BarColumn, rp.MofNCompleteColumn
            TextColumn, TimeElapsedColumn = rp.TextColumn, rp.TimeElapsedColumn
            self._impl = rp.Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}"),
                console=console(file=self.stream),
                transient=False,
            )
            self._impl.start()
            self._task = self._impl.add_task(self.description, total=self.total, note="")
        elif self.backend == "tqdm":
            tqdm: Any = importlib.import_module("tqdm").tqdm

            self._impl = tqdm(total=self.total, desc=self.description, file=self.stream, leave=True)
        return self

    def advance(self, note: str = "", n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.backend == "rich":
            self._impl.update(self._task, advance=n, note=note)
        elif self.backend == "tqdm":
            if note:
                self._impl.set_postfix_str(note, refresh=False)
            self._impl.update(n)
        else:
            elapsed = time.perf_counter() - self._t0
            suffix = f" {note}" if note else ""
            self.stream.write(f"[{self.done}/{self.total}] {self.description}{suffix} ({elapsed:.1f} s)\n")
            self.stream.flush()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.enabled or self._impl is None:
            return
        if self.backend == "rich":
            self._impl.stop()
        else:
            self._impl.close()
