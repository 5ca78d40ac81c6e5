"""What the DHT keeps under swarm's own keys: only what it can verify, within caps.

hivemind calls a node's record validators when another node asks it to store a record and when a
node it asked returns one (a dictionary that holds one refused entry is dropped whole). On the keys
of the models a node knows (`protected_keys`: every stage key, the split, links, move-claim, plan and progress keys)
and on the runs key (the runs' specs, dht/run_specs.py),
`SwarmRecordValidator` refuses
- a plain value (it would replace the whole dictionary of subkeys, hiding every peer under it);
- a subkey that is not `<peer id>[owner:<RSA key>]` with the key hashing to that peer id (unsigned
  junk, or one signer writing under many made-up peer ids: one subkey per signer and key);
- a signer outside the key's allowed signers, where the run names them (a private swarm's
  `--allowed-peers`; for plans, `--plan-signers`);
- an expiry beyond now + the key's maximum lifetime + the clock skew;
- a value larger than the key's cap;
- on a node that stores for others, a new subkey once the key holds its cap of live subkeys.
hivemind's `RSASignatureValidator` (higher priority, so it runs first) has checked the signature.
The caps bound what one key can hold, so a flood cannot make a stage's record too big to return;
a flood of valid identities can still take a key's free places until its records expire.

On every key, what a node stores for others is bounded too (`StoreBudget`, `StoreLimits`): the
live bytes each sender stores with it (4 MiB), those under one key that is none of swarm's (256
KiB), and those under keys that are none of swarm's in all (32 MiB) or under any key (128 MiB); a
store past a bound is refused until earlier entries expire. The sender is the peer id of the store
request's connection (`record_store_senders` has hivemind's `rpc_store` say it). Before: junk under
random keys took 191 MiB of a node in 14 s, and the bootstrap's memory grew 226 MiB (issue #60).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from dht.keys import links_key, moves_key, parse_peer_subkey, plan_key, progress_key, runs_key, split_key, stage_key
from dht.signing import peer_id_of

MAX_PROTECTED_STAGES = 1024  # stage keys guarded per model (a PlanRecord allows as many stages)
CLOCK_SKEW_S = 60.0  # how far ahead of ours another node's clock may run
MAX_RECORD_TTL_S = 3600.0  # stage, split and link records are renewed every few seconds to minutes
MAX_PLAN_TTL_S = 7 * 86400.0  # `swarm plan --plan-ttl-s` (default an hour)
MAX_PROGRESS_TTL_S = 600.0  # a trainer renews its progress record every step
MAX_SPEC_TTL_S = 7 * 86400.0  # a run's owner publishes its spec for days (`swarm run create --initial-peers`)
MAX_MOVE_CLAIM_TTL_S = 3600.0  # a move claim lives a few rebalancing periods (peers/placement/rebalance.py)
_REGULAR_VALUE = MSGPackSerializer.dumps(None)  # hivemind's subkey tag of a value without subkeys


@dataclasses.dataclass(frozen=True)
class KeyRules:
    """What one protected key accepts."""

    kind: str  # "stage", "split", "links", "moves", "plan", "progress" or "runs"
    max_subkeys: int
    max_value_bytes: int
    max_ttl_s: float
    allowed_signers: frozenset[str] | None = None  # None: any peer that signs its own subkey


def protected_keys(
    models: Collection[str],
    *,
    allowed_peers: Collection[str] = (),
    plan_signers: Collection[str] = (),
    max_stages: int = MAX_PROTECTED_STAGES,
    runs: bool = True,
) -> dict[bytes, KeyRules]:
    """The DHT ids (as hivemind hands them to validators) of every key of `models` (and the runs key,
    with `runs`), with their rules. A private swarm's `allowed_peers` sign every record;
    `plan_signers` (else the allowed peers) sign plans."""
    peers = frozenset(allowed_peers) or None
    planners = frozenset(plan_signers) or peers
    stage = KeyRules(
        "stage", max_subkeys=256, max_value_bytes=16 << 10, max_ttl_s=MAX_RECORD_TTL_S, allowed_signers=peers
    )
    split = KeyRules(
        "split", max_subkeys=1024, max_value_bytes=16 << 10, max_ttl_s=MAX_RECORD_TTL_S, allowed_signers=peers
    )
    links = KeyRules(
        "links", max_subkeys=512, max_value_bytes=64 << 10, max_ttl_s=MAX_RECORD_TTL_S, allowed_signers=peers
    )
    moves = KeyRules(
        "moves", max_subkeys=256, max_value_bytes=4 << 10, max_ttl_s=MAX_MOVE_CLAIM_TTL_S, allowed_signers=peers
    )
    plan = KeyRules(
        "plan", max_subkeys=64, max_value_bytes=128 << 10, max_ttl_s=MAX_PLAN_TTL_S, allowed_signers=planners
    )
    # trainers are not among a private swarm's peers: any trainer signs its own progress subkey
    progress = KeyRules("progress", max_subkeys=256, max_value_bytes=64 << 10, max_ttl_s=MAX_PROGRESS_TTL_S)
    # the runs' specs: any announcer of a run (a peer, its owner) signs its own subkey
    specs = KeyRules(
        "runs", max_subkeys=1024, max_value_bytes=32 << 10, max_ttl_s=MAX_SPEC_TTL_S, allowed_signers=peers
    )
    rules = {_key_id(runs_key()): specs} if runs else {}
    for model in models:
        for s in range(max_stages):
            rules[_key_id(stage_key(model, s))] = stage
        rules[_key_id(split_key(model))] = split
        rules[_key_id(links_key(model))] = links
        rules[_key_id(moves_key(model))] = moves
        rules[_key_id(plan_key(model))] = plan
        rules[_key_id(progress_key(model))] = progress
    return rules


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


# --- what a node stores for others, by sender ------------------------------------------------------

STORE_SENDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("swarm_store_sender", default=None)


def record_store_senders() -> None:
    """Make hivemind's `DHTProtocol.rpc_store` run with the caller's peer id in `STORE_SENDER`, so
    that the validators it calls know who asked (hivemind does not pass it). Patched on the class, in
    this process, before a DHT node starts (hivemind.DHT forks: its node's process inherits it);
    idempotent."""
    original = DHTProtocol.rpc_store
    if getattr(original, "_says_sender", False):
        return

    @functools.wraps(original)
    async def rpc_store(self, request, context):
        token = STORE_SENDER.set(context.remote_id.to_base58())
        try:
            return await original(self, request, context)
        finally:
            STORE_SENDER.reset(token)

    rpc_store._says_sender = True
    DHTProtocol.rpc_store = rpc_store


@dataclasses.dataclass(frozen=True)
class StoreLimits:
    """Live bytes a node stores for others (values, each counted as at least `min_entry_bytes`)."""

    per_sender_bytes: int = 4 << 20
    per_other_key_bytes: int = 256 << 10  # under one key that is none of swarm's
    other_keys_bytes: int = 32 << 20  # under keys that are none of swarm's, in all
    total_bytes: int = 128 << 20
    min_entry_bytes: int = 256  # what an entry costs at least: its key, subkey and bookkeeping


@dataclasses.dataclass
class _Stored:
    sender: str
    cost: int
    expiration: float
    protected: bool


class StoreBudget:
    """The entries a node holds for others, by (key, subkey): their sender, cost and expiry, and the
    sums per sender, per key and in all (pure; time passed in). An entry stored again (renewed) is
    counted once, to its latest sender."""

    def __init__(self, limits: StoreLimits | None = None):
        self.limits = limits or StoreLimits()
        self._entries: dict[tuple[bytes, bytes], _Stored] = {}
        self._expiring: list[tuple[float, bytes, bytes]] = []  # a heap; stale items skipped
        self._by_sender: dict[str, int] = {}
        self._by_key: dict[bytes, int] = {}
        self.other_keys = self.total = 0

    def refusal(
        self, sender: str, key: bytes, subkey: bytes, nbytes: int, expiration: float, now: float, *, protected: bool
    ) -> str | None:
        """Admit the entry (None) or say which bound it would break."""
        self._expire(now)
        cost = max(nbytes + len(subkey), self.limits.min_entry_bytes)
        old = self._entries.get((key, subkey))
        freed_sender = old.cost if old is not None and old.sender == sender else 0
        freed = old.cost if old is not None else 0
        limits = self.limits
        if self._by_sender.get(sender, 0) - freed_sender + cost > limits.per_sender_bytes:
            return "sender over its budget"
        if self.total - freed + cost > limits.total_bytes:
            return "node full"
        if not protected:
            if self._by_key.get(key, 0) - freed + cost > limits.per_other_key_bytes:
                return "key over its budget"
            if self.other_keys - freed + cost > limits.other_keys_bytes:
                return "other keys full"
        if old is not None:
            self._remove(key, subkey)
            expiration = max(expiration, old.expiration)
        entry = _Stored(sender, cost, expiration, protected)
        self._entries[(key, subkey)] = entry
        heapq.heappush(self._expiring, (expiration, key, subkey))
        self._add(key, entry, +1)
        return None

    def held_by(self, sender: str) -> int:
        return self._by_sender.get(sender, 0)

    def _add(self, key: bytes, entry: _Stored, sign: int) -> None:
        self._by_sender[entry.sender] = self._by_sender.get(entry.sender, 0) + sign * entry.cost
        self._by_key[key] = self._by_key.get(key, 0) + sign * entry.cost
        self.total += sign * entry.cost
        if not entry.protected:
            self.other_keys += sign * entry.cost
        for table, name in ((self._by_sender, entry.sender), (self._by_key, key)):
            if table[name] <= 0:
                del table[name]

    def _remove(self, key: bytes, subkey: bytes) -> None:
        entry = self._entries.pop((key, subkey))
        self._add(key, entry, -1)

    def _expire(self, now: float) -> None:
        while self._expiring and self._expiring[0][0] <= now:
            expiration, key, subkey = heapq.heappop(self._expiring)
            entry = self._entries.get((key, subkey))
            if entry is not None and entry.expiration <= now:
                self._remove(key, subkey)
        if len(self._expiring) > 4 * len(self._entries) + 1024:  # renewed entries left stale items behind
            self._expiring = [(e.expiration, k, sk) for (k, sk), e in self._entries.items()]
            heapq.heapify(self._expiring)


class SwarmRecordValidator(RecordValidatorBase):
    """Guards the keys of `rules` (see the module's docstring); every other key passes untouched.

    cap_subkeys: count live subkeys per key and refuse new ones past a key's cap (a node that
        stores for others; a client only reads, and a reader counting the union of several nodes'
        answers could refuse honest ones).
    clock: DHT time, seconds (injectable for tests).
    """

    def __init__(
        self,
        rules: dict[bytes, KeyRules],
        *,
        cap_subkeys: bool = True,
        clock_skew_s: float = CLOCK_SKEW_S,
        clock: Callable[[], float] | None = None,
        budget: StoreBudget | None = None,
    ):
        self.rules, self.cap_subkeys, self.clock_skew_s = rules, cap_subkeys, clock_skew_s
        self._clock = clock
        # what this node stores for others, bounded (a node that stores for others: `cap_subkeys`)
        self.budget = budget if budget is not None else (StoreBudget() if cap_subkeys else None)
        self._live: dict[bytes, dict[bytes, float]] = {}  # key id -> {subkey: expiration}
        self._signers: OrderedDict[bytes, str | None] = OrderedDict()  # public key -> its peer id (a cache)
        self.refused: dict[str, int] = {}  # reason -> count, for logs and tests

    def _now(self) -> float:
        return self._clock() if self._clock is not None else get_dht_time()

    def validate(self, record: DHTRecord) -> bool:
        reason = self.refusal(record)
        if reason is not None:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            return False
        return True

    def refusal(self, record: DHTRecord) -> str | None:
        """Why `record` may not be kept (a short reason), or None."""
        rules = self.rules.get(record.key)
        if rules is None:
            return self._over_budget(record, protected=False)
        reason = self._protected_refusal(record, rules)
        return reason if reason is not None else self._over_budget(record, protected=True)

    def _over_budget(self, record: DHTRecord, *, protected: bool) -> str | None:
        """Why storing `record` for the peer that asked would break a `StoreBudget` bound, or None
        (also when no peer asked: a record this node found, or its own)."""
        sender = STORE_SENDER.get()
        if self.budget is None or sender is None:
            return None
        return self.budget.refusal(
            sender,
            record.key,
            record.subkey,
            len(record.value),
            record.expiration_time,
            self._now(),
            protected=protected,
        )

    def _protected_refusal(self, record: DHTRecord, rules: KeyRules) -> str | None:
        if record.subkey == _REGULAR_VALUE:
            return "plain value"
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises assorted errors on garbage
            return "unsigned"
        parsed = parse_peer_subkey(subkey)
        if parsed is None:
            return "unsigned"
        peer_id, public_key = parsed
        if self._signer(public_key) != peer_id:
            return "not the signer's own peer id"
        if rules.allowed_signers is not None and peer_id not in rules.allowed_signers:
            return "signer not allowed"
        now = self._now()
        if record.expiration_time > now + rules.max_ttl_s + self.clock_skew_s:
            return "expires too late"
        if len(record.value) > rules.max_value_bytes:
            return "value too large"
        if self.cap_subkeys and not self._take_place(record.key, subkey, record.expiration_time, rules, now):
            return "key full"
        return None

    def _signer(self, public_key: bytes) -> str | None:
        if public_key in self._signers:
            self._signers.move_to_end(public_key)
            return self._signers[public_key]
        try:
            loaded = serialization.load_ssh_public_key(public_key)
            peer_id = peer_id_of(loaded) if isinstance(loaded, rsa.RSAPublicKey) else None
        except Exception:  # cryptography raises assorted errors for malformed keys
            peer_id = None
        self._signers[public_key] = peer_id
        while len(self._signers) > 4096:
            self._signers.popitem(last=False)
        return peer_id

    def _take_place(self, key: bytes, subkey: bytes, expiration: float, rules: KeyRules, now: float) -> bool:
        live = self._live.setdefault(key, {})
        if subkey not in live and len(live) >= rules.max_subkeys:
            for stale in [s for s, expires in live.items() if expires <= now]:
                del live[stale]
            if len(live) >= rules.max_subkeys:
                return False
        live[subkey] = max(expiration, live.get(subkey, expiration))
        return True
