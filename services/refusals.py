"""Requests refused at a limit, counted by reason: ``warmserve_refused_total{reason=...}``.

A limit's refusal is a :class:`~services.errors.WarmserveError` whose ``reason`` is set
(``prompt_bytes``, ``stop_strings``, ``stop_token_ids``, ``structured``, ``unicode``,
``stream_in_flight``, ``overloaded``); a servicer hands every error it answers to :meth:`Refusals.abort` (or
:meth:`Refusals.count`), and the daemon registers its :class:`Refusals` on the server's
Prometheus registry (:attr:`services.bootstrap.ServiceServer.registry`). See
``docs/architecture.md`` §1.
"""

from __future__ import annotations

import threading

import grpc
from prometheus_client.core import CounterMetricFamily

from services.errors import WarmserveError, abort_with


class Refusals:
    """Refusal counts per reason (thread-safe); a Prometheus collector of
    ``warmserve_refused_total{reason}``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def count(self, err: BaseException) -> None:
        """Count ``err`` when it is a limit's refusal (a ``WarmserveError`` with a ``reason``)."""
        reason = getattr(err, "reason", "")
        if reason:
            self.add(reason)

    def add(self, reason: str) -> None:
        """Count one refusal for ``reason``."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def abort(self, context: grpc.ServicerContext, err: WarmserveError) -> None:
        """:meth:`count` ``err``, then :func:`services.errors.abort_with` it. Never returns (raises)."""
        self.count(err)
        abort_with(context, err)

    def get(self, reason: str) -> int:
        """Requests refused for ``reason`` so far."""
        with self._lock:
            return self._counts.get(reason, 0)

    def collect(self):
        """Prometheus collector protocol: one sample per reason seen."""
        family = CounterMetricFamily("warmserve_refused", "requests refused at a limit, by reason",
                                     labels=["reason"])
        with self._lock:
            counts = sorted(self._counts.items())
        for reason, n in counts:
            family.add_metric([reason], n)
        yield family
