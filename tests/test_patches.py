"""Versions as sparse patches (issue 12): bit-exact rebuilds through chains and anchors, bad links refused and
fetched again, the cheaper route chosen, chains kept by the store's GC, engines updated in place exactly as a full
reload would, and a swarm in which versions travel as patches."""

from __future__ import annotations

import shutil
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.weights.chain import plan, plan_bytes
from node.weights.hashes import manifest_id
from node.weights.manifest import WEIGHTS_FILE, chunk_sizes, sign_manifest
from node.weights.patch import (
    INDEX_BITMAP,
    INDEX_GAPS,
    PatchError,
    TensorMismatch,
    build_patch,
    compressor,
    decode_indices,
    decompress,
    leb128_decode,
    leb128_encode,
    unzigzag,
    zigzag,
)
from node.weights.publish import Publisher
from node.weights.store import BadChunk, ChunkStore
from protocols import weights as w
from protocols.errors import SchemaError
from trainer.model import load_model, save_model_dir

CHUNK = 16 << 10


# -- helpers --------------------------------------------------------------------------------------------------
def nudge(model, step: float, seed: int) -> None:
    """One Adam-like step: every fp32 master weight moves by ``step`` either way (bf16 keeps only some moves)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).sign() * step)


class Trainer:
    """A publisher of bf16 versions of a model, keeping a copy of every published weights file as reference."""

    def __init__(self, root: Path, model_dir: Path, anchor_every: int = 10, fraction: float = 0.5) -> None:
        self.root, self.model_dir = root, model_dir
        self.key = create_new_key_pair()
        self.pub = Publisher(
            ChunkStore(root / "trainer"),
            self.key,
            "t",
            chunk_size=CHUNK,
            anchor_every=anchor_every,
            patch_max_fraction=fraction,
        )
        self.model = load_model(model_dir)
        self.refs: dict[int, Path] = {}
        self.metas: dict[int, tuple[bytes, w.SignedManifest, w.Manifest]] = {}

    def publish(self, version: int, step: float = 0.0) -> w.Manifest:
        if step:
            nudge(self.model, step, version)
        staging = save_model_dir(self.model, self.pub.staging_dir(version), self.model_dir, torch.bfloat16)
        ref = self.root / "refs" / f"v{version}.safetensors"
        ref.parent.mkdir(exist_ok=True)
        shutil.copyfile(staging / WEIGHTS_FILE, ref)
        self.refs[version] = ref
        self.metas[version] = self.pub.publish(staging, version)
        return self.metas[version][2]

    def give(self, store: ChunkStore, version: int, route: str | None = None) -> None:
        """Hand a store a version's manifest and the chunks of one route (None: every chunk)."""
        _, signed, m = self.metas[version]
        store.add_manifest(signed, m)
        chunks = m.all_chunks() if route is None else store.route_chunks(m, route)
        store.put_verified({h: self.pub.store.read(h) for h in chunks})


def weights_of(path: Path) -> bytes:
    return (path / WEIGHTS_FILE).read_bytes()


@pytest.fixture
def bf16_trainer(tmp_path, tiny_model_dir):
    def make(**kw) -> Trainer:
        return Trainer(tmp_path, tiny_model_dir, **kw)

    return make


# -- the codec --------------------------------------------------------------------------------------------------
def test_varints_zigzag_and_index_modes_round_trip():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 5000):
        v = (rng.integers(0, 1 << 62, n, dtype=np.uint64) >> rng.integers(0, 62, n).astype(np.uint64)).astype(np.uint64)
        assert np.array_equal(leb128_decode(leb128_encode(v), n), v)
    d = np.array([-(1 << 63), -32768, -1, 0, 1, 32767, (1 << 63) - 1], dtype=np.int64)
    assert np.array_equal(unzigzag(zigzag(d)), d)
    assert list(zigzag(np.array([0, -1, 1, -2]))) == [0, 1, 2, 3]
    with pytest.raises(PatchError):
        leb128_decode(b"\x80\x80", 1)  # truncated
    with pytest.raises(PatchError):
        decode_indices(INDEX_GAPS, leb128_encode(np.array([100], dtype=np.uint64)), 1, 100)  # out of range


