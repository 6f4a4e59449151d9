"""The network lab: hosts in their own network namespaces on one machine, and the network faults of the
chaos matrix. Lab tooling, not runtime: only ``ftctl up --isolate``, the chaos matrix and the tests use
it, so it lives beside the runtime package (``ftd.netlab``) rather than inside ``ftd/``.

:mod:`.lab` builds and tears down a lab, :mod:`.ledger` records what was created and removes it after a
crash, :mod:`.plan` holds the pure decisions, :mod:`.relay` is the userspace slow link.
"""

from ftd.netlab.lab import (
    EVERYONE,
    CommandError,
    Cut,
    Host,
    Lab,
    MissingPrivileges,
    NetlabError,
    check_privileges,
    leftovers,
    missing_privileges,
    purge,
)

__all__ = ["EVERYONE", "CommandError", "Cut", "Host", "Lab", "MissingPrivileges", "NetlabError",
           "check_privileges", "leftovers", "missing_privileges", "purge"]
