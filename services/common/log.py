"""Structured logging: one line per event, with the service name and request id."""

import logging
import os
import sys
import time


class _EventFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"{ts} {record.levelname} {self.service} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def get_logger(service: str) -> logging.Logger:
    """The logger of `service`, writing one line per event to stderr (idempotent)."""
    logger = logging.getLogger(f"rlmesh.{service}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_EventFormatter(service))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("RLMESH_LOG_LEVEL", "INFO").upper())
        logger.propagate = False
    return logger


def _quote(value) -> str:
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


_LEVELS = frozenset({logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL})


def log_event(logger: logging.Logger, event: str, request_id: str | None = None,
              level: int = logging.INFO, **fields) -> None:
    """Logs `event request_id=.. k=v ...` on one line. `level` is the logging level (logging.INFO,
    WARNING, ...), never a field: a field named so would set the record's level and drop the line."""
    if level not in _LEVELS:
        raise ValueError(f"log_event({event!r}): level={level!r} is not a logging level; pass one of "
                         f"{sorted(_LEVELS)} (logging.INFO, ...), or give the field another name")
    parts = [event]
    if request_id:
        parts.append(f"request_id={request_id}")
    parts += [f"{k}={_quote(v)}" for k, v in fields.items()]
    logger.log(level, " ".join(parts))