def test_a_patch_stream_is_one_complete_stream_within_its_delta_bound():
    for codec in w.PATCH_CODECS:
        c = compressor(codec)
        stream = c.compress(bytes(1000)) + c.flush()
        assert decompress(codec, stream, 1000) == bytes(1000)
        for bad in (stream[:-4], stream + b"x", b"junk" * 8):  # cut, trailing bytes, not the codec
            with pytest.raises(PatchError, match=codec):
                decompress(codec, bad, 1000)
        with pytest.raises(PatchError, match="past 999"):  # more than its delta allows: a bomb stops there
            decompress(codec, stream, 999)
    with pytest.raises(PatchError, match="unknown"):
        decompress("zstd", b"", 1)


def test_every_element_width_patches_exactly(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    base = {
        "a.f32": rng.standard_normal((64, 32)).astype(np.float32),
        "b.f16": rng.standard_normal(100).astype(np.float16),
        "c.i64": rng.integers(-(1 << 40), 1 << 40, 50),
        "d.u8": rng.integers(0, 255, 33).astype(np.uint8),
    }
    new = {k: v.copy() for k, v in base.items()}
    new["a.f32"][3, 4] = -new["a.f32"][3, 4]  # a sign flip: the largest possible bit delta
    new["a.f32"].reshape(-1)[::7] += 1e-3
    new["b.f16"][[0, 99]] = [np.inf, -0.0]
    new["c.i64"][5] = np.iinfo(np.int64).min
    new["d.u8"][:] = 255 - new["d.u8"]
    save_file(base, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    built = build_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors")
    assert built is not None and len(built.deltas) == 4
    from node.weights.patch import apply_patch
    from protocols.weights_file import read_layout

    _, layout = read_layout(tmp_path / "new.safetensors")
    from dataclasses import replace

    tensors = [replace(t, hash=h) for t, h in zip(layout, built.hashes, strict=True)]
    patch = w.PatchInfo(
        b"\0" * 32, 0, "zlib", built.size, [b"\1" * 32], built.weights_size, built.header_hash, built.deltas
    )
    m = w.Manifest("t", 1, 0, "native", 1 << 20, [], tensors, patch)
    changes = apply_patch(tmp_path / "old.safetensors", tmp_path / "out.safetensors", m, built.blob)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "new.safetensors").read_bytes()
    assert set(changes.indices) == set(base)
    # a different parent does not give the hashed result: refused, nothing written
    save_file(new, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(TensorMismatch):
        apply_patch(tmp_path / "wrong.safetensors", tmp_path / "out2.safetensors", m, built.blob)
    assert not (tmp_path / "out2.safetensors").exists()


# -- the manifest --------------------------------------------------------------------------------------------------
def test_manifest_format_2_and_old_full_manifests(bf16_trainer):
    t = bf16_trainer(anchor_every=3)
    m0 = t.publish(0)
    m1 = t.publish(1, 1e-4)
    m3 = [t.publish(2, 1e-4), t.publish(3, 1e-4)][1]
    assert m0.patch is None and m0.has_full and all(len(x.hash) == 32 for x in m0.tensors)
    assert m1.patch is not None and not m1.has_full and WEIGHTS_FILE not in [f.path for f in m1.files]
    assert m1.patch.parent_id == t.metas[0][0] and m1.parent == 0 and m1.patch.anchor == 0
    assert m1.total_size == m0.total_size and m1.update_size == m1.patch.size < 0.5 * m0.total_size
    assert m3.has_full and m3.patch is not None and m3.patch.anchor == 3  # an anchor carries its patch too
    for m in (m0, m1, m3):
        assert w.Manifest.from_body(m.body()) == m
    sizes = chunk_sizes(m3)
    assert sum(sizes[h] for f in m3.files for h in f.chunks) == m3.total_size  # chunks repeat (identical norms)
    assert sum(sizes[h] for h in m3.patch.chunks) == m3.patch.size
    # a format-1 manifest (no hashes, no patch) still reads and assembles
    plain = [w.TensorEntry(x.name, x.dtype, x.shape, x.offset, x.nbytes) for x in m0.tensors]
    old = w.Manifest(m0.swarm, 0, -1, "native", m0.chunk_size, m0.files, plain)
    body = old.body()
    assert b"format" not in body and b"hash" not in body
    store = ChunkStore(t.root / "old")
    signed = sign_manifest(w.Manifest.from_body(body), t.key)
    store.add_manifest(signed, old)
    store.put_verified({h: t.pub.store.read(h) for h in old.all_chunks()})
    assert weights_of(store.assemble(old)) == t.refs[0].read_bytes()
    # a patch's fields are checked against the manifest they belong to
    bad = w.Manifest(m1.swarm, 1, 1, "native", m1.chunk_size, m1.files, m1.tensors, m1.patch)  # parent not older
    with pytest.raises(SchemaError):
        w.Manifest.from_body(bad.body())
    short = w.Manifest(m1.swarm, 1, 0, "native", m1.chunk_size, m1.files, m1.tensors[:-1], m1.patch)
    with pytest.raises(SchemaError):
        w.Manifest.from_body(short.body())


# -- rebuilding --------------------------------------------------------------------------------------------------
async def test_chains_and_anchors_rebuild_every_version_bit_exact(bf16_trainer):
    t = bf16_trainer(anchor_every=4)
    for v in range(9):
        t.publish(v, 1e-4 if v else 0.0)
    assert [t.metas[v][2].has_full for v in range(9)] == [True, False, False, False, True, False, False, False, True]
    # a node that followed from version 0: each version from its parent's model dir and its patch
    follower = ChunkStore(t.root / "follower")
    for v in range(9):
        t.give(follower, v, "full" if v == 0 else "patch")
        mid, _, m = t.metas[v]
        steps = await plan(follower, mid, m)
        assert [s.route for s in steps] == (["full"] if v == 0 else ["built", "patch"])
        out = follower.assemble(m)
        assert weights_of(out) == t.refs[v].read_bytes(), v
    # anchors rebuilt from a patch had their full route stored: this node can serve them whole
    assert not follower.missing(t.metas[4][2], "full") and not follower.missing(t.metas[8][2], "full")
    # a newcomer: the anchor, then the patches after it
    newcomer = ChunkStore(t.root / "newcomer")
    t.give(newcomer, 4, "full")
    for v in (5, 6, 7):
        t.give(newcomer, v, "patch")
    mid, _, m7 = t.metas[7]
    steps = await plan(newcomer, mid, m7)
    assert [(s.manifest.version, s.route) for s in steps] == [(4, "full"), (5, "patch"), (6, "patch"), (7, "patch")]
    out = newcomer.assemble(m7)
    assert weights_of(out) == t.refs[7].read_bytes()
    from mlx_lm.utils import load_model as mlx_load

    load_model(out)  # stock transformers
    mlx_load(out)  # stock mlx-lm
    # and after a restart, the rebuilt version is usable without fetching anything
    reopened = ChunkStore(t.root / "newcomer")
    steps = await plan(reopened, mid, m7)
    assert [s.route for s in steps] == ["built"] and plan_bytes(steps) == 0


async def test_the_cheaper_route_is_chosen(bf16_trainer):
    t = bf16_trainer(anchor_every=6, fraction=0.9)
    for v in range(8):
        t.publish(v, 1e-5 if v else 0.0)  # small patches
    behind = ChunkStore(t.root / "behind")
    t.give(behind, 0, "full")
    behind.assemble(t.metas[0][2])
    store_of = {v: t.metas[v] for v in range(8)}

    async def fetch(mid):
        for m_id, signed, m in store_of.values():
            if m_id == mid:
                return signed, m
        return None

    mid, _, m7 = t.metas[7]
    small = await plan(behind, mid, m7, fetch)
    # 7 versions behind with small patches: the chain of 7 patches costs less than anchor 6 + patch 7
    assert [s.route for s in small] == ["built"] + ["patch"] * 7
    anchor_route = chunk_total(t.metas[6][2], "full") + t.metas[7][2].patch.size
    assert plan_bytes(small) < anchor_route
    # with large patches the anchor wins
    t2 = Trainer(t.root / "big", t.model_dir, anchor_every=6, fraction=0.9)
    for v in range(8):
        t2.publish(v, 3e-3 if v else 0.0)
    behind2 = ChunkStore(t.root / "behind2")
    t2.give(behind2, 0, "full")
    behind2.assemble(t2.metas[0][2])

    async def fetch2(mid):
        return next(((s, m) for m_id, s, m in t2.metas.values() if m_id == mid), None)

    mid, _, m7 = t2.metas[7]
    big = await plan(behind2, mid, m7, fetch2)
    assert [(s.manifest.version, s.route) for s in big] == [(6, "full"), (7, "patch")]
    chain = sum(t2.metas[v][2].patch.size for v in range(1, 8))
    assert plan_bytes(big) < chain
    # a missing link below the anchor does not matter; one above it leaves no route
    mid, _, m7 = t2.metas[7]
    gone = {t2.metas[3][0]}
    steps = await plan(ChunkStore(t.root / "fresh"), mid, m7, lambda x: fetch2(x) if x not in gone else none())
    assert [s.route for s in steps] == ["full", "patch"]
    gone = {t2.metas[6][0]}
    assert await plan(ChunkStore(t.root / "fresh2"), mid, m7, lambda x: fetch2(x) if x not in gone else none()) is None


async def none():
    return None


def chunk_total(m: w.Manifest, route: str) -> int:
    sizes = chunk_sizes(m)
    chunks = m.full_chunks() if route == "full" else m.patch_chunks()
    return sum(sizes[h] for h in chunks)


def test_bad_links_are_refused_never_applied(bf16_trainer):
    t = bf16_trainer()
    t.publish(0)
    m1 = t.publish(1, 1e-4)
    node = ChunkStore(t.root / "node")
    t.give(node, 0, "full")
    t.give(node, 1, "patch")
    node.assemble(t.metas[0][2])
    # a patch chunk damaged on disk: refused, dropped (so it is fetched again)
    h = m1.patch.chunks[0]
    node._chunk_path(h).write_bytes(b"rot" + t.pub.store.read(h)[3:])
    with pytest.raises(BadChunk):
        node.build_patched(m1, t.metas[0][2])
    assert h in node.missing(m1, "patch") and node.built(m1) is None
    node.put_verified({h: t.pub.store.read(h)})
    # the parent's bits damaged on disk: the rebuilt file fails its hashes and is not kept
    parent = node.versions_dir / "v0" / WEIGHTS_FILE
    data = bytearray(parent.read_bytes())
    data[-3] ^= 0x40
    parent.write_bytes(bytes(data))
    with pytest.raises(TensorMismatch):
        node.build_patched(m1, t.metas[0][2])
    assert node.built(m1) is None and not (node.versions_dir / "v1.tmp").exists()
    node.unbuild(0)  # what weight sync does on a mismatch: the parent is rebuilt from its chunks
    node.assemble(t.metas[0][2])
    out, changes = node.build_patched(m1, t.metas[0][2])
    assert weights_of(out) == t.refs[1].read_bytes() and changes.count() > 0
    # a chunk claiming to be a patch chunk but with other bytes never enters the store
    with pytest.raises(BadChunk):
        ChunkStore(t.root / "other").write(h, b"forged")


def test_gc_keeps_the_chain_to_the_anchor(bf16_trainer):
    t = bf16_trainer(anchor_every=5)
    for v in range(8):
        t.publish(v, 1e-4 if v else 0.0)
    # a follower keeps the model dirs of its newest versions only, and the chain it can re-serve
    node = ChunkStore(t.root / "node")
    t.give(node, 0, "full")
    for v in range(8):
        if v:
            t.give(node, v, "patch")
        node.assemble(t.metas[v][2])
    node.gc(keep=2)
    assert [v for v in range(8) if node.built(t.metas[v][2])] == [6, 7]
    assert [v for v in range(8) if node.manifest(t.metas[v][0])] == [5, 6, 7]
    assert not node.missing(t.metas[5][2], "full")  # rebuilt from a patch, served whole to newcomers
    trainer = t.pub.store
    trainer.gc(keep=2)
    # every version from the newest anchor (5) up is kept: a newcomer needs anchor 5 and patches 6, 7
    assert all(trainer.manifest(t.metas[v][0]) is not None for v in (5, 6, 7))
    assert all(trainer.manifest(t.metas[v][0]) is None for v in (0, 1, 2, 3, 4))
    assert not trainer.missing(t.metas[5][2], "full")


def test_a_restarted_publisher_patches_against_its_last_version_or_anchors(bf16_trainer):
    t = bf16_trainer()
    t.publish(0)
    t.publish(1, 1e-4)
    again = Publisher(t.pub.store, t.key, "t", chunk_size=CHUNK, patch_max_fraction=0.5)
    t.pub = again
    m2 = t.publish(2, 1e-4)
    assert m2.patch is not None and m2.patch.parent_id == t.metas[1][0] and not m2.has_full
    # the kept file of the last version damaged: the next version is an anchor, never a patch against wrong bits
    link = t.pub.links / "v2.safetensors"
    data = bytearray(link.read_bytes())
    data[-1] ^= 1
    link.unlink()
    link.write_bytes(bytes(data))
    t.pub = Publisher(t.pub.store, t.key, "t", chunk_size=CHUNK, patch_max_fraction=0.5)
    m3 = t.publish(3, 1e-4)
    assert m3.patch is None and m3.has_full


# -- engines --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["torch", "torch-bf16", "mlx8", "mlx4", "mlxnone", "mlx8-fp16", "mlx8-fp32"])
def test_engines_update_in_place_exactly_as_a_full_reload(bf16_trainer, engine):
    """Every engine and compute dtype (a bf16 version computed in fp16 or fp32 is cast on load and on update)."""
    from node.engines import install, make_engine

    t = bf16_trainer()
    t.publish(0)
    node = ChunkStore(t.root / "node")
    t.give(node, 0, "full")
    d0 = node.assemble(t.metas[0][2])
    name = "torch" if engine.startswith("torch") else "mlx"
    bits = 8 if engine.startswith("mlx8") else {"mlx4": 4}.get(engine)
    compute = engine.split("-")[1] if "-" in engine else "auto"
    live = make_engine(name, d0, bits=bits, version=0, compute=compute)
    assert compute == "auto" or live.compute == compute
    changes = None
    for v in (1, 2):
        m = t.publish(v, 2e-4)
        t.give(node, v, "patch")
        out, more = node.build_patched(m, t.metas[v - 1][2])
        assert more.base == v - 1 and more.count() > 0
        changes = more
        assert install(live, out, v, changes) == "updated"
    fresh = make_engine(name, out, bits=bits, version=2, compute=compute)
    if name == "torch":
        for (k, a), b in zip(live.model.state_dict().items(), fresh.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), k
    else:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        def params(engine) -> dict[str, tuple[str, np.ndarray]]:  # read on the engine's own MLX thread
            def read():
                flat = tree_flatten(engine.model.parameters())
                return {
                    k: (str(v.dtype), np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v)) for k, v in flat
                }

            return engine._thread.call(read)

        got, want = params(live), params(fresh)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k][0] == want[k][0] and np.array_equal(got[k][1], want[k][1]), k
    prompts = [[1, 5, 6, 7]] * 4
    a = live.generate(prompts, temperature=1.0, top_p=1.0, max_tokens=6, seed=3)
    b = fresh.generate(prompts, temperature=1.0, top_p=1.0, max_tokens=6, seed=3)
    assert a == b
    # changes that do not start at the running version: a full swap
    stale = more.__class__(0, 2, more.indices)
    assert install(live, out, 2, stale) == "swapped"


