"""The systemd notify protocol (``sd_notify``), spoken directly: one datagram to ``$NOTIFY_SOCKET``.

Daemons send ``READY=1`` only once their gRPC listener accepts connections, ``WATCHDOG=1`` from their
main loop (so a wedged loop gets the unit restarted after ``WatchdogSec``), and ``STOPPING=1`` on a
graceful stop. Outside systemd every call is a cheap no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("ftd.systemd")


def notify(message: str) -> bool:
    """Sends ``message`` (e.g. ``"READY=1\\nSTATUS=serving"``); False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", address, exc)
        return False


def watchdog_period_s() -> float | None:
    """Half of ``WatchdogSec`` when systemd asked this process for pings, else ``None``."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


class Watchdog:
    """Call :meth:`tick` from the main loop as often as you like; it pings at the right period."""

    def __init__(self) -> None:
        self.period = watchdog_period_s()
        self._last = 0.0

    def tick(self) -> None:
        if self.period is None:
            return
        now = time.monotonic()
        if now - self._last >= self.period:
            self._last = now
            notify("WATCHDOG=1")
