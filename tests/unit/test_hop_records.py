"""What a peer keeps of its chains' hops for the trainer's spot checks (peers/serving/hop_records.py)."""

from __future__ import annotations

import pytest
import torch

from peers.serving.hop_records import HopRecords
from wire.protocol import HopRecordRequest, ProtocolError, decode_header, encode_header
from wire.tensors import decode_tensors, encode_tensor


def activations(value: float, numel: int = 256):
    return encode_tensor(torch.full((numel,), value), "none")  # 4 bytes per value


def test_a_record_is_handed_only_to_the_trainer_that_drove_the_chain():
    records = HopRecords(max_bytes=1 << 20)
    records.keep("run:0:1", "received", "trainer-a", activations(1.0))
    kept = records.find("run:0:1", "received", "trainer-a")
    assert kept is not None and torch.equal(decode_tensors({"x": kept})["x"], torch.full((256,), 1.0))
    assert records.find("run:0:1", "received", "trainer-b") is None  # another caller learns nothing
    assert records.find("run:0:1", "sent", "trainer-a") is None  # the other side was not kept
    assert records.find("run:0:2", "received", "trainer-a") is None


def test_the_oldest_records_go_first_once_over_the_byte_budget():
    records = HopRecords(max_bytes=3 * 1024)  # three records of 1 KiB
    for i in range(4):
        records.keep(f"mb{i}", "sent", "t", activations(float(i)))
    assert len(records) == 3 and records.nbytes == 3 * 1024
    assert records.find("mb0", "sent", "t") is None
    assert all(records.find(f"mb{i}", "sent", "t") is not None for i in (1, 2, 3))
    # a later attempt of a microbatch replaces its record (and its bytes), and counts as the newest
    records.keep("mb1", "sent", "t", activations(9.0))
    assert len(records) == 3 and records.nbytes == 3 * 1024
    records.keep("mb4", "sent", "t", activations(4.0))
    assert records.find("mb2", "sent", "t") is None and records.find("mb1", "sent", "t") is not None
    assert float(decode_tensors({"x": records.find("mb1", "sent", "t")})["x"][0]) == 9.0


def test_a_tensor_larger_than_the_budget_is_not_kept_and_bad_sides_are_refused():
    records = HopRecords(max_bytes=512)
    records.keep("mb", "received", "t", activations(1.0))  # 1 KiB
    assert len(records) == 0 and records.nbytes == 0
    with pytest.raises(ValueError, match="side"):
        records.keep("mb", "both", "t", activations(1.0, numel=8))
    with pytest.raises(ValueError):
        HopRecords(max_bytes=-1)


def test_the_request_is_a_typed_header_and_a_bad_side_is_a_protocol_error():
    request = HopRecordRequest(model="tiny", stage=1, num_stages=3, microbatch_id="run:0:1", side="sent")
    assert decode_header(HopRecordRequest, encode_header(request)) == request
    bad = encode_header(request).replace(b"sent", b"all!")
    with pytest.raises(ProtocolError):
        decode_header(HopRecordRequest, bad)