def test_learner_can_publish_bf16_while_computing_fp32(tmp_path, tiny_model_dir):
    from protocols.weights_file import read_layout
    from trainer.learner import Learner
    from trainer.settings import LearnerSettings

    ln = Learner(tiny_model_dir, LearnerSettings(dtype="fp32", publish_dtype="bf16"), 2, tmp_path)
    assert ln.precision.publish == torch.bfloat16 and ln.precision.scoring == torch.float32
    _, layout = read_layout(ln.scorer.path(0))
    assert {t.dtype for t in layout} == {"BF16"}
    lp = ln.logprobs(0, [[1, 5, 6]], [[7, 8, 2]], 1.0)
    assert lp is not None and all(np.isfinite(lp[0]))


# -- a swarm --------------------------------------------------------------------------------------------------
async def test_versions_travel_as_patches_through_a_swarm(tmp_path, tiny_model_dir):
    from node.host import open_swarm
    from node.identity import load_or_create_key
    from node.rpc import serve
    from tests.helpers import LOOPBACK, start_bootstrap, start_sampler, start_trainer, wait_until

    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery,
            tmp_path,
            boot,
            tiny_model_dir,
            weights={"chunk_size": CHUNK, "anchor_every": 3},
            batch_groups=1 << 30,
            publish_dtype="bf16",
        )
        samplers = [
            await start_sampler(nursery, tmp_path, "s0", boot, engine="mlx", bits="8"),
            await start_sampler(nursery, tmp_path, "s1", boot, engine="torch"),
        ]
        await wait_until(lambda: all(s.role.engine_ready.is_set() for s in samplers), timeout=60)
        learner = trainer.role.learner

        async def bump(version: int) -> None:
            nudge(learner.model, 3e-5, version)
            learner.new_version()
            await trainer.role.publish()
            await wait_until(lambda: all(s.role.versions.engine == version for s in samplers), 30, what=f"v{version}")

        full = trainer.role.store.latest()[2].total_size
        for version in (1, 2):
            before = trainer.role.weight_server.bytes_served
            await bump(version)
            m = trainer.role.store.latest()[2]
            assert m.patch is not None and not m.has_full and m.update_size < 0.5 * full
            assert trainer.role.weight_server.bytes_served - before < 0.5 * full
        assert trainer.role.weight_server.bytes_pushed > 0  # the trainer pushes a small version's first copies
        # a hostile peer that forges every manifest it is asked for; a sampler asking it for a link refuses it
        evil_key = load_or_create_key(tmp_path / "evil.key")
        evil = await stack.enter_async_context(open_swarm(evil_key, LOOPBACK))
        m2 = trainer.role.store.latest()[2]

        async def forge(message, remote):
            forged = w.Manifest(m2.swarm, 1, 0, m2.encoding, m2.chunk_size, m2.files, m2.tensors, m2.patch)
            return sign_manifest(forged, KeyPair(evil_key.private_key, evil_key.public_key)).to_wire()

        evil.host.set_stream_handler(w.PROTOCOL_ID, serve("evil", forge, 1 << 16, w.MAX_REPLY_FRAME))
        await evil.connect(info_from_p2p_addr(samplers[1].swarm.addrs()[0]))
        sync = samplers[1].role.weights
        parent_id = m2.patch.parent_id
        sync.store._manifests.pop(parent_id, None)
        got = await sync.fetch_manifest(parent_id, [evil.peer_id, trainer.swarm.peer_id])
        assert got is not None and manifest_id(got[0]) == parent_id
        assert sync.forged_manifests >= 1 and sync.strikes.counts.get(str(evil.peer_id), 0) >= 1
        # version 3 is an anchor (carrying its patch): followers still fetch only the patch
        await bump(3)
        m3 = trainer.role.store.latest()[2]
        assert m3.has_full and m3.patch is not None
        for s in samplers:
            assert s.role.weights.routes["full"] == 1 and s.role.weights.routes["patch"] == 3  # v0 came whole
            assert not s.role.store.missing(m3, "full")  # rebuilt, then kept whole for newcomers
        # a newcomer after a patch-only version 4: the anchor's full route (from anyone), then the patch
        await bump(4)
        late = await start_sampler(nursery, tmp_path, "s2", boot, engine="torch")
        await wait_until(lambda: late.role.versions.engine == 4, 60, what="the newcomer at version 4")
        assert late.role.weights.last_plan[0][:2] == (3, "full") and late.role.weights.last_plan[1][:2] == (4, "patch")
        samplers.append(late)
        # every reassembled dir is byte-identical to the trainer's version file, and opens in stock loaders
        from mlx_lm.utils import load_model as mlx_load
        from transformers import AutoModelForCausalLM

        from trainer.model import LOAD_LOCK

        for s in samplers:
            for v in (3, 4) if s is late else (2, 3, 4):
                out = s.role.store.versions_dir / f"v{v}"
                if not (out / ".complete").exists():
                    continue  # garbage-collected (keep_versions)
                assert weights_of(out) == learner.scorer.path(v).read_bytes(), (s.config.data_dir, v)
        out = samplers[0].role.store.versions_dir / "v4"
        with LOAD_LOCK:  # the samplers' engines may be loading in threads of this process
            AutoModelForCausalLM.from_pretrained(out)
        mlx_load(out)
        # in-place updates left each engine exactly where a fresh engine on version 4 would be
        from node.engines import make_engine

        prompts = [[1, 5, 6, 7]] * 4
        for s, (name, bits) in zip(samplers[:2], [("mlx", 8), ("torch", None)], strict=True):
            fresh = make_engine(name, s.role.store.versions_dir / "v4", bits=bits, version=4)
            kw = dict(temperature=1.0, top_p=1.0, max_tokens=6, seed=11)
            assert s.role.engine.generate(prompts, **kw) == fresh.generate(prompts, **kw)
        nursery.cancel_scope.cancel()


