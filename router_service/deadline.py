"""The caller's deadline as a gRPC servicer sees it, for every router door."""

from __future__ import annotations

import grpc

#: A client without a deadline shows up as a remaining time of about the epoch's age.
_NO_DEADLINE_S = 1e8


def time_left(context: grpc.ServicerContext) -> float | None:
    """Seconds until the caller's deadline, or ``None`` when it set none."""
    left = context.time_remaining()
    return None if left is None or left > _NO_DEADLINE_S else left
