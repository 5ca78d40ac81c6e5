"""The DHT keeps only what it can verify on swarm's keys (issue #30): signed subkeys of the signer's
own peer id, allowed signers where the run names them, bounded expiry, value size and subkeys per
key; plans and link records from the future are ignored."""

from __future__ import annotations

import functools

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import peer_subkey, plan_key, stage_key
from dht.link_records import LinkRecord, parse_link_records
from dht.plan_record import PlanRecord, current_plan
from dht.record_policy import (
    CLOCK_SKEW_S,
    MAX_PLAN_TTL_S,
    MAX_RECORD_TTL_S,
    STORE_SENDER,
    KeyRules,
    StoreBudget,
    StoreLimits,
    SwarmRecordValidator,
    _key_id,
    protected_keys,
    record_store_senders,
)
from dht.signing import SigningIdentity, peer_id_of

NOW = 1_000_000.0
STAGE_0 = _key_id(stage_key("tiny", 0))


@functools.cache
def identity(n: int) -> SigningIdentity:
    key = RSAPrivateKey()
    from cryptography.hazmat.primitives import serialization

    public = serialization.load_ssh_public_key(key.get_public_key().to_bytes())
    return SigningIdentity(private_key=key, peer_id=peer_id_of(public))


def signed_subkey(n: int, *, peer_id: str | None = None) -> bytes:
    me = identity(n)
    return peer_subkey(peer_id or me.peer_id, me.owner_marker)


def record(subkey, *, key: bytes = STAGE_0, value: bytes = b"\x80", expires: float = NOW + 10) -> DHTRecord:
    return DHTRecord(key, MSGPackSerializer.dumps(subkey), value, expires)


def validator(rules=None, **kwargs) -> SwarmRecordValidator:
    return SwarmRecordValidator(rules or protected_keys(["tiny"]), clock=lambda: NOW, **kwargs)


def test_a_signed_record_of_the_signers_own_peer_id_is_kept():
    assert validator().refusal(record(signed_subkey(0))) is None


@pytest.mark.parametrize(
    "subkey, why",
    [
        (b"12D3KooWjunk", "unsigned"),
        ("12D3KooWjunk", "unsigned"),
        (12345, "unsigned"),
        (None, "plain value"),  # would replace the dictionary of every peer under the key
    ],
)
def test_junk_subkeys_and_plain_values_are_refused(subkey, why):
    assert validator().refusal(record(subkey)) == why


def test_one_signer_cannot_write_under_made_up_peer_ids():
    forged = signed_subkey(0, peer_id=identity(1).peer_id)
    assert validator().refusal(record(forged)) == "not the signer's own peer id"


def test_expiry_and_value_size_are_bounded():
    guard = validator()
    assert guard.refusal(record(signed_subkey(0), expires=NOW + MAX_RECORD_TTL_S + CLOCK_SKEW_S)) is None
    assert guard.refusal(record(signed_subkey(0), expires=NOW + MAX_RECORD_TTL_S + CLOCK_SKEW_S + 1)) == (
        "expires too late"
    )
    assert guard.refusal(record(signed_subkey(0), value=b"x" * (16 << 10))) is None
    assert guard.refusal(record(signed_subkey(0), value=b"x" * ((16 << 10) + 1))) == "value too large"


def test_other_keys_are_not_guarded():
    assert validator().refusal(record(b"anything", key=_key_id("hivemind.averager.key"))) is None
    assert validator().refusal(record(b"anything", key=_key_id(stage_key("other-model", 0)))) is None


def test_a_private_swarm_keeps_only_its_peers_records_and_plans_only_from_plan_signers():
    rules = protected_keys(
        ["tiny"], allowed_peers=[identity(0).peer_id, identity(1).peer_id], plan_signers=[identity(1).peer_id]
    )
    guard = validator(rules)
    assert guard.refusal(record(signed_subkey(0))) is None
    assert guard.refusal(record(signed_subkey(2))) == "signer not allowed"
    plans = _key_id(plan_key("tiny"))
    assert guard.refusal(record(signed_subkey(1), key=plans)) is None
    assert guard.refusal(record(signed_subkey(0), key=plans)) == "signer not allowed"
    # An open swarm with named plan signers: anyone announces, only they plan.
    open_rules = protected_keys(["tiny"], plan_signers=[identity(1).peer_id])
    assert validator(open_rules).refusal(record(signed_subkey(2))) is None
    assert validator(open_rules).refusal(record(signed_subkey(2), key=plans)) == "signer not allowed"


def test_a_full_key_refuses_new_subkeys_until_one_expires_but_renews_old_ones():
    now = [NOW]
    rules = {STAGE_0: KeyRules("stage", max_subkeys=2, max_value_bytes=1024, max_ttl_s=100.0)}
    guard = SwarmRecordValidator(rules, clock=lambda: now[0])
    assert guard.validate(record(signed_subkey(0), expires=NOW + 5))
    assert guard.validate(record(signed_subkey(1), expires=NOW + 50))
    assert not guard.validate(record(signed_subkey(2)))
    assert guard.validate(record(signed_subkey(0), expires=NOW + 60))  # a renewal takes no new place
    now[0] = NOW + 55  # subkey 1 expired; subkey 0 was renewed
    assert guard.validate(record(signed_subkey(2), expires=NOW + 90))
    assert guard.refused == {"key full": 1}
    # A client only reads: it counts nothing (the union of several nodes' answers is no storage).
    reader = SwarmRecordValidator(rules, cap_subkeys=False, clock=lambda: NOW)
    assert all(reader.validate(record(signed_subkey(n))) for n in range(3))