def test_dense_changes_stop_the_diff_early_and_back_off(bf16_trainer):
    """fp32-like dense changes (every weight moves past bf16's rounding): the diff stops at the size budget and the
    publisher retries only after 1, 2, 4, ... versions, so a trainer whose patches never pay stops paying for them."""
    t = bf16_trainer(anchor_every=8, fraction=0.2)
    t.publish(0)
    tried = []
    for v in range(1, 9):
        m = t.publish(v, step=0.05)  # far above bf16's step: nearly every element changes
        stats = t.pub.last_stats
        assert m.patch is None and m.has_full  # an anchor, without a patch
        tried.append(stats.patch_seconds > 0)
    assert tried == [True, True, False, True, False, False, False, True]
    # the backoff is capped at anchor_every (8): version 16 tries again; small changes patch, and patches resume
    assert t.publish(12, step=1e-5).patch is None and t.pub.last_stats.patch_seconds == 0
    m = t.publish(16, step=1e-5)
    assert t.pub.last_stats.patch_seconds > 0 and m.patch is not None and m.patch.parent_id == t.metas[12][0]
    assert t.publish(17, step=1e-5).patch is not None


def test_a_dense_diff_is_given_up_after_a_tenth_of_the_weights(tmp_path):
    """The patch of the first tenth, extrapolated, is far over budget: no need to diff (and compress) the rest."""
    from safetensors.numpy import save_file

    from node.weights.patch import OverBudget, build_patch

    rng = np.random.default_rng(0)
    old = {f"t{i:02d}": rng.standard_normal(20_000).astype(np.float32) for i in range(40)}
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in old.items()}  # all change, at random
    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    full = (tmp_path / "new.safetensors").stat().st_size
    with pytest.raises(OverBudget, match=r"for 1\d% of the weights: ~\d+ in all"):
        build_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", budget=full // 3)
    # a budget the patch fits is not refused by the projection
    assert build_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", budget=2 * full) is not None


