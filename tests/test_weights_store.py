"""Chunking, signing and the on-disk store, without the network."""

from __future__ import annotations

import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.weights.hashes import manifest_id
from node.weights.manifest import ForgedManifest, sign_manifest, verify_manifest, verify_once
from node.weights.publish import Publisher
from node.weights.store import BadChunk, ChunkStore
from protocols.weights import SignedManifest
from protocols.weights_file import parse_header
from tests.helpers import publish_model
from trainer.model import load_model

CHUNK = 64 << 10


@pytest.fixture
def publisher(tmp_path, tiny_model_dir):
    key = create_new_key_pair()
    return Publisher(ChunkStore(tmp_path / "trainer"), key, "t", chunk_size=CHUNK), key


def test_chunks_are_tensor_aligned_and_unchanged_tensors_cost_nothing(publisher, tiny_model_dir):
    pub, _ = publisher
    model = load_model(tiny_model_dir)
    _, _, m0 = publish_model(pub, model, 0, tiny_model_dir)
    weights = next(f for f in m0.files if f.path == "model.safetensors")
    assert all(h in pub.store._present for h in weights.chunks)
    # every tensor starts a chunk
    starts, pos = set(), 0
    for h in weights.chunks:
        starts.add(pos)
        pos += len(pub.store.read(h))
    assert pos == weights.size
    assert {t.offset for t in m0.tensors} <= starts
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(0.01)
    _, _, m1 = publish_model(pub, model, 1, tiny_model_dir)
    new = set(m1.all_chunks()) - set(m0.all_chunks())
    changed = next(t for t in m1.tensors if t.name.endswith("layers.1.mlp.down_proj.weight"))
    assert 0 < sum(len(pub.store.read(h)) for h in new) <= changed.nbytes + 4096  # that tensor (+ header)
    assert m1.parent == 0


def test_manifest_signature_is_checked(publisher, tiny_model_dir):
    pub, key = publisher
    _, signed, manifest = publish_model(pub, load_model(tiny_model_dir), 0, tiny_model_dir)
    trusted = ID.from_pubkey(key.public_key)
    assert verify_manifest(signed, trusted, "t") == manifest
    with pytest.raises(ForgedManifest, match="not the trusted trainer"):
        verify_manifest(sign_manifest(manifest, create_new_key_pair()), trusted, "t")
    tampered = SignedManifest(
        signed.body.replace(b"model.safetensors", b"model.safetensorz"), signed.signature, signed.public_key
    )
    with pytest.raises(ForgedManifest, match="does not verify"):
        verify_manifest(tampered, trusted, "t")
    with pytest.raises(ForgedManifest, match="swarm"):
        verify_manifest(signed, trusted, "other-swarm")


def test_a_manifest_already_held_is_not_verified_again(publisher, tiny_model_dir, tmp_path):
    """A version's manifest comes up to three times (push, a crossing poll, an announcement): parsed once. A copy of
    a held body with a bad signature gets the held pair back, never itself; a new body is verified (and refused if
    forged)."""
    pub, key = publisher
    model = load_model(tiny_model_dir)
    mid, signed, manifest = publish_model(pub, model, 0, tiny_model_dir)
    trusted = ID.from_pubkey(key.public_key)
    store = ChunkStore(tmp_path / "sampler")
    calls = []

    def verify(s: SignedManifest):
        calls.append(s)
        return verify_manifest(s, trusted, "t")

    assert verify_once(signed, store.manifest, verify) == (mid, signed, manifest) and len(calls) == 1
    store.add_manifest(signed, manifest)
    assert verify_once(signed, store.manifest, verify) == (mid, signed, manifest) and len(calls) == 1
    resigned = SignedManifest(signed.body, b"\0" * len(signed.signature), signed.public_key)
    got = verify_once(resigned, store.manifest, verify)
    assert got[1] is signed and got[1].signature != resigned.signature and len(calls) == 1
    forged = sign_manifest(publish_model(pub, model, 1, tiny_model_dir)[2], create_new_key_pair())
    with pytest.raises(ForgedManifest, match="not the trusted trainer"):
        verify_once(forged, store.manifest, verify)
    assert len(calls) == 2


