"""Evaluation on a peer's stage keeps nothing and changes nothing; the vocabulary is part of the
model: resolved in one place, checked against the swarm's in one line."""

from __future__ import annotations

import pytest
import torch

from dht.records import PeerRecord, PeerState
from dht.vocabulary import VocabularyMismatchError, check_vocabulary
from models.config import get_model_config, resolve_model_config
from peers.compute.stage_runtime import BadRequestError, OptimizerSettings, StageRuntime


def test_evaluate_returns_the_forward_loss_and_keeps_nothing():
    config = resolve_model_config("tiny", 300)
    first, last = (StageRuntime(config, s, 2, optimizer=OptimizerSettings(target_batch_size=4)) for s in range(2))
    inputs = torch.randint(0, 300, (4, config.seq_len))
    targets = torch.randint(0, 300, (4, config.seq_len))
    before = [p.detach().clone() for p in last.params]
    hidden = first.evaluate(inputs)
    loss = float(last.evaluate(hidden, targets))
    assert not hidden.requires_grad and 4 < loss < 8  # about ln(300) for an untrained model
    for runtime in (first, last):
        assert (len(runtime.cache), runtime.samples_accumulated, runtime.steps_done) == (0, 0, 0)
        assert all(p.grad is None for p in runtime.params)
    assert all(torch.equal(a, b) for a, b in zip(before, last.params))
    # the same loss as the training forward computes
    assert float(last.forward("mb", hidden, targets)) == pytest.approx(loss, rel=1e-5)
    with pytest.raises(BadRequestError, match="token ids"):
        first.evaluate(torch.full((4, config.seq_len), 300))


def test_the_vocabulary_override_is_resolved_in_one_place():
    assert resolve_model_config("small") is get_model_config("small")
    config = resolve_model_config("small", 4096)
    assert config.vocab_size == 4096 and config.d_model == get_model_config("small").d_model


def record(peer: str, vocab: int, state=PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(
        peer_id=peer, model="tiny", stage=0, num_stages=2, state=state, throughput=1.0, expires_at=0.0, vocab_size=vocab
    )


def test_a_different_vocabulary_is_refused_in_one_line_naming_both():
    check_vocabulary([record("p1", 2048), record("p2", 0)], 2048, model="tiny", mine="the data")
    check_vocabulary([record("p1", 256, PeerState.OFFLINE)], 2048, model="tiny", mine="the data")
    with pytest.raises(VocabularyMismatchError) as e:
        check_vocabulary([record("p1", 2048)], 256, model="tiny", mine="the data at d")
    assert "2048" in str(e.value) and "256" in str(e.value) and "\n" not in str(e.value)


def test_the_trainer_exports_the_last_validation_loss():
    from prometheus_client import generate_latest

    from swarm.trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics()
    metrics.observe_eval(step=20, loss=3.25)
    text = generate_latest(metrics.registry).decode()
    assert "swarm_trainer_eval_loss 3.25" in text and "swarm_trainer_eval_step 20.0" in text
