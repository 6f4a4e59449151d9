"""What a node id may be: one rule for the agent that takes its id from its settings and the
coordinator that admits it, because a node id becomes an etcd key, a directory name and the name in a
node certificate (``node/<id>``)."""

from __future__ import annotations

import re

NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # whole string: re.fullmatch


def valid_node_id(node_id: str) -> bool:
    """No separators, no dot-dot, bounded length."""
    return NODE_ID_RE.fullmatch(node_id) is not None and node_id not in (".", "..")
