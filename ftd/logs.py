"""Logging with identity: every line names the component, the node or replica, and the epoch.

An operator grepping one node's story across a thousand log files needs the node id and epoch in
every line, not only in the lines whose author remembered to add them. ``configure`` installs a
filter that stamps the current identity on each record; ``set_identity`` updates it as it changes
(a new epoch, a new leader).
"""

from __future__ import annotations

import logging
import sys
import threading

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s [%(identity)s] %(message)s"
_DATEFMT = "%Y-%m-%dT%H:%M:%S"


class _Identity(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._fields: dict[str, str] = {}
        self._text = "-"

    def update(self, **fields: object) -> None:
        with self._lock:
            for key, value in fields.items():
                if value is None:
                    self._fields.pop(key, None)
                else:
                    self._fields[key] = str(value)
            self._text = " ".join(f"{k}={v}" for k, v in self._fields.items()) or "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.identity = self._text
        return True


_IDENTITY = _Identity()


def configure(level: str = "INFO", **identity: object) -> None:
    """Sends ftd's logs to stderr with the identity stamp; idempotent."""
    _IDENTITY.update(**identity)
    root = logging.getLogger()
    if not any(getattr(h, "_ftd", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        handler.addFilter(_IDENTITY)
        handler._ftd = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level.upper())


def set_identity(**fields: object) -> None:
    """Changes what is stamped on later lines, e.g. ``set_identity(epoch=4)``; ``None`` removes a key."""
    _IDENTITY.update(**fields)
