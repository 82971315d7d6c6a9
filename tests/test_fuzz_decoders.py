"""Hypothesis fuzzing of every decoder a peer can reach: frames, the weights protocol, gossip announcements,
error replies and the signed manifest. Any input must either parse or raise ProtocolError; nothing else may
escape (an escaping exception in a py-libp2p handler takes the whole host down)."""

from __future__ import annotations

import struct
import zlib

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.weights.manifest import sign_manifest, verify_manifest
from protocols import weights as w
from protocols.errors import FrameTooLarge, PeerClosed, ProtocolError, RemoteError
from protocols.framing import FrameReader, frame, unpack
from protocols.messages import raise_if_error
from protocols.rollouts import RolloutAck, RolloutGroup
from protocols.work import SamplerReport, WorkLease, WorkRequest
from tests.helpers import FakeStream

KEY = create_new_key_pair()
TRUSTED = ID.from_pubkey(KEY.public_key)
H = bytes(range(32))

MANIFEST = w.Manifest(
    swarm="fuzz",
    version=3,
    parent=2,
    encoding="fp32",
    chunk_size=1024,
    files=[w.FileEntry("config.json", 10, [H]), w.FileEntry("model.safetensors", 2048, [H[::-1], bytes(32)])],
    tensors=[w.TensorEntry("a.weight", "F32", [16, 16], 100, 1024)],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5),
    max_leaves=25,
)
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parses_or_refuses(parse, *args) -> None:
    try:
        parse(*args)
    except ProtocolError:
        pass


def mutate(message: dict, fields: dict) -> dict:
    """A valid message with some fields replaced, removed (None) or added."""
    out = dict(message)
    for key, value in fields.items():
        if value is None and key in out:
            del out[key]
        else:
            out[key] = value
    return out


WEIGHT_DECODERS = [
    w.parse_request,
    w.parse_announce,
    lambda m: w.parse_have(m, 3),
    lambda m: w.parse_chunks_reply(m, [H], 1024),
    w.SignedManifest.from_wire,
    RolloutGroup.from_wire,
    RolloutAck.from_wire,
    WorkLease.from_wire,
    WorkRequest.from_wire,
]


@FUZZ
@given(st.binary(max_size=1024))
def test_random_bytes_never_crash_any_decoder(data):
    for parse in WEIGHT_DECODERS:
        parses_or_refuses(lambda d, p=parse: p(unpack(d, 1 << 16)), data)
    parses_or_refuses(w.Manifest.from_body, data)


VALID = {
    "get_manifest": w.get_manifest(H),
    "get_chunks": w.get_chunks([H, H[::-1]]),
    "get_have": w.get_have(H),
    "announce": w.announce(4, H),
    "have": w.have_reply(H, b"\x07"),
    "chunks": w.chunks_reply([(H, b"x" * 10)], [H[::-1]]),
}


def wire(message: dict) -> dict:
    """Through the real encoder and decoder, as a peer's bytes would come."""
    return unpack(msgpack.packb(message, use_bin_type=True), 1 << 16)


def test_positive_control_valid_messages_decode_to_what_was_sent():
    """The fuzz tests only show refusals are clean; this shows the decoders accept what honest peers send."""
    assert w.parse_request(wire(VALID["get_manifest"])) == ("get_manifest", H)
    assert w.parse_request(wire(VALID["get_chunks"])) == ("get_chunks", [H, H[::-1]])
    assert w.parse_request(wire(VALID["get_have"])) == ("get_have", H)
    assert w.parse_announce(wire(VALID["announce"])) == (4, H)
    assert w.parse_have(wire(VALID["have"]), 3) == (H, b"\x07")
    assert w.parse_chunks_reply(wire(VALID["chunks"]), [H, H[::-1]], 1024) == ({H: b"x" * 10}, [H[::-1]])
    assert w.Manifest.from_body(MANIFEST.body()) == MANIFEST
    signed = sign_manifest(MANIFEST, KEY)
    assert verify_manifest(w.SignedManifest.from_wire(wire(signed.to_wire())), TRUSTED, "fuzz") == MANIFEST
    assert WorkRequest.from_wire(wire(WorkRequest(3).to_wire())) == WorkRequest(3)
    with_report = WorkRequest(3, SamplerReport(2, 10, "mlx/q8"))
    assert WorkRequest.from_wire(wire(with_report.to_wire())) == with_report


