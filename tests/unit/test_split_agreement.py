"""The rules by which peers and trainers agree on one stage split, without a network."""

from __future__ import annotations

import pytest
import torch

from dht.records import SplitRecord, parse_split_records
from dht.split_agreement import SplitConflictError, choose_split, earlier_conflicting_claim, split_in_force
from models.stages import StageSplitError
from peers.config import PeerConfig
from peers.placement.split_claim import split_tag
from peers.settle import settle
from process.config import ConfigError


def claim(peer: str, boundaries, since: float = 0.0, active: bool = True, model: str = "tiny") -> SplitRecord:
    return SplitRecord(
        peer_id=peer,
        model=model,
        num_stages=len(boundaries) - 1,
        boundaries=tuple(boundaries),
        since=since,
        active=active,
        expires_at=100.0,
    )


def test_a_record_must_describe_its_stages():
    with pytest.raises(ValueError, match="do not describe 3"):
        SplitRecord(peer_id="p", model="m", num_stages=3, boundaries=(0, 1, 3), since=0.0, expires_at=1.0)
    with pytest.raises(ValueError):
        SplitRecord(peer_id="p", model="m", num_stages=2, boundaries=(0, 2, 2), since=0.0, expires_at=1.0)


def test_parsing_skips_malformed_and_misfiled_records():
    good = claim("a", (0, 1, 3)).to_wire()
    good["boundaries"] = list(good["boundaries"])  # as msgpack returns it
    entries = {
        "a": good,
        "b": {**claim("b", (0, 2, 3)).to_wire(), "num_stages": "two"},  # wrong type
        "c": claim("someone-else", (0, 2, 3)).to_wire(),  # subkey does not match
        "d": "not a mapping",
        "e": {**claim("e", (0, 2, 3), model="other").to_wire()},  # another model
        "f": {**claim("f", (0, 2, 3)).to_wire(), "future_field": 1},  # newer peers may add fields
    }
    parsed = parse_split_records(entries, model="tiny")
    assert [r.peer_id for r in parsed] == ["a", "f"]
    assert parsed[0].boundaries == (0, 1, 3)


def test_the_earliest_active_claim_is_in_force():
    assert split_in_force([]) is None
    records = [claim("b", (0, 1, 3), since=2.0), claim("a", (0, 1, 3), since=1.0), claim("c", (0, 2, 3), active=False)]
    assert split_in_force(records).peer_id == "a"
    assert split_in_force([claim("c", (0, 2, 3), active=False)]) is None  # a peer that left binds nobody


def test_disagreeing_active_claims_are_a_conflict():
    with pytest.raises(SplitConflictError, match="disagree on the split"):
        split_in_force([claim("a", (0, 1, 3), since=1.0), claim("b", (0, 2, 3), since=2.0)])
    # A peer's own earlier claim (same id, restarted) does not count against it.
    assert split_in_force([claim("a", (0, 1, 3))], excluding="a") is None


def test_a_starting_peer_adopts_or_matches_the_split_in_force():
    equal = (0, 2, 3)
    assert choose_split(None, 2, equal, None, "tiny") == equal
    assert choose_split((0, 1, 3), 2, equal, None, "tiny") == (0, 1, 3)
    in_force = claim("a", (0, 1, 3))
    assert choose_split(None, 2, equal, in_force, "tiny") == (0, 1, 3)  # adopts
    assert choose_split((0, 1, 3), 2, equal, in_force, "tiny") == (0, 1, 3)
    with pytest.raises(SplitConflictError, match="--split-boundaries 0,1,3"):
        choose_split((0, 2, 3), 2, equal, in_force, "tiny")
    with pytest.raises(SplitConflictError, match="--num-stages 2"):
        choose_split(None, 3, (0, 1, 2, 3), in_force, "tiny")


def test_of_two_racing_claims_the_later_withdraws():
    first, second = claim("a", (0, 1, 3), since=1.0), claim("b", (0, 2, 3), since=2.0)
    assert earlier_conflicting_claim(second, [first, second]) == first
    assert earlier_conflicting_claim(first, [first, second]) is None
    # Same instant: the peer id decides, the same way for both.
    tie_a, tie_b = claim("a", (0, 1, 3), since=1.0), claim("b", (0, 2, 3), since=1.0)
    assert earlier_conflicting_claim(tie_b, [tie_a, tie_b]) == tie_a
    assert earlier_conflicting_claim(tie_a, [tie_a, tie_b]) is None
    # Agreeing claims never conflict, nor do claims of peers that left.
    assert earlier_conflicting_claim(claim("b", (0, 1, 3), since=2.0), [first]) is None
    assert earlier_conflicting_claim(second, [claim("a", (0, 1, 3), since=1.0, active=False)]) is None


def _split(**options) -> tuple[int, ...]:
    """The split a peer with these options serves when it starts a swarm (peers/settle.py)."""
    config = PeerConfig(**options)
    return settle(
        config, {"model"}, None, device=torch.device("cpu"), available_bytes=1 << 40, created_at=0.0
    ).boundaries


def test_peer_config_reads_split_boundaries():
    config = PeerConfig(model="tiny", stage=1, num_stages=2, split_boundaries="0,1,3")
    assert config.requested_boundaries == (0, 1, 3) and _split(model="tiny", stage=1, split_boundaries="0,1,3")
    assert PeerConfig(model="tiny", stage=1, num_stages=2).requested_boundaries is None
    assert _split(model="tiny", stage=1, num_stages=2) == (0, 2, 3)
    with pytest.raises(StageSplitError, match="describe 2 stages, not 3"):
        _split(model="tiny", stage=1, num_stages=3, split_boundaries="0,1,3")
    with pytest.raises(StageSplitError, match="strictly increase"):
        _split(model="tiny", stage=0, num_stages=2, split_boundaries="0,3,3")
    with pytest.raises(ConfigError, match="comma-separated"):
        PeerConfig(model="tiny", stage=0, num_stages=2, split_boundaries="zero,1,3")


def test_checkpoints_of_other_splits_get_their_own_names():
    assert split_tag(claim("a", (0, 2, 3)), n_layers=3) is None  # the equal split keeps the old file name
    assert split_tag(claim("a", (0, 1, 3)), n_layers=3) == "0-1-3"


def test_split_boundaries_memory_gives_the_end_stages_fewer_blocks():
    """`--split-boundaries memory` resolves, at start-up, to the split balancing the stages'
    parameters: for a gpt2-350m-shaped model (vocabulary matrices of 51M parameters on each end,
    3.1M per block) the end stages get 4 blocks and the middle ones 8, as benchmarks/import.py measured."""
    assert _split(model="gpt2-350m", stage=3, num_stages=4, split_boundaries="memory") == (0, 4, 12, 20, 24)
    # with no vocabulary to speak of it is the equal split
    assert _split(model="tiny", stage=0, num_stages=3, split_boundaries="memory") == (0, 1, 2, 3)


def test_split_boundaries_memory_with_more_stages_than_blocks_is_one_line():
    with pytest.raises(ConfigError, match="--split-boundaries memory: cannot split 3 blocks into 5 stages"):
        _split(model="tiny", stage=0, num_stages=5, split_boundaries="memory")
