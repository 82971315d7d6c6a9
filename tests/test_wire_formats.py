"""Wire formats: round trips, size limits checked before buffering, and fuzzed decoders that only ever
raise ProtocolError (never crash with anything else)."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import FrameTooLarge, MalformedMessage, PeerClosed, ProtocolError, SchemaError, UnsupportedVersion
from protocols.framing import FrameReader, frame, unpack
from protocols.rollouts import RolloutAck, RolloutGroup, Sample
from protocols.work import SamplingParams, TaskSpec, WorkLease, WorkRequest
from tests.helpers import FakeStream


def group() -> RolloutGroup:
    return RolloutGroup(
        "g",
        "l",
        "reverse",
        3,
        0,
        "peer",
        [1, 4, 5],
        1.0,
        1.0,
        "q8",
        [Sample("g/0", [5, 2], [-0.5, -0.1], "stop"), Sample("g/1", [6, 7], [-1.0, -2.0], "length")],
    )


def test_round_trips():
    g = group()
    assert RolloutGroup.from_wire(unpack(frame(g.to_wire(), 1 << 20)[4:], 1 << 20)) == g
    lease = WorkLease("abc", 2, 8, SamplingParams(1.0, 1.0, 8), [TaskSpec("reverse", 1, [1, 2])], 60.0)
    assert WorkLease.from_wire(lease.to_wire()) == lease
    assert WorkRequest.from_wire(WorkRequest(3).to_wire()) == WorkRequest(3)
    ack = RolloutAck(["a"], ["b"], [("c", "why")])
    assert RolloutAck.from_wire(ack.to_wire()) == ack


async def test_frames_assemble_from_small_reads_and_keep_the_rest():
    data = frame({"v": 1, "t": "a", "x": b"y" * 1000}, 4096) + frame({"v": 1, "t": "b"}, 4096)
    reader = FrameReader(FakeStream(data))
    assert (await reader.read_message(4096))["t"] == "a"
    assert (await reader.read_message(4096))["t"] == "b"
    with pytest.raises(PeerClosed):
        await reader.read_message(4096)


async def test_oversized_header_is_refused_before_the_body():
    reader = FrameReader(FakeStream(struct.pack(">I", 1 << 30)))  # no body at all: must not wait for it
    with pytest.raises(FrameTooLarge):
        await reader.read_body(1 << 20)
    with pytest.raises(FrameTooLarge):
        frame({"v": 1, "t": "x", "b": b"0" * 100}, 50)


def test_bad_messages_raise_clear_errors():
    with pytest.raises(MalformedMessage):
        unpack(b"\xc1", 100)
    with pytest.raises(UnsupportedVersion):
        unpack(msgpack.packb({"v": 2, "t": "x"}), 100)
    bad = group().to_wire()
    bad["samples"][0]["logprobs"] = [0.5]
    with pytest.raises(SchemaError):
        RolloutGroup.from_wire(bad)
    bad = group().to_wire()
    bad["samples"][0]["logprobs"] = [float("nan"), -1.0]
    with pytest.raises(SchemaError):
        RolloutGroup.from_wire(bad)
    bad = group().to_wire()
    bad["samples"][1]["rollout_id"] = "g/0"
    with pytest.raises(SchemaError, match="repeat"):
        RolloutGroup.from_wire(bad)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzzed_bytes_only_raise_protocol_errors(data):
    for parse in (RolloutGroup.from_wire, WorkLease.from_wire, WorkRequest.from_wire, RolloutAck.from_wire):
        try:
            parse(unpack(data, 1 << 16))
        except ProtocolError:
            pass


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*list(group().to_wire()), "zz"]), json_like, max_size=14))
def test_fuzzed_maps_only_raise_protocol_errors(fields):
    msg = {**fields, "v": 1, "t": "rollouts"}
    try:
        RolloutGroup.from_wire(unpack(msgpack.packb(msg), 1 << 16))
    except ProtocolError:
        pass