def test_varint_encoders_held_to_blocks_write_the_same_bytes_as_one_pass():
    """The trainer encodes a block of values at a time (its temporaries sit beside training): the bytes must be
    those of one pass, and decode back."""
    from node.weights.patch import LEB128_BLOCK, _leb128_block, encode_values

    rng = np.random.default_rng(0)
    n = 2 * LEB128_BLOCK + 12345
    v = rng.integers(0, 1 << 40, n, dtype=np.uint64) >> rng.integers(0, 40, n).astype(np.uint64)
    assert leb128_encode(v) == _leb128_block(v)
    assert np.array_equal(leb128_decode(leb128_encode(v), n), v)
    d = rng.integers(-(1 << 31), 1 << 31, n, dtype=np.int64)
    assert encode_values(d) == _leb128_block(zigzag(d))
    assert np.array_equal(unzigzag(leb128_decode(encode_values(d), n)), d)


def patch_round_trip(tmp_path: Path, old: dict, new: dict, **kw):
    """Build the patch old -> new (safetensors files), apply it to old, check the rebuilt file is new's bytes."""
    from dataclasses import replace

    from safetensors.numpy import save_file

    from node.weights.patch import apply_patch
    from protocols.weights_file import read_layout

    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    built = build_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", **kw)
    assert built is not None
    _, layout = read_layout(tmp_path / "new.safetensors")
    tensors = [replace(t, hash=h) for t, h in zip(layout, built.hashes, strict=True)]
    patch = w.PatchInfo(
        b"\0" * 32, 0, "zlib", built.size, [b"\1" * 32], built.weights_size, built.header_hash, built.deltas
    )
    m = w.Manifest("t", 1, 0, "native", 1 << 20, [], tensors, patch)
    (tmp_path / "out.safetensors").unlink(missing_ok=True)
    apply_patch(tmp_path / "old.safetensors", tmp_path / "out.safetensors", m, built.blob)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "new.safetensors").read_bytes()
    return built


