"""ServiceClock, and routing fed by it: a replica that lies about its speed gets no more than its
measured share of the calls (issue #30)."""

import heapq
from collections import Counter

import pytest

from swarm.trainer.routing import ReplicaInfo, ReplicaScheduler
from swarm.trainer.service_clock import ServiceClock


def test_service_time_starts_at_the_later_of_sending_and_the_previous_answer():
    clock = ServiceClock()
    # Three calls sent together at t=0 to a replica that answers one per second.
    assert clock.finished("a", 0.0, 1.0) == 1.0
    assert clock.finished("a", 0.0, 2.0) == 1.0  # it waited behind the first: not the replica's time
    assert clock.finished("a", 0.0, 3.0) == 1.0
    # Idle, then one call: its whole latency.
    assert clock.finished("a", 10.0, 10.5) == 0.5
    # Other replicas have clocks of their own.
    assert clock.finished("b", 0.0, 4.0) == 4.0


def test_an_answer_that_overtook_an_earlier_one_does_not_move_the_clock_back():
    clock = ServiceClock()
    assert clock.finished("a", 0.0, 2.0) == 2.0
    assert clock.finished("a", 0.5, 1.5) == 0.0  # completed before the previous answer came
    assert clock.finished("a", 0.0, 3.0) == 1.0


def test_bad_times_are_refused_and_memory_is_bounded():
    clock = ServiceClock(max_peers=2)
    with pytest.raises(ValueError):
        clock.finished("a", 2.0, 1.0)
    with pytest.raises(ValueError):
        clock.finished("a", float("nan"), 1.0)
    for peer in "abc":
        clock.finished(peer, 0.0, 5.0)
    assert clock.finished("a", 0.0, 6.0) == 6.0  # "a" was forgotten (longest idle): a fresh start


class SimClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def route_with_a_liar(calls: int, *, in_flight: int = 8) -> Counter:
    """Simulate a trainer keeping `in_flight` forwards of 4 samples in flight over two FIFO replicas:
    "honest" serves 10 samples/s and says so; "liar" serves 1 sample/s but announces 10,000 and
    would report ~0 compute time. Routing sees only the trainer's own service times."""
    true_seconds_per_sample = {"honest": 0.1, "liar": 1.0}
    sim = SimClock()
    scheduler = ReplicaScheduler(clock=sim)
    scheduler.update_replicas([ReplicaInfo("honest", 10.0), ReplicaInfo("liar", 10_000.0)])
    service = ServiceClock()
    free_at = {peer: 0.0 for peer in true_seconds_per_sample}
    pending: list[tuple[float, int, str, float]] = []
    counts: Counter = Counter()

    def dispatch(seq: int) -> None:
        peer = scheduler.choose("forward", 4)
        done = max(sim.now_s, free_at[peer]) + 4 * true_seconds_per_sample[peer]
        free_at[peer] = done
        heapq.heappush(pending, (done, seq, peer, sim.now_s))
        counts[peer] += 1

    for seq in range(in_flight):
        dispatch(seq)
    for seq in range(in_flight, calls):
        done, _, peer, sent = heapq.heappop(pending)
        sim.now_s = done
        scheduler.report_success(peer, "forward", 4, service.finished(peer, sent, done))
        dispatch(seq)
    return counts


def test_a_replica_lying_about_its_speed_gets_no_more_than_its_measured_share():
    counts = route_with_a_liar(480)
    # Measured: the liar serves 1 of every 11 samples the pair can serve. It is tried at first (its
    # announcement is the only prior), then falls to its share.
    assert counts["liar"] / 480 <= 1 / 11 + 0.03, counts
    assert counts["honest"] > 400, counts
