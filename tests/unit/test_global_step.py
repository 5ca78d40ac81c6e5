"""One global step over several trainers: when a step is over, whom a commit's caps count, which
run a starting trainer joins (swarm/trainer/global_step.py), and the progress record itself
(dht/trainer_progress.py)."""

import pytest

from dht.trainer_progress import TrainerProgress, parse_progress_records
from swarm.trainer.global_step import (
    CLAIM_S,
    joining_point,
    may_send,
    merged_served,
    run_to_adopt,
    step_id,
    step_status,
)

NOW = 1_000.0


def progress(
    peer: str, step: int, samples: int, *, run="r1", served=None, expires_at=NOW + 60, in_flight=0, published_at=NOW
) -> TrainerProgress:
    return TrainerProgress(
        peer_id=peer,
        model="tiny",
        num_stages=2,
        run=run,
        step=step,
        samples=samples,
        in_flight=in_flight,
        published_at=published_at,
        served=served or {},
        expires_at=expires_at,
    )


def test_a_step_ends_when_every_trainers_samples_reach_the_batch():
    others = [progress("QmB", 4, 12), progress("QmC", 3, 32)]  # QmC's record is of an earlier step
    assert step_status(4, 16, others, batch=32) == step_status(4, 16, others[:1], batch=32)
    assert not step_status(4, 16, others, batch=32).over and step_status(4, 16, others, batch=32).samples == 28
    assert step_status(4, 20, others, batch=32).over


def test_a_step_is_over_once_another_trainer_has_moved_past_it():
    assert step_status(4, 0, [progress("QmB", 5, 0)], batch=32).over


def test_one_record_counts_at_most_a_batch():
    # a trainer claiming far more than a batch ends the step as a commit of its own would, no sooner
    assert step_status(4, 0, [progress("QmB", 4, 10**9)], batch=32).samples == 32


def test_the_commit_caps_sum_every_trainers_counts_for_the_step():
    others = [
        progress("QmB", 4, 8, served={"0/QmP0": 4, "0/QmP1": 4, "1/QmQ0": 8}),
        progress("QmC", 3, 8, served={"0/QmP0": 8}),  # another step: not counted
    ]
    caps = merged_served(4, {0: {"QmP0": 6}, 1: {"QmQ0": 6}}, others)
    assert caps == {0: {"QmP0": 10, "QmP1": 4}, 1: {"QmQ0": 14}}


def test_a_starting_trainer_joins_the_run_of_the_trainers_at_work():
    records = [progress("QmMe", 0, 0, run="mine"), progress("QmC", 7, 3, run="r1"), progress("QmB", 6, 0, run="r1")]
    assert joining_point(records, "QmMe") == ("r1", 7)
    assert joining_point([progress("QmMe", 0, 0)], "QmMe") is None


def test_of_two_runs_started_at_once_the_lower_peer_ids_wins():
    records = [progress("QmA", 0, 0, run="ra"), progress("QmB", 0, 0, run="rb")]
    assert run_to_adopt(records, "QmB", "rb") == "ra"
    assert run_to_adopt(records, "QmA", "ra") is None


def test_every_trainer_of_a_run_commits_a_step_under_one_id():
    assert step_id("r1", 3) == step_id("r1", 3) != step_id("r1", 4) != step_id("r2", 4)


def test_malformed_or_expired_progress_records_are_skipped():
    good = progress("QmB", 1, 4, served={"1/QmQ0": 4})
    entries = {
        "QmB": good.to_wire(),
        "QmC": {**progress("QmC", 1, 4).to_wire(), "served": {"9/QmQ0": 4}},  # no stage 9 of 2
        "QmD": progress("QmD", 1, 4, expires_at=NOW - 1).to_wire(),
        "QmE": {**progress("QmE", 1, 4).to_wire(), "samples": -1},
        "QmF": progress("QmX", 1, 4).to_wire(),  # filed under another trainer's subkey
        "QmG": progress("QmG", 1, 4, expires_at=NOW + 10**6).to_wire(),
    }
    assert parse_progress_records(entries, model="tiny", now=NOW) == [good]
    assert good.served_by_stage() == {1: {"QmQ0": 4}}


