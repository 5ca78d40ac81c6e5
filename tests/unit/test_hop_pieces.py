"""A chained call in pieces (ChainRequest.pieces): its messages cut into groups of about equal bytes
(wire/messages.py), read back as one answer, and the receiver's meeting point of a call and its
other streams (peers/serving/hop_pieces.py), without a network."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.proto import runtime_pb2

from peers.serving.hop_pieces import HopPieces, MissingPiecesError
from wire.messages import (
    Received,
    read_request,
    read_response_pieces,
    request_pieces,
    response_pieces,
    split_parts,
)
from wire.protocol import ChainPiece, ChainRequest, ChainResponse, ProtocolError
from wire.tensors import encode_tensor

TRAINER = "QmTrainer"


def part(nbytes: int) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(buffer=bytes(nbytes))


def sizes(groups) -> list[list[int]]:
    return [[len(p.buffer) for p in group] for group in groups]


def test_parts_are_cut_into_contiguous_groups_of_about_equal_bytes():
    k = 1 << 17
    assert sizes(split_parts([part(k)] * 4 + [part(4096)], 4)) == [[k], [k], [k], [k, 4096]]
    assert sizes(split_parts([part(k)] * 4, 2)) == [[k, k], [k, k]]
    assert sizes(split_parts([part(k)], 3)) == [[], [k], []]  # more streams than parts: some carry none
    assert sizes(split_parts([], 2)) == [[], []]
    assert sizes(split_parts([part(n) for n in (5, 1, 1, 1, 9, 2)], 3)) == [[5, 1], [1, 1, 9], [2]]  # in order


def request(pieces: int, **fields) -> ChainRequest:
    return ChainRequest(
        model="tiny",
        stage=1,
        num_stages=2,
        microbatch_id="m",
        batch_size=2,
        timeout_s=30.0,
        trainer_id=TRAINER,
        pieces=pieces,
        hop_id="0123456789abcdef" if pieces > 1 else None,
        **fields,
    )


def test_a_call_in_pieces_names_its_hop():
    with pytest.raises(ValueError, match="hop_id"):
        ChainRequest(model="m", stage=1, num_stages=2, microbatch_id="m", batch_size=1, timeout_s=1.0,
                     trainer_id=TRAINER, pieces=2)  # fmt: skip


async def stream(messages):
    for message in messages:
        yield message


def test_a_request_and_an_answer_in_pieces_read_back_as_the_tensors_sent():
    inputs = torch.randn(2, 32, 128)  # 32 KiB in parts of 8 KiB
    targets = torch.randint(0, 256, (2, 32))
    sent = [("inputs", encode_tensor(inputs, max_part_bytes=8192)), ("targets", encode_tensor(targets))]
    header = request(4)
    groups = request_pieces(header, sent, lambda i: ChainPiece(hop_id=header.hop_id, index=i, timeout_s=30.0))
    assert len(groups) == 4 and all(sum(len(p.buffer) for m in g for p in m.tensors) <= 9000 for g in groups)

    async def receive():
        call = await read_request(stream(groups[0]), ChainRequest)
        others = [await read_request(stream(group), ChainPiece) for group in groups[1:]]
        assert [piece.header.index for piece in others] == [1, 2, 3]
        parts = (*call.parts, *(p for piece in others for p in piece.parts))
        return call.header, parts

    call_header, parts = asyncio.run(receive())
    assert call_header.pieces == 4 and call_header.hop_id == header.hop_id
    decoded = Received(call_header, parts).decoded()
    assert torch.equal(decoded["inputs"], inputs) and torch.equal(decoded["targets"], targets)

    grad = torch.randn(2, 32, 128)
    answer = response_pieces(ChainResponse(loss=1.5), [("grad_inputs", encode_tensor(grad, max_part_bytes=8192))], 4)
    assert len(answer) == 4 and not any(m.metadata for g in answer[1:] for m in g)
    read = asyncio.run(read_response_pieces(answer, ChainResponse))
    assert read.header.loss == 1.5 and torch.equal(read.decoded()["grad_inputs"], grad)


def test_a_piece_that_answers_a_header_is_a_malformed_answer():
    header = response_pieces(ChainResponse(error="not parts", error_kind="bad_request"), [], 1)[0]
    answer = [*response_pieces(ChainResponse(loss=1.0), [], 2)[:1], header]
    with pytest.raises(ProtocolError, match="piece 1 of the call answered a header"):
        asyncio.run(read_response_pieces(answer, ChainResponse))


def test_the_call_takes_its_pieces_in_order_whenever_they_come_and_each_gets_its_answer():
    async def scenario():
        pieces = HopPieces()
        deliveries = [
            asyncio.create_task(pieces.deliver(TRAINER, "hop", i, (part(i),), claim_s=5.0, timeout_s=5.0))
            for i in (2, 1)
        ]
        await asyncio.sleep(0)
        late = asyncio.create_task(pieces.deliver(TRAINER, "hop", 3, (part(3),), claim_s=5.0, timeout_s=5.0))
        collected = await pieces.collect(TRAINER, "hop", 4, wait_s=5.0)
        assert [len(p.buffer) for p in collected] == [1, 2, 3]
        pieces.answer(TRAINER, "hop", [["one"], ["two"], []])
        answers = await asyncio.gather(*deliveries, late)
        assert answers == [["two"], ["one"], []]
        for index in (1, 2, 3):
            pieces.sent(TRAINER, "hop", index)
        await asyncio.wait_for(pieces.all_sent(TRAINER, "hop", 5.0), 1.0)
        pieces.close(TRAINER, "hop")
        assert pieces.open_hops() == 0
        # a piece of a call already served answers nothing at once
        assert await pieces.deliver(TRAINER, "hop", 1, (part(1),), claim_s=5.0, timeout_s=5.0) == []

    asyncio.run(scenario())


def test_only_the_callers_own_pieces_are_taken_and_a_missing_one_fails_the_call():
    async def scenario():
        pieces = HopPieces()
        stranger = asyncio.create_task(pieces.deliver("QmOther", "hop", 1, (part(1),), claim_s=0.3, timeout_s=5.0))
        with pytest.raises(MissingPiecesError, match=r"pieces \[1\] of 2"):
            await pieces.collect(TRAINER, "hop", 2, wait_s=0.2)
        assert await stranger == []  # nobody took it within claim_s: dropped
        assert pieces.open_hops("QmOther") == 0

    asyncio.run(scenario())


def test_a_piece_waiting_for_a_call_that_failed_answers_nothing():
    async def scenario():
        pieces = HopPieces()
        waiting = asyncio.create_task(pieces.deliver(TRAINER, "hop", 1, (part(1),), claim_s=5.0, timeout_s=5.0))
        await pieces.collect(TRAINER, "hop", 2, wait_s=5.0)
        pieces.close(TRAINER, "hop")  # the call failed after it took the pieces
        assert await asyncio.wait_for(waiting, 1.0) == []

    asyncio.run(scenario())


def test_a_piece_sent_twice_or_too_many_calls_at_once_are_refused():
    async def scenario():
        pieces = HopPieces(max_hops_per_caller=2)
        first = asyncio.create_task(pieces.deliver(TRAINER, "a", 1, (), claim_s=5.0, timeout_s=5.0))
        await asyncio.sleep(0)
        with pytest.raises(ProtocolError, match="sent twice"):
            await pieces.deliver(TRAINER, "a", 1, (), claim_s=5.0, timeout_s=5.0)
        second = asyncio.create_task(pieces.deliver(TRAINER, "b", 1, (), claim_s=5.0, timeout_s=5.0))
        await asyncio.sleep(0)
        with pytest.raises(ProtocolError, match="more than 2 calls in pieces"):
            await pieces.deliver(TRAINER, "c", 1, (), claim_s=5.0, timeout_s=5.0)
        assert pieces.open_hops("QmOther") == 0 and pieces.open_hops(TRAINER) == 2
        pieces.close(TRAINER, "a")
        pieces.close(TRAINER, "b")
        assert await first == [] and await second == []

    asyncio.run(scenario())