@FUZZ
@given(
    st.sampled_from(sorted(VALID)),
    st.dictionaries(
        st.sampled_from(["t", "id", "hashes", "version", "bits", "found", "missing", "zz"]),
        values | st.none(),
        max_size=4,
    ),
)
def test_mutated_weight_messages_only_raise_protocol_errors(kind, fields):
    data = msgpack.packb(mutate(VALID[kind], {**fields, "v": 1}))
    for parse in WEIGHT_DECODERS[:4]:
        parses_or_refuses(lambda d, p=parse: p(unpack(d, 1 << 16)), data)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            ["swarm", "version", "parent", "encoding", "chunk_size", "total_size", "files", "tensors", "t"]
        ),
        values | st.none(),
        max_size=4,
    ),
    st.lists(st.dictionaries(st.sampled_from(["path", "size", "chunks", "x"]), values, max_size=4), max_size=3),
)
def test_mutated_manifest_bodies_only_raise_protocol_errors(fields, files):
    body = msgpack.unpackb(MANIFEST.body())
    if files:
        fields = {**fields, "files": files}
    mutated = msgpack.packb(mutate(body, fields), use_bin_type=True)
    try:
        manifest = w.Manifest.from_body(mutated)
    except ProtocolError:
        return
    # whatever parses is internally consistent: safe names, enough chunks for every file
    for f in manifest.files:
        assert f.path and "/" not in f.path and not f.path.startswith(".")
        assert len(f.chunks) * manifest.chunk_size >= f.size
    # and a body signed by the trusted key round-trips through verification
    signed = sign_manifest(manifest, KEY)
    assert verify_manifest(signed, TRUSTED, manifest.swarm) == manifest


def test_a_manifest_travels_compressed_and_a_zlib_bomb_is_refused():
    signed = sign_manifest(MANIFEST, KEY)
    sent = signed.to_wire()
    assert "body" not in sent and zlib.decompress(sent["zbody"]) == signed.body
    assert w.SignedManifest.from_wire(wire(sent)) == signed
    raw = {"v": 1, "t": "manifest", "body": signed.body, "sig": signed.signature, "key": signed.public_key}
    assert w.SignedManifest.from_wire(wire(raw)) == signed  # as manifests travelled before
    bomb = zlib.compress(bytes(w.MAX_MANIFEST_BODY + 1), 9)  # 8 KB that inflate past the body limit
    for zbody in (bomb, sent["zbody"][:-3], sent["zbody"] + b"more", b"\x00" * 40):  # a bomb, cut, trailing, junk
        with pytest.raises(ProtocolError, match="zlib"):
            w.SignedManifest.from_wire({**sent, "zbody": zbody})


@FUZZ
@given(st.binary(max_size=64), st.binary(max_size=64), st.integers(0, 200))
def test_forged_signatures_and_keys_are_refused(sig, key, flip):
    signed = sign_manifest(MANIFEST, KEY)
    body = bytearray(signed.body)
    body[flip % len(body)] ^= 0x01
    for candidate in (
        w.SignedManifest(signed.body, sig, signed.public_key),
        w.SignedManifest(signed.body, signed.signature, key),
        w.SignedManifest(bytes(body), signed.signature, signed.public_key),
    ):
        with pytest.raises(ProtocolError):
            verify_manifest(candidate, TRUSTED, "fuzz")


@FUZZ
@given(values)
def test_error_replies_of_any_shape_become_remote_errors(payload):
    reply = {"v": 1, "t": "error", "code": payload, "message": payload}
    with pytest.raises(RemoteError) as info:
        raise_if_error(reply)
    assert len(info.value.code) <= 64 and len(info.value.message) <= 1024


@FUZZ
@given(st.binary(max_size=600), st.integers(1, 50))
def test_frame_reader_on_random_streams(data, piece):
    """Random bytes in random read sizes: whole frames, a clear refusal, or a clean 'peer closed'."""

    async def read_all() -> int:
        reader = FrameReader(FakeStream(data, piece))
        n = 0
        while True:
            try:
                await reader.read_message(256)
                n += 1
            except PeerClosed:
                return n
            except ProtocolError:
                return n

    trio.run(read_all)


@pytest.mark.parametrize("announced", [257, 1 << 20, (1 << 32) - 1])
async def test_oversized_announcements_never_buffer_the_body(announced):
    stream = FakeStream(struct.pack(">I", announced) + b"\x00" * 300)
    reader = FrameReader(stream)
    with pytest.raises(FrameTooLarge):
        await reader.read_body(256)
    assert len(stream.data) == 300  # not one body byte was read


def test_nested_and_huge_containers_are_refused_cheaply():
    deep = b"\x91" * 10_000 + b"\xc0"  # 10k nested one-element arrays
    with pytest.raises(ProtocolError):
        unpack(deep, 1 << 16)
    claims_4g_items = b"\xdd\xff\xff\xff\xff"  # array32 header announcing 2**32-1 items, no items
    with pytest.raises(ProtocolError):
        unpack(claims_4g_items, 1 << 16)
    with pytest.raises(ProtocolError):
        frame({"v": 1, "t": "x", "b": b"0" * 300}, 256)
