"""Whether a spare may be promoted, judged from the health verdict its agent last reported.

The agent evaluates its own health (``ftd.agent.health_rules.evaluate``) and reports the verdict
with its heartbeats; the coordinator's placement only reads it, through these pure functions of
``(verdict, now, max_age_s)``, so a spare that fails — or whose verdict is too old to trust — is
passed over with a reason an operator can read. Nothing here imports the agent or the proto: any
object with ``healthy``, ``reason`` and ``checked_unix_s`` will do (the ``HealthVerdict`` message,
``HealthReport``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol


class Verdict(Protocol):
    @property
    def healthy(self) -> bool: ...

    @property
    def reason(self) -> str: ...

    @property
    def checked_unix_s(self) -> float: ...  # the agent's wall clock when it measured


def eligible_for_promotion(
    verdict: Verdict | None, now_unix: float, max_age_s: float, require_verdict: bool = True
) -> tuple[bool, str]:
    """A spare is promotable when its latest verdict is healthy and at most ``max_age_s`` old.

    Agents and coordinator compare wall clocks, so a verdict dated more than ``max_age_s`` in the
    future (clock skew) is not trusted either. ``require_verdict=False`` lets a spare without any
    verdict through (agents of a version that does not report one, during a rolling upgrade)."""
    if verdict is None:
        if require_verdict:
            return False, "no health verdict reported yet"
        return True, "no health verdict reported (not required)"
    checked = verdict.checked_unix_s
    if checked <= 0:
        return False, "health verdict has no time of measurement"
    age = now_unix - checked
    if age > max_age_s:
        return False, f"health verdict is {age:.0f}s old (max_age_s={max_age_s:g})"
    if age < -max_age_s:
        return False, f"health verdict is dated {-age:.0f}s in the future (clock skew?)"
    if not verdict.healthy:
        return False, f"unhealthy: {verdict.reason or 'no reason given'}"
    return True, f"healthy as of {max(age, 0.0):.0f}s ago"


def split_candidates(
    candidates: Iterable[str],
    verdicts: Mapping[str, Verdict | None],
    now_unix: float,
    max_age_s: float,
    require_verdict: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """Candidates (node ids, order kept) that may be promoted, and why each other one may not."""
    eligible: list[str] = []
    rejected: dict[str, str] = {}
    for node_id in candidates:
        ok, why = eligible_for_promotion(verdicts.get(node_id), now_unix, max_age_s, require_verdict)
        if ok:
            eligible.append(node_id)
        else:
            rejected[node_id] = why
    return eligible, rejected
