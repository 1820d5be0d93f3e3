"""Progress of a Prepare: the event record and a plain-text bar for the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class ProgressEvent:
    """One step of a Prepare. ``phase`` is ``"read"``, ``"pack"``, ``"write"``, ``"validate"`` or
    ``"fetch"`` (from an object store);
    ``layers_done``/``layers_total`` count packed layers; ``bytes_written`` counts bytes of
    tensor data written so far; ``message`` is a short human line."""

    phase: str
    layers_done: int = 0
    layers_total: int = 0
    bytes_written: int = 0
    message: str = ""


class ProgressBar:
    """Draws ``[#####.....] 12/30 layers  45.1 MiB  pack`` on one line (``\\r``-rewritten) of
    ``stream`` when it is a terminal. Anything else (a log file, a pipe) gets one plain line per
    phase instead (``pack: 0/30 layers 0.0 MiB``), so no carriage return lands in a log.
    :meth:`update` is a ``progress`` callback for :func:`weight_service.prepare.prepare`. ``tty``
    overrides the ``stream.isatty()`` test."""

    def __init__(self, stream: TextIO, width: int = 30, tty: bool | None = None) -> None:
        self._stream = stream
        self._width = width
        self._tty = tty if tty is not None else bool(getattr(stream, "isatty", lambda: False)())
        self._drawn = False
        self._phase = ""
        self._done = self._total = self._bytes = 0

    def update(self, event: ProgressEvent) -> None:
        """Redraw for ``event`` (on a terminal), or write a line when the phase changes (otherwise)."""
        if event.layers_total:  # "read"/"validate" events carry no counts: keep the last ones
            self._done, self._total = event.layers_done, event.layers_total
            self._bytes = event.bytes_written
        if not self._tty:
            if event.phase != self._phase:
                self._phase = event.phase
                line = f"{event.phase}: {self._done}/{self._total} layers {self._bytes / (1 << 20):.1f} MiB"
                self._stream.write(line + (f": {event.message}" if event.message else "") + "\n")
                self._stream.flush()
            return
        frac = self._done / self._total if self._total else 0.0
        filled = int(round(frac * self._width))
        bar = "#" * filled + "." * (self._width - filled)
        mib = self._bytes / (1 << 20)
        line = f"\r[{bar}] {self._done}/{self._total} layers {mib:8.1f} MiB  {event.phase}"
        if event.message:
            line += f": {event.message}"
        self._stream.write(line[:160].ljust(100))
        self._stream.flush()
        self._drawn = True

    def finish(self) -> None:
        """End the bar's line (only if something was drawn)."""
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False
