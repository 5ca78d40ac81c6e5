"""Why a call between a trainer and a peer failed: one vocabulary for both ends.

Every value is a string that metrics labels (`kind="..."`), logs and run reports show, so values
never change. Three groups:

- What a peer answers when it refuses or fails a request, in `ResponseHeader.error_kind`
  (`ANSWERS`): bad_request, wrong_stage, internal, cache_miss. A peer counts each refusal in its
  metrics under that kind...
- ...or, for a bad request it refused on sight, under a finer reason: too_large, rate_limited,
  not_allowed (the caller still reads bad_request).
- What a trainer records for a failed call: timeout, transport and garbage, where no usable answer
  came, or the peer's answer as `caller_failure` classifies it: a peer's bad_request is recorded as
  refused (the trainer's own request was at fault: a bug on its side, not the peer's).
"""

from __future__ import annotations

from enum import Enum


class Failure(str, Enum):
    # --- answered by a peer (ResponseHeader.error_kind) ---
    BAD_REQUEST = "bad_request"  # the caller's fault: wrong shape/dtype/stage/codec; do not retry as is
    WRONG_STAGE = "wrong_stage"  # the peer serves another stage now (it moved); refresh the route
    INTERNAL = "internal"  # the peer failed; retry elsewhere
    CACHE_MISS = "cache_miss"  # inputs_cached was set but this peer holds no current forward: resend with inputs
    # --- why a peer refused a bad request on sight (its metrics only; the caller reads bad_request) ---
    TOO_LARGE = "too_large"  # the request carried more bytes than --max-request-mb
    RATE_LIMITED = "rate_limited"  # the caller sent too many bad requests lately
    NOT_ALLOWED = "not_allowed"  # a private swarm's peer was called by a peer id not on its allowlist
    # --- what a trainer records ---
    TIMEOUT = "timeout"  # no answer within the call's time limit
    TRANSPORT = "transport"  # could not connect, stream broken, peer gone
    GARBAGE = "garbage"  # the answer does not follow the contract or holds NaN/inf
    REFUSED = "refused"  # the peer answered bad_request: a bug on our side, do not ban


ANSWERS = frozenset(
    {Failure.BAD_REQUEST, Failure.WRONG_STAGE, Failure.INTERNAL, Failure.CACHE_MISS}
)  # what a peer may answer


def caller_failure(error_kind: Failure | None) -> Failure:
    """How a caller records a peer's refusal: bad_request becomes refused; wrong_stage and cache_miss
    stay as they are; anything else (internal, or no kind given) is internal."""
    if error_kind == Failure.BAD_REQUEST:
        return Failure.REFUSED
    if error_kind in (Failure.WRONG_STAGE, Failure.CACHE_MISS):
        return error_kind
    return Failure.INTERNAL
