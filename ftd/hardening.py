"""What every ftd daemon does to its own process at start: files it makes are its own, and it may hold
as many connections as its hard limit allows.

* umask 0077: checkpoints, logs, ready files and sockets are not world-readable, whatever the caller's
  umask was (``ftctl up`` ran with 0022: every tier's shards were readable by any local user).
* The soft ``RLIMIT_NOFILE`` raised to the hard one: 3000 idle connections pinned a coordinator at
  1024 descriptors, and new clients and ``/healthz`` then failed. systemd's ``LimitNOFILE`` sets the
  hard limit; Kubernetes has no per-pod setting (the container runtime's default applies), so the
  daemon raises what it is given.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("ftd")

UMASK = 0o077


def harden_process() -> tuple[int, int]:
    """Sets the umask and raises the soft open-file limit; returns the (soft, hard) limit now in force."""
    os.umask(UMASK)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft, hard
