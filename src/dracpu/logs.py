"""Logging setup of the daemon: readable text for people, one JSON object per line for machines.

Code logs with ``logging.getLogger(__name__)``, ``%s`` arguments, and context through ``extra=``
(``claim``, ``pod``, ``container``, ...). Both formats show that context: text appends
``key=value`` pairs, JSON adds the keys to the object.

Verbosity follows klog's ``-v=N`` (upstream's flag): 0 logs INFO and above; 1 and more add our
DEBUG messages (upstream's manifests run with ``--v=4``, klog's debug level); from 6 on the
libraries' DEBUG messages (kubernetes, asyncio, watchfiles, ...) are shown too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal, TextIO

__all__ = ["JsonFormatter", "TextFormatter", "setup_logging"]

# Verbosity thresholds (klog -v=N): our debug from 1, libraries' debug from 6 (klog's level for
# request/response dumps).
DEBUG_VERBOSITY = 1
LIBRARY_DEBUG_VERBOSITY = 6

# Our loggers live under this name (logging.getLogger(__name__) in every module).
_OUR_LOGGER = "dracpu"

# Libraries that log routine chatter at INFO: watchfiles says "N changes detected" on every CDI
# write. They speak at WARNING and above until LIBRARY_DEBUG_VERBOSITY.
_CHATTY_LIBRARIES = ("watchfiles",)

# Attributes every LogRecord has; anything else on a record came in through ``extra=``.
_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
) | {"message", "asctime", "taskName"}

# A marker on the handler we install, so that a second setup_logging() replaces it.
_HANDLER_MARK = "_dracpu_handler"


def _context(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES}


def _timestamp(record: logging.LogRecord) -> str:
    """RFC 3339 in UTC with milliseconds: ``2026-05-01T12:00:00.123Z``."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the ``extra=`` context and, when
    there is one, the exception with its traceback (``exception``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _context(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``2026-05-01T12:00:00.123Z INFO  dracpu.daemon: message key=value ...``, then any
    traceback on the following lines."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname:<5} {record.name}: {record.getMessage()}"
        context = " ".join(f"{k}={_text_value(v)}" for k, v in _context(record).items())
        if context:
            line = f"{line} {context}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
        return line


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


def setup_logging(
    log_format: Literal["text", "json"], verbosity: int, *, stream: TextIO | None = None
) -> None:
    """Send every log record to ``stream`` (stderr) in ``log_format`` at ``verbosity``.

    Calling it again replaces the handler it installed before (tests, ``dracpu sim``).
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity >= LIBRARY_DEBUG_VERBOSITY else logging.INFO)
    logging.getLogger(_OUR_LOGGER).setLevel(
        logging.DEBUG if verbosity >= DEBUG_VERBOSITY else logging.INFO
    )
    for name in _CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(
            logging.DEBUG if verbosity >= LIBRARY_DEBUG_VERBOSITY else logging.WARNING
        )