def test_the_index_stream_is_gaps_or_a_bitmap_whichever_is_shorter(tmp_path):
    rng = np.random.default_rng(0)
    numel = 10_003  # not a whole number of bitmap bytes
    old = {f"t{i}": rng.standard_normal(numel).astype(np.float32) for i in range(3)}
    new = {k: v.copy() for k, v in old.items()}
    densities = (0.001, 0.05, 0.6)
    for v, density in zip(new.values(), densities, strict=True):
        v[rng.random(numel) < density] += 1.0
    built = patch_round_trip(tmp_path, old, new)
    assert [d.index_mode for d in built.deltas] == [INDEX_GAPS, INDEX_GAPS, INDEX_BITMAP]
    for d, (name, v) in zip(built.deltas, new.items(), strict=True):
        assert d.changed == int(np.count_nonzero(v != old[name]))


def test_a_patch_is_built_a_block_at_a_time_with_the_same_result(tmp_path, monkeypatch):
    """The trainer diffs each tensor a block of elements at a time (it runs beside training): gaps run across block
    boundaries, each block's bitmap bytes join into the tensor's, and the patch decodes to the same changes as one
    built with blocks larger than any tensor."""
    from node.weights import patch as patch_mod

    rng = np.random.default_rng(3)
    old = {
        "dense": rng.standard_normal(1003).astype(np.float32),
        "sparse": rng.standard_normal(5000).astype(np.float16),
    }
    new = {k: v.copy() for k, v in old.items()}
    new["dense"][rng.random(1003) < 0.7] *= 2
    hits = [0, 63, 64, 65, 127, 128, 2000, 4999]  # block edges (BLOCK = 64 below), the first and last elements
    new["sparse"][hits] += np.float16(1)
    one_block = patch_round_trip(tmp_path, old, new)
    monkeypatch.setattr(patch_mod, "BLOCK", 64)
    blocks = patch_round_trip(tmp_path, old, new)
    assert [d.index_mode for d in blocks.deltas] == [INDEX_BITMAP, INDEX_GAPS]
    assert blocks.deltas == one_block.deltas and blocks.blob == one_block.blob and blocks.hashes == one_block.hashes
    monkeypatch.setattr(patch_mod, "BLOCK", 60)
    with pytest.raises(ValueError, match="multiple of 8"):
        build_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors")