def test_a_record_naming_a_stage_past_the_last_is_refused():
    with pytest.raises(ValueError, match="stage/peer id"):
        TrainerProgress.from_wire({**progress("QmB", 1, 4).to_wire(), "served": {"2/QmQ0": 4}})


def test_trainers_that_start_a_step_together_split_it():
    other = progress("QmB", 4, 0)  # batch 8, two trainers at work: each has at most 4 in flight
    assert may_send(4, 0, 0, [other], batch=8, now=NOW) and may_send(4, 0, 2, [other], batch=8, now=NOW)
    assert not may_send(4, 0, 4, [other], batch=8, now=NOW)
    assert may_send(4, 4, 2, [other], batch=8, now=NOW)  # 4 of ours finished: our share is free again
    # what the other has in flight is claimed while its record is fresh: ours 2 + its 6 fill the batch
    busy = progress("QmB", 4, 2, in_flight=4)
    assert not may_send(4, 2, 2, [busy], batch=8, now=NOW)
    # a trainer that stopped renewing its record (killed) claims nothing after CLAIM_S
    assert may_send(4, 2, 2, [busy], batch=8, now=NOW + CLAIM_S + 1)


def test_a_trainer_whose_record_is_still_on_the_last_step_claims_its_share_of_this_one():
    """The first trainer on a step sees the other's record of the step before (stored a moment
    ago): it sends its share, not the whole batch (two trainers trained 1.8x the batch a step on
    `tiny` before this); once that record goes stale, the other claims nothing."""
    behind = progress("QmB", 3, 4)
    assert may_send(4, 0, 2, [behind], batch=8, now=NOW) and not may_send(4, 0, 4, [behind], batch=8, now=NOW)
    assert not may_send(4, 4, 0, [behind], batch=8, now=NOW)  # ours 4 + its share 4 fill the batch
    assert may_send(4, 4, 0, [behind], batch=8, now=NOW + CLAIM_S + 1)


def test_claims_that_are_never_finished_cannot_stall_a_step():
    forged = progress("QmEvil", 4, 0, in_flight=10**6)  # renewed forever, never finished
    assert may_send(4, 0, 0, [forged], batch=8, now=NOW) and may_send(4, 2, 0, [forged], batch=8, now=NOW)
    assert not may_send(4, 4, 0, [forged], batch=8, now=NOW)  # our share sent: the claim holds us now


def test_alone_a_trainer_sends_the_whole_batch_at_once():
    assert may_send(0, 0, 6, [], batch=8, now=NOW) and not may_send(0, 0, 8, [], batch=8, now=NOW)


def test_progress_stored_in_the_background_coalesces_and_the_last_store_waits_for_it(monkeypatch):
    """`publish_soon` never awaits the DHT: a store under way takes the record's later changes in one
    more store (stores never overlap), and `published` waits for them before the step's last one."""
    import asyncio

    import swarm.trainer.global_step as global_step

    stored: list[int] = []
    running = []

    async def store(dht, record):
        running.append(1)
        assert len(running) == 1  # one store at a time
        await asyncio.sleep(0.05)
        stored.append(record.samples)
        running.pop()
        return True

    monkeypatch.setattr(global_step, "publish_progress_async", store)

    async def scenario():
        progress = global_step.SharedProgress(None, model="tiny", num_stages=2, batch=8, peer_id="me")
        for samples in (2, 2, 2):
            progress.sent(samples)
            progress.note(samples, {})
            progress.publish_soon()
            await asyncio.sleep(0)  # the first store starts with 2 samples; the other two changes wait
        assert stored == []  # nothing awaited
        await progress.published()
        return progress

    progress = asyncio.run(scenario())
    assert stored == [2, 6] and progress.samples == 6  # the first record, then the latest in one store