def plan(planner: str, *, created_at: float, expires_at: float) -> dict:
    return PlanRecord(
        model="tiny",
        num_stages=1,
        stages=(("peerA",),),
        total_s=1.0,
        data_parallel_s=0.5,
        pipeline_s=0.5,
        planner_id=planner,
        created_at=created_at,
        expires_at=expires_at,
    ).to_wire()


def test_a_plan_from_the_future_or_that_never_expires_does_not_win():
    entries = {
        "honest": plan("honest", created_at=NOW - 10, expires_at=NOW + 3600),
        "future": plan("future", created_at=NOW + 10 * CLOCK_SKEW_S, expires_at=NOW + 3600),
        "forever": plan("forever", created_at=NOW, expires_at=NOW + MAX_PLAN_TTL_S + 10 * CLOCK_SKEW_S),
    }
    assert current_plan(entries, model="tiny", now=NOW).planner_id == "honest"


def test_link_records_measured_in_the_future_are_skipped():
    def link_record(peer: str, measured_at: float) -> dict:
        return LinkRecord(
            peer_id=peer, model="tiny", num_stages=2, throughput=1.0, measured_at=measured_at, expires_at=NOW + 60
        ).to_wire()

    entries = {"a": link_record("a", NOW - 1), "b": link_record("b", NOW + 10 * CLOCK_SKEW_S)}
    assert [r.peer_id for r in parse_link_records(entries, model="tiny", now=NOW)] == ["a"]
    assert len(parse_link_records(entries, model="tiny")) == 2  # without a clock, as before


def test_what_a_node_stores_for_others_is_bounded_per_sender_per_key_and_in_all():
    """Issue #60: junk under random keys took 191 MiB of a node in 14 s (the bootstrap's memory grew
    226 MiB). Sizes here are small limits, the shape the defaults' (StoreLimits) have."""
    limits = StoreLimits(per_sender_bytes=10_000, per_other_key_bytes=3_000, other_keys_bytes=6_000, total_bytes=15_000)
    budget = StoreBudget(limits)
    other = [_key_id(f"junk{n}") for n in range(4)]

    def store(sender, key, subkey, nbytes, expires=NOW + 10, protected=False, now=NOW):
        return budget.refusal(sender, key, subkey, nbytes, expires, now, protected=protected)

    assert store("a", other[0], b"s1", 2_000) is None
    assert store("a", other[0], b"s2", 2_000) == "key over its budget"  # one key that is none of swarm's
    assert store("a", other[0], b"s1", 2_500) is None  # renewed (the same subkey): counted once
    assert store("b", other[1], b"s", 2_900) is None
    assert store("c", other[2], b"s", 2_000) == "other keys full"
    assert store("a", STAGE_0, b"s", 4_000, protected=True) is None  # a's own record: swarm's key
    assert store("a", _key_id(stage_key("tiny", 1)), b"s", 4_000, protected=True) == "sender over its budget"
    assert store("d", _key_id(stage_key("tiny", 1)), b"s", 5_000, protected=True) is None
    assert store("e", _key_id(stage_key("tiny", 2)), b"s", 2_000, protected=True) == "node full"
    assert store("e", _key_id(stage_key("tiny", 2)), b"s", 2_000, protected=True, now=NOW + 11) is None  # expired
    assert budget.held_by("a") == 0 and budget.total == 2_000 + len(b"s")


def test_the_validator_charges_stores_to_the_peer_that_asked():
    guard = validator(budget=StoreBudget(StoreLimits(per_sender_bytes=3_000)))
    junk = _key_id("random-key")
    assert guard.refusal(record(b"x", key=junk, value=b"v" * 2_000)) is None  # no sender: read, or our own
    token = STORE_SENDER.set("stranger")
    try:
        assert guard.refusal(record(b"x", key=junk, value=b"v" * 2_000)) is None
        assert guard.refusal(record(b"y", key=junk, value=b"v" * 2_000)) == "sender over its budget"
        assert guard.validate(record(b"z", key=junk, value=b"v" * 2_000)) is False
        assert guard.refused["sender over its budget"] == 1
    finally:
        STORE_SENDER.reset(token)
    assert SwarmRecordValidator(protected_keys(["tiny"]), cap_subkeys=False).budget is None  # a client stores nothing


def test_hiveminds_store_handler_says_who_asked():
    from typing import get_type_hints

    from hivemind.dht.protocol import DHTProtocol

    record_store_senders()
    record_store_senders()  # once only
    assert DHTProtocol.rpc_store._says_sender
    assert "request" in get_type_hints(DHTProtocol.rpc_store)  # hivemind registers it by its annotations
