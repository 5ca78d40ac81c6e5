"""Whose state a joining replica (or a repair) takes: never one donor's word alone.

A joiner asks several replicas of its stage what they would send (`StateOffer`: the step count and
the digest of the state, `state_digest`), before it downloads anything, and `choose_donors` decides:

- candidates come in a random order (`shuffled`), so no peer id, however ground, and no announced
  load sorts a donor first (before: the replica with the least announced load, ties by peer id:
  a forger with an id ground to sort first was the donor every time, issue #60);
- a state is eligible if it holds at least the joiner's own steps, and no more than the other live
  peers of the run announce on the DHT, on any stage (the largest step count in their records,
  carried forward by each record's age at twice its step rate, `steps_by_now`, or the joiner's own,
  plus `STEP_SLACK`): a forger's 10^6 steps, announced by itself only, is refused (`step_bound`);
- among eligible states within `STEP_SLACK` steps of the most trained one, the one the most donors
  agree on (same digest) wins; then the most trained. Sync replicas hold the same state bit for bit,
  so two honest ones outvote one forger (whose steps the bound keeps within the window); replicas
  that average periodically differ, and the most trained eligible state is taken; replicas that
  just joined from initial weights (they agree too) never outvote a state trained further.
The download is then checked against the chosen digest (peers/replicas/replica_sync.py).

What it does not give: between two donors that disagree and no third, the most trained eligible one
wins, so a credentialed replica that claims up to `STEP_SLACK` more steps than the others beats an
honest one. Who may be a donor at all (a run's credentialed members) is the caller's filter.

Pure: no I/O; the randomness is the caller's.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

STEP_SLACK = 16  # steps a replica may be ahead of the latest record of another (records lag by seconds)
RATE_MARGIN = 2.0  # a peer's step rate may double between its records (a trainer joins, a batch shrinks)


@dataclass(frozen=True)
class StateOffer:
    """What one donor says it would send."""

    peer_id: str
    steps_done: int
    digest: str


def state_digest(steps_done: int, module_state: Mapping[str, Any], optimizer_state: Mapping[str, Any]) -> str:
    """A hash of a stage's state by content (step count, every tensor's dtype, shape and bytes, every
    other value), the same for equal states whatever their serialization (hex sha256)."""
    digest = hashlib.sha256()
    digest.update(f"steps:{steps_done};".encode())
    _feed(digest, module_state)
    _feed(digest, optimizer_state)
    return digest.hexdigest()


def _feed(digest, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        digest.update(f"t:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        digest.update(f"d{len(value)}:".encode())
        for key in sorted(value, key=repr):
            digest.update(f"{key!r}=".encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"l{len(value)}:".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"v:{value!r};".encode())


def shuffled(peer_ids: Sequence[str], rng: random.Random) -> list[str]:
    """`peer_ids` (each once) in a random order."""
    order = list(dict.fromkeys(peer_ids))
    rng.shuffle(order)
    return order


def steps_by_now(steps_done: int, steps_per_s: float, announced_at: float, expires_at: float, now: float) -> int:
    """How many steps a peer that announced `steps_done` at `announced_at` (stepping `steps_per_s`)
    may hold `now`: twice its rate over the record's age, the age bounded by the record's lifetime (a
    clock running ahead counts no age). A record that does not say when it was made counts as is."""
    if announced_at <= 0.0:
        return steps_done
    age = min(max(now - announced_at, 0.0), max(expires_at - announced_at, 0.0))
    return steps_done + math.ceil(RATE_MARGIN * steps_per_s * age)


def step_bound(peer_id: str, own_steps: int, announced: Mapping[str, int], slack: int = STEP_SLACK) -> float:
    """The most steps a state from `peer_id` may hold: what the other live peers announce (and the
    receiver holds), plus `slack`; unbounded when no other peer announces anything (a lone donor's
    word is all there is)."""
    others = [steps for peer, steps in announced.items() if peer != peer_id]
    if not others:
        return math.inf
    return max(max(others), own_steps) + slack


def choose_donors(
    offers: Sequence[StateOffer], own_steps: int, announced: Mapping[str, int], slack: int = STEP_SLACK
) -> list[StateOffer]:
    """The donors to download from, in order: those offering the chosen state (see the module's
    docstring); empty when no offer is eligible. `offers` in the order they were asked (random)."""
    eligible = [
        offer
        for offer in offers
        if own_steps <= offer.steps_done <= step_bound(offer.peer_id, own_steps, announced, slack)
    ]
    if not eligible:
        return []
    most_trained = max(offer.steps_done for offer in eligible)
    eligible = [offer for offer in eligible if offer.steps_done >= most_trained - slack]
    by_state: dict[tuple[int, str], list[StateOffer]] = {}
    for offer in eligible:
        by_state.setdefault((offer.steps_done, offer.digest), []).append(offer)
    best = max(by_state, key=lambda state: (len(by_state[state]), state[0]))  # first on ties: the random order
    return by_state[best]


def refusals(
    offers: Sequence[StateOffer], own_steps: int, announced: Mapping[str, int], slack: int = STEP_SLACK
) -> list[str]:
    """Why each ineligible offer was refused, for the log."""
    reasons = []
    for offer in offers:
        bound = step_bound(offer.peer_id, own_steps, announced, slack)
        if offer.steps_done < own_steps:
            reasons.append(f"{offer.peer_id[-8:]} has done {offer.steps_done} steps, fewer than our {own_steps}")
        elif offer.steps_done > bound:
            reasons.append(
                f"{offer.peer_id[-8:]} offers {offer.steps_done} steps, more than any other live peer "
                f"announces ({bound - slack:.0f})"
            )
    return reasons
