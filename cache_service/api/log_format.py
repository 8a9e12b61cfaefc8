"""The service's log lines: "text" (`time level logger message key=value ...`) or "json"
(one object a line), each with the record's extra fields (method, tenant, code, ms, ...)."""

from __future__ import annotations

import json
import logging
from typing import Any

__all__ = ["configure_logging"]


_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    # Private attributes come from other libraries' record factories (Ray adds one).
    return {
        k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS and not k.startswith("_")
    }


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_extra_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class _TextFormatter(logging.Formatter):
    """`time level logger message key=value ...` (the extra fields at the end)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in _extra_fields(record).items())
        return f"{line} {extra}" if extra else line


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Route the service's loggers ("kvcache.*") to stderr in `fmt` ("text" | "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger("kvcache")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
