"""ftd.throttle as pure functions of the time they are given: the token bucket's two ways to spend
(a request limit that refuses, a bandwidth limit that goes into debt) and the log throttle."""

from __future__ import annotations

import itertools
import logging

import pytest

from ftd.throttle import LogThrottle, TokenBucket

# ---- TokenBucket: delay (bandwidth) ------------------------------------------------------------------


def test_token_bucket_lets_a_burst_through_then_paces_at_the_rate() -> None:
    bucket = TokenBucket(rate=100.0, burst=50.0)
    assert bucket.delay(50, now=0.0) == 0.0  # the burst goes at once
    assert bucket.delay(100, now=0.0) == pytest.approx(1.0)  # then 100 bytes at 100 B/s
    assert bucket.delay(10, now=1.0) == pytest.approx(0.1)  # the debt was paid by waiting
    assert bucket.delay(0, now=100.0) == 0.0  # a long idle time refills to the burst only...
    assert bucket.delay(60, now=100.0) == pytest.approx(0.1)  # ...not beyond it


def test_a_zero_rate_means_no_limit() -> None:
    bucket = TokenBucket(rate=0.0, burst=0.0)
    assert all(bucket.delay(1 << 30, now=0.0) == 0.0 for _ in range(3))
    assert all(bucket.take(1 << 30, now=0.0) == 0.0 for _ in range(3))


def test_bytes_moved_never_exceed_burst_plus_rate_times_elapsed() -> None:
    rate, burst = 1000.0, 4000.0
    bucket = TokenBucket(rate, burst)
    now, moved = 0.0, 0
    for n in itertools.islice(itertools.cycle([700, 1, 2500, 64]), 400):
        moved += n
        now += bucket.delay(n, now)  # the caller sleeps what it is told
        assert moved <= burst + rate * now + 1e-6
    assert now == pytest.approx((moved - burst) / rate)  # and never waits longer than needed


# ---- TokenBucket: take (requests) --------------------------------------------------------------------


def test_take_refuses_without_consuming_and_says_how_long_to_wait() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0)
    assert [bucket.take(1, now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert bucket.take(1, now=0.0) == pytest.approx(0.5)  # refused: one token comes in 1/rate s
    assert bucket.take(1, now=0.25) == pytest.approx(0.25)  # a refusal took nothing
    assert bucket.take(1, now=0.5) == 0.0
    assert bucket.take(1, now=0.5) > 0


def test_a_clock_that_goes_back_neither_refills_nor_drains() -> None:
    bucket = TokenBucket(rate=1.0, burst=2.0)
    assert bucket.take(2, now=100.0) == 0.0
    assert bucket.take(1, now=50.0) == pytest.approx(1.0)
    assert bucket.take(1, now=51.0) == 0.0  # one second after the clock's new "now"


# ---- LogThrottle -------------------------------------------------------------------------------------


def test_log_throttle_says_how_many_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("t"), period_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, "t"):
        assert throttle.log(logging.ERROR, "k", "boom %s", 1)
        for _ in range(50):
            assert not throttle.log(logging.ERROR, "k", "boom %s", 2)
        assert throttle.log(logging.ERROR, "other", "other kind")
        now[0] = 11.0
        assert throttle.log(logging.ERROR, "k", "boom %s", 3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["boom 1", "other kind", "boom 3 (50 similar message(s) suppressed in the last 10s)"]


def test_allow_is_a_function_of_the_time_given() -> None:
    throttle = LogThrottle(logging.getLogger("t"), period_s=60.0, clock=lambda: pytest.fail("not asked"))
    assert throttle.allow("src:unreachable", now=1000.0) == 0
    assert throttle.allow("src:unreachable", now=1059.0) is None
    assert throttle.allow("src:unreachable", now=1060.0) == 1
    assert throttle.allow("src:unreachable", now=500.0) == 0, "a clock that went back lets a line through"


def test_the_kinds_remembered_are_bounded() -> None:
    throttle = LogThrottle(logging.getLogger("t"), period_s=60.0, max_kinds=3)
    for i in range(10):
        assert throttle.allow(f"kind-{i}", now=0.0) == 0
    assert len(throttle._last) <= 3


def test_a_line_can_carry_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    throttle = LogThrottle(logging.getLogger("t"))
    with caplog.at_level(logging.ERROR, "t"):
        try:
            raise KeyError("bug")
        except KeyError:
            assert throttle.log(logging.ERROR, "bug", "source %s failed", "x", now=0.0, exc_info=True)
    assert caplog.records[0].exc_info is not None and caplog.records[0].getMessage() == "source x failed"
