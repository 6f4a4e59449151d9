"""What an S3 error means, decided once for the whole S3 tier.

* **Retries only of idempotent calls** (tenacity; exponential backoff with full jitter,
  ``max_attempts`` in all; connection errors, timeouts, 5xx, throttling). The caller says whether a
  call may be repeated: ``CreateMultipartUpload`` is never retried blindly, since a lost reply would
  leave a second upload behind. botocore's own retries are disabled (:func:`.s3.make_client`), so
  this policy is the only one.
* **Every botocore error is translated here**, by :meth:`S3Caller.translate`: a missing object →
  :class:`ObjectNotFound`, a quota → :class:`StorageFull`, a transient failure that outlived its
  retries → :class:`StorageUnavailable`, a refusal → :class:`StorageError`; the message names the
  endpoint, bucket, key, operation and attempts. Other exceptions (a progress callback's) pass
  through untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from .base import ObjectNotFound, StorageError, StorageFull, StorageUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404"})
FULL = frozenset({"QuotaExceeded", "EntityTooLarge", "InsufficientStorage", "StorageFull", "XMinioStorageFull"})
THROTTLED = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "ConditionalRequestConflict",
})
NO_UPLOAD = frozenset({"NoSuchUpload"})
PRECONDITION = frozenset({"PreconditionFailed", "412"})


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_transient(exc: BaseException) -> bool:
    """Worth another attempt: the network, a timeout, a 5xx, throttling."""
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        code, status = error_code(exc), http_status(exc)
        if code in FULL or status in (501, 507):
            return False
        return code in THROTTLED or status == 429 or status >= 500
    return False


def or_none(codes: frozenset[str], fn: Callable[[], T]) -> Callable[[], T | None]:
    """``fn`` with the given error codes turned into ``None`` (an expected answer, not a failure)."""

    def run() -> T | None:
        try:
            return fn()
        except ClientError as exc:
            if error_code(exc) in codes:
                return None
            raise

    return run


class S3Caller:
    """Runs the calls of one S3 tier (``name``, on ``endpoint``/``bucket``) under the retry policy and
    translates their errors; the one place where either happens."""

    def __init__(self, name: str, endpoint: str, bucket: str, *, max_attempts: int, backoff_s: float,
                 max_backoff_s: float) -> None:
        self.name = name
        self.endpoint = endpoint
        self.bucket = bucket
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def call(self, op: str, key: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        """Runs one S3 call: retried on transient errors when ``retry`` (idempotent calls only),
        every botocore error translated."""
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            return fn()

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            log.warning("%s: %s %s failed (attempt %d of %d), retrying: %s",
                        self.name, op, key, state.attempt_number, self.max_attempts, exc)

        retrying = Retrying(
            stop=stop_after_attempt(self.max_attempts if retry else 1),
            wait=wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),  # "full jitter"
            retry=retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except (ClientError, BotoCoreError) as exc:
            raise self.translate(op, key, exc, attempts) from exc

    def translate(self, op: str, key: str, exc: Exception, attempts: int) -> StorageError:
        where = f"{self.endpoint} (bucket {self.bucket})"
        tries = f"after {attempts} attempt{'s' if attempts != 1 else ''}"
        if isinstance(exc, ClientError):
            code, status = error_code(exc), http_status(exc)
            msg = exc.response.get("Error", {}).get("Message", "")
            if code in NOT_FOUND:
                return ObjectNotFound(self.name, key, f"no such object ({op}: {code})")
            if code in FULL or status == 507:
                return StorageFull(self.name, key, f"{op} on {where}: storage full or quota exceeded ({code}: {msg})")
            if is_transient(exc):
                why = f"{op} on {where} failed {tries}: {code} (HTTP {status}) {msg}"
                return StorageUnavailable(self.name, key, why)
            return StorageError(self.name, key, f"{op} refused by {where}: {code} (HTTP {status}) {msg}")
        if is_transient(exc):
            return StorageUnavailable(self.name, key, f"{op}: {where} unreachable {tries}: {exc}")
        return StorageError(self.name, key, f"{op} on {where}: {exc}")


__all__ = ["FULL", "NOT_FOUND", "NO_UPLOAD", "PRECONDITION", "THROTTLED", "S3Caller", "error_code", "http_status",
           "is_transient", "or_none"]
