"""``ftd-agent``: the per-node daemon."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from ftd import logs
from ftd.hardening import harden_process
from ftd.identity import PkiError
from ftd.settings import load_or_exit

from . import service
from .daemon import AgentDaemon
from .settings import ENV_PREFIX, AgentSettings


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_or_exit(
        AgentSettings, sys.argv[1:] if argv is None else argv, os.environ, prog="ftd-agent",
        env_prefix=ENV_PREFIX, description="ftd node agent: registration, heartbeats, supervision, drills.",
    )
    logs.configure(settings.log_level, component="agent")
    harden_process()  # umask 0077 (its shards and logs are its own) and the soft open-file limit at the hard one
    try:
        daemon = AgentDaemon(settings)
    except PkiError as exc:
        print(f"ftd-agent: cannot serve with mTLS: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        daemon.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.start(service.add_to_server)
    daemon.wait()
    daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
