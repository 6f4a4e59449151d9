"""ftd.waiting.wait_for: a condition that is not ready yet is retried; a bug fails at once."""

from __future__ import annotations

import itertools

import pytest

from ftd.waiting import Timeout, wait_for


def test_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_for(lambda: next(counter) >= 3 and "ready", 5.0, "the counter", interval_s=0.0) == "ready"


def test_connection_errors_are_not_yet_and_reported_on_timeout() -> None:
    def refuse() -> None:
        raise ConnectionRefusedError("nobody listens on 127.0.0.1:1")

    with pytest.raises(Timeout, match="nobody listens"):
        wait_for(refuse, 0.05, "a listener", interval_s=0.01)


def test_unexpected_exceptions_propagate_at_once() -> None:
    calls = []

    def buggy() -> None:
        calls.append(1)
        raise KeyError("node-0")

    with pytest.raises(KeyError, match="node-0"):
        wait_for(buggy, 30.0, "a buggy condition")
    assert calls == [1]
