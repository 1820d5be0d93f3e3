"""Structured logging: one JSON object per line on stderr.

``configure_logging(service)`` is called once by each daemon's entry point; every record then
carries ``ts`` (unix seconds), ``level``, ``service``, ``logger``, ``msg`` and any ``extra=``
fields given by the caller (``log.info("ready", extra={"port": 50051})``).
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line; non-serialisable extras are ``str()``-ed."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        """``record`` as one JSON line."""
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(service: str, level: str = "INFO") -> None:
    """Route the root logger to stderr as JSON lines tagged with ``service``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime
