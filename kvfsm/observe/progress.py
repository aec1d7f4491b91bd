"""The one progress display for long runs (``kvfsm bench``, ``kvfsm check``): rich if installed, else tqdm, else
plain lines; always on stderr.

``rich`` and ``tqdm`` are optional (the ``progress`` extra brings rich). ``enabled=False`` (``--quiet``,
``--json``) prints nothing at all, so stdout stays clean for scripts. A display has a ``total`` (a bar over that
many units, :meth:`Progress.advance` after each) or none (an open-ended run such as a state-space search, which
only reports a status line through :meth:`Progress.status`).
"""

from __future__ import annotations

import importlib
import sys
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "progress_backend"]

#: Plain lines for an open-ended run are printed at most this often (seconds), and once more at the end.
PLAIN_STATUS_INTERVAL_S = 1.0


def progress_backend() -> str:
    """Which library the progress display uses: "rich", "tqdm" or "plain" (the first that imports)."""
    for name in ("rich.progress", "tqdm"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name.split(".")[0]
    return "plain"


class Progress:
    """A progress display; use as a context manager.

    With a ``total``: ``advance(note)`` after each unit. Without one: ``status(text)`` whenever there is news
    (plain lines are throttled to one a second; ``final=True`` forces one).
    """

    def __init__(
        self,
        total: int | None,
        description: str,
        *,
        enabled: bool = True,
        backend: str | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.total = total
        self.description = description
        self.enabled = enabled
        self.backend = backend or (progress_backend() if enabled else "plain")
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._t0 = time.perf_counter()
        self._last_plain = float("-inf")
        self._impl: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        if self.backend == "rich":
            rp: Any = importlib.import_module("rich.progress")
            console: Any = importlib.import_module("rich.console").Console
            columns = (
                (rp.SpinnerColumn(), rp.TextColumn("[bold]{task.description}[/bold] {task.fields[note]}"))
                if self.total is None
                else (
                    rp.TextColumn("[bold]{task.description}"),
                    rp.BarColumn(),
                    rp.MofNCompleteColumn(),
                    rp.TimeElapsedColumn(),
                    rp.TextColumn("{task.fields[note]}"),
                )
            )
            self._impl = rp.Progress(
                *columns,
                *((rp.TimeElapsedColumn(),) if self.total is None else ()),
                console=console(file=self.stream),
                transient=self.total is None,
            )
            self._impl.start()
            self._task = self._impl.add_task(self.description, total=self.total, note="")
        elif self.backend == "tqdm":
            tqdm: Any = importlib.import_module("tqdm").tqdm
            self._impl = tqdm(total=self.total, desc=self.description, file=self.stream, leave=self.total is not None)
        return self

    def advance(self, note: str = "", n: int = 1) -> None:
        """``n`` more units are done (a bar with a total)."""
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

    def status(self, text: str, *, final: bool = False) -> None:
        """The current status of an open-ended run, replacing the previous one."""
        if not self.enabled:
            return
        if self.backend == "rich":
            self._impl.update(self._task, note=text)
        elif self.backend == "tqdm":
            self._impl.set_postfix_str(text)
        else:
            now = time.perf_counter()
            if final or now - self._last_plain >= PLAIN_STATUS_INTERVAL_S:
                self._last_plain = now
                self.stream.write(f"  {self.description}: {text} ({now - self._t0:.1f} s)\n")
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
