"""Limits on what callers may send a peer: a size cap on one request, a penalty box that
rate-limits a caller who keeps sending bad requests, and a budget of the bytes requests hold while
they arrive and are served (per caller and in all, with a deadline for a whole request to arrive).
Pure bookkeeping (no I/O), with an injectable clock, so it is tested without a network.

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


# --- bytes held by requests being read or served ----------------------------------------------------


class InFlightBudgetError(RequestTooLargeError):
    """Taking these bytes would put a caller, or all callers together, over their in-flight budget."""


class RequestDeadlineError(RequestTooLargeError):
    """A request has been arriving for longer than the peer waits for a whole request."""


class InFlightBytes:
    """Bytes held by requests a peer is reading or serving, per caller and in all, and how long each
    request has been arriving. Pure bookkeeping (no I/O), with an injectable clock.

    per_caller_bytes: what one caller's requests may hold at once.
    total_bytes: what all requests may hold at once.
    request_deadline_s: how long a request may take to arrive, from its first message to its last
        (a stream that trickles forever is cut off here, whatever each read's own timeout).
    """

    def __init__(
        self,
        *,
        per_caller_bytes: int,
        total_bytes: int,
        request_deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < per_caller_bytes <= total_bytes:
            raise ValueError(f"need 0 < per_caller_bytes <= total_bytes, got {per_caller_bytes}, {total_bytes}")
        if not (math.isfinite(request_deadline_s) and request_deadline_s > 0):
            raise ValueError(f"request_deadline_s must be a positive number, got {request_deadline_s}")
        self.per_caller_bytes, self.total_bytes = per_caller_bytes, total_bytes
        self.request_deadline_s = request_deadline_s
        self._clock = clock
        self._by_caller: dict[str, int] = {}
        self.total = 0
        self.refused = 0

    def held(self, caller: str) -> int:
        return self._by_caller.get(caller, 0)

    def open(self, caller: str) -> Hold:
        """Start accounting one request of `caller` (close the hold once it is served)."""
        return Hold(self, caller, self._clock())

    def _take(self, hold: Hold, nbytes: int) -> None:
        if self._clock() - hold.started_s > self.request_deadline_s:
            self.refused += 1
            raise RequestDeadlineError(f"the request took over {self.request_deadline_s:.0f} s to arrive")
        caller_total = self.held(hold.caller) + nbytes
        if caller_total > self.per_caller_bytes or self.total + nbytes > self.total_bytes:
            self.refused += 1
            who = "this caller's requests" if caller_total > self.per_caller_bytes else "requests in flight"
            raise InFlightBudgetError(f"{who} would hold more bytes than this peer accepts at once; try again later")
        self._by_caller[hold.caller] = caller_total
        self.total += nbytes
        hold.nbytes += nbytes

    def _release(self, hold: Hold) -> None:
        left = self.held(hold.caller) - hold.nbytes
        if left > 0:
            self._by_caller[hold.caller] = left
        else:
            self._by_caller.pop(hold.caller, None)
        self.total -= hold.nbytes
        hold.nbytes = 0


@dataclass
class Hold:
    """The bytes one request holds (see `InFlightBytes`)."""

    budget: InFlightBytes
    caller: str
    started_s: float
    nbytes: int = 0

    def take(self, nbytes: int) -> None:
        """Account `nbytes` more of this request; raises InFlightBudgetError or RequestDeadlineError."""
        self.budget._take(self, nbytes)

    def close(self) -> None:
        self.budget._release(self)
