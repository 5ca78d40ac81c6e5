"""Limits on what callers may send a peer: a size cap on one request, and a penalty box that
rate-limits a caller who keeps sending bad requests. Pure bookkeeping (no I/O), with an injectable
clock, so it is tested without a network.

Each caller has a token bucket of `burst` tokens that refills at `refill_per_s` tokens per second.
A bad request costs one token; a caller whose bucket is below one token is refused at once, before
its request is decoded, until the bucket has refilled. Good requests cost nothing, so an honest
trainer that makes an occasional mistake is never limited.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class RequestTooLargeError(ValueError):
    """A request carries more bytes than this peer accepts."""


def check_request_bytes(received: int, limit: int) -> None:
    """Raise `RequestTooLargeError` once a request's payload passes `limit` bytes."""
    if received > limit:
        raise RequestTooLargeError(f"the request carries more than {limit} bytes (--max-request-mb)")


@dataclass
class _Bucket:
    tokens: float
    updated_s: float


class PenaltyBox:
    """Per-caller token bucket of bad requests.

    burst: bad requests a caller may send in a row before it is limited.
    refill_per_s: bad requests per second a caller may keep sending indefinitely.
    max_callers: callers remembered; the longest-idle one is forgotten first (memory stays bounded
    however many peer ids an attacker makes up; a forgotten caller starts with a full bucket).
    clock: seconds, monotonic.
    """

    def __init__(
        self,
        *,
        burst: int = 10,
        refill_per_s: float = 0.2,
        max_callers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1:
            raise ValueError(f"burst must be at least 1, got {burst}")
        if not (math.isfinite(refill_per_s) and refill_per_s > 0.0):
            raise ValueError(f"refill_per_s must be a positive number, got {refill_per_s}")
        if max_callers < 1:
            raise ValueError(f"max_callers must be at least 1, got {max_callers}")
        self.burst, self.refill_per_s, self.max_callers = burst, refill_per_s, max_callers
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.refused = 0  # requests refused because their caller was limited

    def _bucket(self, caller: str) -> _Bucket:
        now_s = self._clock()
        bucket = self._buckets.get(caller)
        if bucket is None:
            bucket = self._buckets[caller] = _Bucket(float(self.burst), now_s)
            while len(self._buckets) > self.max_callers:
                self._buckets.popitem(last=False)
        else:
            elapsed_s = max(now_s - bucket.updated_s, 0.0)
            bucket.tokens = min(self.burst, bucket.tokens + elapsed_s * self.refill_per_s)
            bucket.updated_s = now_s
            self._buckets.move_to_end(caller)
        return bucket

    def allows(self, caller: str) -> bool:
        """Whether a request from `caller` may be served; counts the refusal if not."""
        if self._bucket(caller).tokens >= 1.0:
            return True
        self.refused += 1
        return False

    def penalize(self, caller: str) -> None:
        """`caller` sent a bad request."""
        bucket = self._bucket(caller)
        bucket.tokens = max(bucket.tokens - 1.0, 0.0)

    def seconds_until_allowed(self, caller: str) -> float:
        bucket = self._bucket(caller)
        return max(1.0 - bucket.tokens, 0.0) / self.refill_per_s

    def limited(self) -> list[str]:
        """Callers refused right now (sorted)."""
        return sorted(c for c in list(self._buckets) if self._bucket(c).tokens < 1.0)