def test_store_refuses_bad_chunks_and_resumes_after_restart(publisher, tiny_model_dir, tmp_path):
    pub, _ = publisher
    mid, signed, manifest = publish_model(pub, load_model(tiny_model_dir), 0, tiny_model_dir)
    mine = ChunkStore(tmp_path / "sampler")
    h = manifest.all_chunks()[0]
    with pytest.raises(BadChunk):
        mine.write(h, pub.store.read(h) + b"x")
    half = manifest.all_chunks()[: len(manifest.all_chunks()) // 2]
    mine.put_verified({x: pub.store.read(x) for x in half})
    mine.add_manifest(signed, manifest)
    (mine.chunk_dir / "ab").mkdir(exist_ok=True)
    (mine.chunk_dir / "ab" / ("ab" * 32 + ".tmp")).write_bytes(b"partial write from a crash")
    restarted = ChunkStore(tmp_path / "sampler")
    assert set(restarted.missing(manifest)) == set(manifest.all_chunks()) - set(half)
    assert restarted.manifest(mid) is not None and restarted.latest() is None


def test_reassembled_model_dir_is_bit_exact_and_opens_in_transformers_and_mlx(publisher, tiny_model_dir, tmp_path):
    pub, _ = publisher
    _, _, manifest = publish_model(pub, load_model(tiny_model_dir), 0, tiny_model_dir)
    out = pub.store.assemble(manifest)
    assert (out / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    from mlx_lm.utils import load_model as mlx_load

    load_model(out)
    mlx_load(out)


def test_int8_encoding_downloads_a_byte_per_parameter(tmp_path, tiny_model_dir):
    key = create_new_key_pair()
    pub = Publisher(ChunkStore(tmp_path / "q"), key, "t", chunk_size=CHUNK, encoding="int8")
    model = load_model(tiny_model_dir)
    _, _, manifest = publish_model(pub, model, 0, tiny_model_dir)
    fp32 = (tiny_model_dir / "model.safetensors").stat().st_size
    weights = next(f for f in manifest.files if f.path == "model.safetensors")
    assert weights.size < 0.3 * fp32
    out = pub.store.assemble(manifest)
    restored = load_model(out)
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=a.abs().max().item() / 100 + 1e-6), name
    _, tensors = parse_header((out / "model.safetensors").read_bytes())
    assert all(t.dtype == "F32" for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_file_encoder_streams_the_same_bytes_as_the_in_memory_one(tmp_path, tiny_model_dir, dtype):
    import numpy as np
    from safetensors.numpy import load_file

    from node.weights.encoding import encode_int8, encode_int8_file, read_float_tensors
    from trainer.model import write_weights

    src = tmp_path / "w.safetensors"
    write_weights(load_model(tiny_model_dir), src, dtype)
    encode_int8_file(src, tmp_path / "q.safetensors")
    streamed, whole = load_file(str(tmp_path / "q.safetensors")), encode_int8(read_float_tensors(src))
    assert streamed.keys() == whole.keys() and any(k.endswith(".__int8_scale__") for k in whole)
    for k, v in whole.items():
        assert streamed[k].dtype == v.dtype and np.array_equal(streamed[k], v), k


def publish_versions(pub: Publisher, model_dir, n: int) -> list:
    """Publish ``n`` versions, each changing one tensor: [(manifest id, signed, manifest), ...]."""
    model = load_model(model_dir)
    metas = []
    for v in range(n):
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.mul_(1.01)
        metas.append(publish_model(pub, model, v, model_dir))
    return metas


def test_gc_keeps_newest_versions_and_shared_chunks(publisher, tiny_model_dir):
    pub, _ = publisher
    metas = publish_versions(pub, tiny_model_dir, 4)
    pub.store.gc(keep=2)
    assert pub.store.manifest(metas[0][0]) is None and pub.store.manifest(metas[3][0]) is not None
    assert not pub.store.missing(metas[2][2]) and not pub.store.missing(metas[3][2])
    assert pub.store.missing(metas[0][2])  # its unique chunks are gone
    assert manifest_id(metas[3][1]) == metas[3][0]


def test_gc_never_drops_the_last_complete_version_for_newer_partial_ones(publisher, tiny_model_dir, tmp_path):
    """A sampler that heard of three newer versions while holding one must still restart from that one."""
    pub, _ = publisher
    metas = publish_versions(pub, tiny_model_dir, 5)
    mine = ChunkStore(tmp_path / "sampler")
    for _, signed, manifest in metas:
        mine.add_manifest(signed, manifest)
    first = metas[0][2]
    mine.put_verified({h: pub.store.read(h) for h in first.all_chunks()})  # only version 0 arrived in full
    mine.gc(keep=2)
    assert mine.latest()[2].version == 0  # still there, usable after a restart
    reopened = ChunkStore(tmp_path / "sampler")
    assert reopened.latest()[2].version == 0
    assert [mine.manifest(m[0]) is not None for m in metas] == [True, False, False, True, True]


def test_two_threads_storing_one_chunk_at_once_both_succeed(tmp_path):
    """An endgame duplicate arrives beside the original: both writes of the same chunk must succeed (they shared
    one temporary file name, and the second rename crashed the sampler in the WAN scenario)."""
    import threading

    from node.weights.hashes import digest

    store = ChunkStore(tmp_path / "s")
    data = bytes(range(256)) * 4096
    h = digest(data)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def write() -> None:
        barrier.wait()
        try:
            for _ in range(20):
                store._present.discard(h)  # as if it had not arrived yet, every time
                store.write(h, data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    assert store.read(h) == data and ChunkStore(tmp_path / "s").read(h) == data


def test_an_observer_opening_a_live_store_leaves_its_writes_in_flight_alone(tmp_path):
    """A test or bench reading a running node's progress opens its store too: a node's own start sweeps the .tmp
    files a killed process left, but an observer must not (it deleted a live sampler's write in flight, and the
    sampler crashed on the rename: burner run d4's WAN test)."""
    node = ChunkStore(tmp_path / "s")
    in_flight = node.chunk_dir / "ab" / ("ab" * 32 + ".4242.tmp")
    in_flight.parent.mkdir()
    in_flight.write_bytes(b"being written")
    ChunkStore(tmp_path / "s", observer=True)
    assert in_flight.exists()
    ChunkStore(tmp_path / "s")  # the node itself, restarted: a leftover of a killed process goes
    assert not in_flight.exists()


def test_latest_follows_every_change_of_the_store(publisher, tiny_model_dir, tmp_path):
    """``latest`` is kept between changes (every poll asks it, and recomputing walks every chunk of every manifest);
    each change a store sees — a manifest, a chunk, a chunk dropped, a gc — gives the answer a fresh store gives."""
    pub, _ = publisher
    metas = publish_versions(pub, tiny_model_dir, 3)
    mine = ChunkStore(tmp_path / "sampler")

    def agrees() -> int | None:
        got = mine.latest()
        assert got == mine._find_latest(None)  # the uncached answer
        return got[2].version if got else None

    assert agrees() is None
    for _, signed, manifest in metas:
        mine.add_manifest(signed, manifest)
        agrees()
        mine.put_verified({h: pub.store.read(h) for h in manifest.all_chunks()})
        assert agrees() == manifest.version
    newest = metas[-1][2]
    h = next(iter(set(newest.all_chunks()) - set(metas[-2][2].all_chunks())))
    mine.drop(h)
    assert agrees() == metas[-2][2].version  # the newest lost a chunk: the one before is the newest held whole
    mine.write(h, pub.store.read(h))
    assert agrees() == newest.version
    mine.gc(keep=1)
    assert agrees() == newest.version and mine.latest("int8-grid") is None
