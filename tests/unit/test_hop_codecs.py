"""Direct routing's per-hop codecs (peers/serving/hop_codecs.py) and the chained call's codec fields
(wire/protocol.py): pure, no network."""

from __future__ import annotations

import msgpack
import pytest

from peers.serving.hop_codecs import HopCodecs, gradient_feedback_key
from wire.failures import Failure
from wire.protocol import ChainRequest, ChainResponse, HopFailover, ProtocolError, decode_header, encode_header
from wire.tensors import check_codec

NUMEL = 4 * 128 * 256  # one small-model microbatch of activations


def request(**fields) -> ChainRequest:
    base = dict(model="m", stage=1, num_stages=3, microbatch_id="x", batch_size=4, timeout_s=5.0, trainer_id="t")
    return ChainRequest(**{**base, **fields})


def test_a_fixed_codec_applies_on_every_hop_whatever_was_measured():
    hops = HopCodecs()
    hops.observe("slow", 2, nbytes=10_000_000, elapsed_s=20.0, handler_s=0.5, compute_s=0.4, batch_size=4)
    for peer in ("slow", "never-called"):
        assert hops.choose("int8", 0.1, peer, 2, NUMEL, 4, is_gradient=False).codec == "int8"
        assert hops.choose("none", 0.1, peer, 2, NUMEL, 4, is_gradient=True).codec == "none"
    topk = hops.choose("topk", 0.05, "slow", 2, NUMEL, 4, is_gradient=True)
    assert (topk.codec, topk.params) == ("topk", {"fraction": 0.05})


def test_adaptive_chooses_per_link_from_what_the_sender_measured():
    hops = HopCodecs()
    # nothing measured: uncompressed
    assert hops.choose("adaptive", 0.1, "slow", 2, NUMEL, 4, is_gradient=False).codec == "none"
    # a hop of 1 MB each way that took 2.05 s, 2 s of it in the replica's handler (0.2 s of compute):
    # 20 MB/s (160 Mbit/s), and a 0.5 MB tensor's budget is 0.5 x 0.1 s: int8 (fastest under ~450 Mbit/s)
    hops.observe("fast", 2, nbytes=1_000_000, elapsed_s=2.05, handler_s=2.0, compute_s=0.2, batch_size=4)
    # the same hop to another replica moved 100 kB in 1 s on its link (~0.2 MB/s): int8 misses 4x the budget
    hops.observe("slow", 2, nbytes=100_000, elapsed_s=3.0, handler_s=2.0, compute_s=0.2, batch_size=4)
    fast = hops.choose("adaptive", 0.1, "fast", 2, NUMEL, 4, is_gradient=False)
    slow = hops.choose("adaptive", 0.1, "slow", 2, NUMEL, 4, is_gradient=False)
    assert fast.codec == "int8"
    assert slow.codec in ("int4", "topk") and slow.estimated_nbytes < fast.estimated_nbytes


def test_a_handler_time_beyond_the_call_counts_as_no_link_time():
    hops = HopCodecs()
    hops.observe("p", 1, nbytes=1000, elapsed_s=1.0, handler_s=5.0, compute_s=0.1, batch_size=1)
    assert hops.adaptive.meter.links() == []  # no transfer time: not a measurement of the link


def test_gradient_residuals_are_kept_per_caller():
    assert gradient_feedback_key("a") != gradient_feedback_key("b")
    assert gradient_feedback_key("a") == gradient_feedback_key("a")


def test_a_chained_call_names_known_codecs_only():
    header = request(codec="adaptive", response_codec="topk", response_codec_params={"fraction": 0.05})
    assert decode_header(ChainRequest, encode_header(header)) == header
    for bad in ({"codec": "zip"}, {"response_codec": "adaptive"}, {"topk_fraction": 0.0}, {"topk_fraction": 2.0}):
        raw = {**header.model_dump(mode="json"), **bad}
        with pytest.raises(ProtocolError):
            decode_header(ChainRequest, msgpack.packb(raw))
    with pytest.raises(ProtocolError, match="fraction"):
        check_codec("topk", {"fraction": 3.0})
    with pytest.raises(ProtocolError, match="does not take"):
        check_codec("int8", {"fraction": 0.1})
    check_codec("int8", {})
    answer = ChainResponse(loss=1.0, served_by=["p"], compute_s=0.2, handler_s=0.5)
    assert decode_header(ChainResponse, encode_header(answer)) == answer
    with pytest.raises(ProtocolError):
        decode_header(ChainResponse, msgpack.packb({**answer.model_dump(mode="json"), "handler_s": -1.0}))


def test_a_chained_answer_says_how_each_failed_over_hop_failed():
    """The trainer counts a hop's failover by its kind (failures_by_kind, metrics) as its own failed calls."""
    failovers = [HopFailover(peer="a", stage=1, kind=Failure.GARBAGE), HopFailover(peer="b", stage=2, kind="timeout")]
    answer = ChainResponse(loss=1.0, served_by=["p"], failed_over=failovers)
    decoded = decode_header(ChainResponse, encode_header(answer))
    assert decoded == answer and [f.kind for f in decoded.failed_over] == [Failure.GARBAGE, Failure.TIMEOUT]
    raw = answer.model_dump(mode="json")
    for bad in ({"peer": "a", "stage": 1, "kind": "exploded"}, {"peer": "a", "stage": -1, "kind": "timeout"}, "a"):
        with pytest.raises(ProtocolError):
            decode_header(ChainResponse, msgpack.packb({**raw, "failed_over": [bad]}))


def test_a_peer_computing_in_16_bits_sends_in_16_bits_where_no_compression_is_asked():
    from peers.serving.hop_codecs import own_precision

    assert own_precision("none", {}, "bf16") == ("fp16", {})
    assert own_precision("none", {}, "fp16") == ("fp16", {})
    assert own_precision("none", {}, "fp32") == ("none", {})  # the equality with one process holds
    assert own_precision("none", {}, "") == ("none", {})
    assert own_precision("int8", {}, "bf16") == ("int8", {})  # a codec asked for is kept
    assert own_precision("topk", {"fraction": 0.1}, "bf16") == ("topk", {"fraction": 0.1})