def test_building_a_patch_holds_a_few_blocks_in_memory_not_the_patch(tmp_path, monkeypatch):
    """A dense patch of a 16 MB tensor: the builder's heap stays a few blocks' worth (the patch itself waits in a
    temporary file); the old builder held the whole tensor's positions and values: 136 MB for this 9.7 MB patch."""
    import tracemalloc

    from safetensors.numpy import save_file

    from node.weights import patch as patch_mod

    monkeypatch.setattr(patch_mod, "BLOCK", 1 << 16)
    rng = np.random.default_rng(0)
    old = rng.standard_normal(4_000_000).astype(np.float32)
    new = old + rng.standard_normal(old.size).astype(np.float32) * 1e-3
    save_file({"w": old}, str(tmp_path / "old.safetensors"))
    save_file({"w": new}, str(tmp_path / "new.safetensors"))
    del old, new
    tracemalloc.start()
    try:
        built = build_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built is not None and built.changed > 3_900_000 and built.size > 8_000_000
    assert peak < 8_000_000, f"building held {peak / 1e6:.1f} MB for a {built.size / 1e6:.1f} MB patch"
    # over budget within one tensor's stream: stopped there, not after compressing the whole tensor
    with pytest.raises(patch_mod.OverBudget, match="within a stream"):
        build_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", budget=1 << 20)


def test_a_built_patch_is_cut_into_chunks_from_its_file():
    """Publishing cuts the patch blob into chunk ranges read from its temporary file: each piece is that slice."""
    from node.weights.manifest import cut_ranges
    from node.weights.patch import BuiltPatch

    rng = np.random.default_rng(1)
    import io

    blob = rng.bytes(100_000)
    built = BuiltPatch(io.BytesIO(blob), len(blob), [], b"", 0, [], 0, 0)
    assert built.blob == blob
    for chunk in (1, 7, 4096, 100_000):
        ranges = cut_ranges(built.size, [], chunk)
        assert list(built.pieces(ranges)) == [blob[a:b] for a, b in ranges]
