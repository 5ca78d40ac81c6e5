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
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Collection

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
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
    ):
        self.rules, self.cap_subkeys, self.clock_skew_s = rules, cap_subkeys, clock_skew_s
        self._clock = clock
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
            return None
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
