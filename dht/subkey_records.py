"""Records kept one per peer under a shared DHT key (the subkey names the peer).

Stage records, split records, link records, move claims, trainers' progress and plans all live
this way. What they share is here: storing (each attempt stamped afresh) and looking up with a
timeout (a DHT that does not answer costs a warning and a default, never a hung process), keeping
the unexpired entries of a lookup, and parsing each entry into its typed record, skipping (with
one warning each) what is malformed or names another peer, model or stage than where it is
stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # parsing must not import hivemind (and torch): `peers.health` parses records every 30 s
    import hivemind

logger = logging.getLogger(__name__)

Record = TypeVar("Record")


def unexpired_entries(result) -> dict[Any, Any]:
    """{subkey: value} of a `dht.get(..., latest=True)` result, expired entries dropped."""
    from hivemind.utils import get_dht_time

    if result is None or not isinstance(result.value, dict):
        return {}
    now = get_dht_time()
    return {subkey: item.value for subkey, item in result.value.items() if item.expiration_time > now}


def parse_entries(
    entries: dict[Any, Any],
    parse: Callable[[Any], Record],
    misplaced: Callable[[Any, Record], str | None],
    *,
    kind: str,
    where: str,
) -> list[Record]:
    """Parse every entry (sorted by subkey) with `parse`, which raises ValueError for anything
    malformed. `misplaced(subkey, record)` says why a well-formed record does not belong under this
    subkey and key (None when it does). Skipped entries are logged, one warning each."""
    records = []
    for subkey, value in sorted(entries.items(), key=lambda kv: str(kv[0])):
        try:
            record = parse(value)
        except ValueError as e:
            logger.warning(f"Skipping {kind} {subkey!r} for {where}: {e}")
            continue
        reason = misplaced(subkey, record)
        if reason is not None:
            logger.warning(f"Skipping {kind} {subkey!r}: {reason}")
            continue
        records.append(record)
    return records


def misfiled_under(model: str) -> Callable[[Any, Any], str | None]:
    """The `misplaced` check of records with `peer_id` and `model` fields: a record belongs under
    the subkey of the peer it names, in the key of the model it names."""

    def misfiled(subkey, record) -> str | None:
        if record.peer_id != subkey or record.model != model:
            return f"it names peer {record.peer_id}, model {record.model}"
        return None

    return misfiled


RETRY_FIRST_S = 0.2  # the first pause after a store that no node accepted; doubled each time...
RETRY_MAX_S = 2.0  # ...up to this


def retry_delays(first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S) -> Iterator[float]:
    """The pauses between attempts of a DHT write: exponential backoff, capped."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)


async def await_store(store: Callable[[], Any], *, timeout_s: float, what: str) -> bool:
    """Whether `store()` (a `dht.store(..., return_future=True)`) succeeded within timeout_s. A write
    that no node accepted (a transient refusal on a quiet swarm) is tried again after a backoff
    pause, as long as the deadline allows; a write that gets no answer by the deadline costs a
    warning."""
    deadline = time.monotonic() + timeout_s
    delays = retry_delays()
    while True:
        future = store()
        try:
            if await asyncio.wait_for(future, timeout=max(deadline - time.monotonic(), 0.01)):
                return True
        except TimeoutError:
            future.cancel()
            logger.warning(f"{what} timed out after {timeout_s} s")
            return False
        pause = next(delays)
        if time.monotonic() + pause >= deadline:
            return False
        await asyncio.sleep(pause)


def wait_store(store: Callable[[], Any], *, timeout_s: float, what: str) -> bool:
    """`await_store` for callers outside the event loop (blocking)."""
    deadline = time.monotonic() + timeout_s
    delays = retry_delays()
    while True:
        future = store()
        try:
            if future.result(timeout=max(deadline - time.monotonic(), 0.01)):
                return True
        except TimeoutError:
            future.cancel()
            logger.warning(f"{what} timed out after {timeout_s} s")
            return False
        pause = next(delays)
        if time.monotonic() + pause >= deadline:
            return False
        time.sleep(pause)


def restamping_store(dht: hivemind.DHT, key: str, subkey: Any, record: Any) -> Callable[[], Any]:
    """The `store` of await_store/wait_store that writes `record` (a record with `expires_at` and
    `to_wire()`) under key/subkey, its expiry stamped afresh on each attempt with the lifetime it
    has now. DHT nodes refuse a record that has expired by the time it reaches them, and on a loaded
    machine a write can take seconds (1-2.3 s measured with 3 s records), so a retry of the first
    stamp would only be refused again."""
    from hivemind.utils import get_dht_time

    lifetime_s = record.expires_at - get_dht_time()

    def store():
        stamped = record.model_copy(update={"expires_at": get_dht_time() + lifetime_s})
        return dht.store(
            key, subkey=subkey, value=stamped.to_wire(), expiration_time=stamped.expires_at, return_future=True
        )

    return store


def lookup(dht: hivemind.DHT, key: str, *, timeout_s: float) -> dict[Any, Any]:
    """Unexpired entries under `key` (blocking; raises TimeoutError if the DHT does not answer)."""
    return unexpired_entries(dht.get(key, latest=True, return_future=True).result(timeout=timeout_s))


async def lookup_async(dht: hivemind.DHT, key: str, *, timeout_s: float, what: str) -> dict[Any, Any] | None:
    """Unexpired entries under `key`, or None (with a warning) when the lookup times out."""
    future = dht.get(key, latest=True, return_future=True)
    try:
        result = await asyncio.wait_for(future, timeout=timeout_s)
    except TimeoutError:
        future.cancel()
        logger.warning(f"DHT lookup of {what} timed out after {timeout_s} s")
        return None
    return unexpired_entries(result)
