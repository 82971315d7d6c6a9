"""Versions in the sampler's own encoding (issue 27): the rules of who gets which encoding, the wire fields, the store
keeping each encoding's chain, an MLX int8 engine loading an int8-grid version as it is, and a swarm where a trainer
publishes bf16 and int8-grid chains side by side to a torch sampler and an MLX int8 sampler."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.engines import GRID_ENCODINGS, weights_encoding
from node.weights.encodings import encodings_to_publish, news_floor, offered_encodings, push_encoding, takes
from node.weights.grid import GRID_BITS, GRID_ENCODING, encode_grid_file, file_grid_bits, mlx_tensors
from node.weights.hashes import manifest_id
from node.weights.manifest import WEIGHTS_FILE
from node.weights.publish import Publisher
from node.weights.store import ChunkStore
from protocols import weights as w
from protocols.errors import SchemaError
from protocols.framing import unpack
from trainer.model import load_model, save_model_dir

CHUNK = 4096


def wire(message: dict) -> dict:
    return unpack(msgpack.packb(message, use_bin_type=True), 1 << 16)


# -- rules ----------------------------------------------------------------------------------------------------------
def test_the_trainer_publishes_what_connected_unbanned_samplers_declared_and_nothing_more():
    declared = {"a": "int8-grid", "b": "native", "gone": "int8-grid", "evil": "int8-grid"}
    assert encodings_to_publish(declared, {"a", "b", "evil"}, lambda p: p == "evil") == ["int8-grid"]
    assert encodings_to_publish(declared, {"b", "evil"}, lambda p: p == "evil") == []  # banned and gone: none
    assert encodings_to_publish({"x": "int4", "y": "native"}, {"x", "y"}, lambda p: False) == []  # unknown: never
    assert push_encoding(None) == "native" and push_encoding("int8-grid") == "int8-grid"
    # int4-grid only where the trainer trains on q4 rollouts (by default it does not: none,q8)
    both = {"a": "int4-grid", "b": "int8-grid"}
    assert offered_encodings(("none", "q8")) == ("native", "int8-grid")
    assert offered_encodings(("none", "q8", "q4")) == ("native", "int8-grid", "int4-grid")
    assert offered_encodings(("none",)) == ("native",)
    assert encodings_to_publish(both, {"a", "b"}, lambda p: False, offered_encodings(("none", "q8"))) == ["int8-grid"]
    assert encodings_to_publish(both, {"a", "b"}, lambda p: False) == ["int8-grid", "int4-grid"]


def test_a_sampler_takes_its_own_encoding_and_the_default_only_until_its_own_came():
    assert takes("int8-grid", "int8-grid", has_own=False) and takes("int8-grid", "int8-grid", has_own=True)
    assert takes("native", "int8-grid", has_own=False) and not takes("native", "int8-grid", has_own=True)
    assert not takes("int8-grid", "native", has_own=False)  # a torch sampler never takes codes
    assert takes("native", "native", True) and takes("int8", "native", True)  # the trainer's primary, whatever it is
    # a node on the default chain moves to its own at the same version; otherwise only newer versions are news
    assert (
        news_floor((4, "native"), "int8-grid", "int8-grid") == 3
        and news_floor((4, "native"), "native", "int8-grid") == 4
    )
    assert news_floor((4, "int8-grid"), "int8-grid", "int8-grid") == 4 and news_floor(None, "native", "native") is None
    assert news_floor((4, "native"), "native", "native") == 4
    assert weights_encoding("mlx", "8", "auto") == "int8-grid" and weights_encoding("mlx", "8", "fp32") == "int8-grid"
    assert weights_encoding("mlx", "8", "fp16") == "native" and weights_encoding("mlx", "4") == "int4-grid"
    assert weights_encoding("mlx", "4", "fp16") == "native" and weights_encoding("mlx", "none") == "native"
    assert {int(b): e for b, e in GRID_ENCODINGS.items()} == {b: e for e, b in GRID_BITS.items()}  # one fact, two ends
    assert weights_encoding("torch", "none") == "native" and weights_encoding("auto", "8", platform="linux") == "native"


def test_the_encoding_fields_are_optional_bounded_and_known():
    assert w.parse_encoding(wire(w.get_manifest(None, "int8-grid"))) == "int8-grid"
    assert w.parse_encoding(wire(w.get_manifest(None))) is None
    assert w.parse_request(wire(w.get_manifest(None, "int8-grid"))) == ("get_manifest", None)  # old servers: newest
    assert w.parse_encoding(wire(w.get_manifest(None, "int4-grid"))) == "int4-grid"
    for bad in ("int4", "x" * 100, 7):
        with pytest.raises(SchemaError):
            w.parse_encoding({**w.get_manifest(None), "encoding": bad})
    m = wire(w.announce(3, b"\1" * 32, "int8"))
    assert w.parse_announce(m) == (3, b"\1" * 32) and w.parse_encoding(m, w.ENCODINGS) == "int8"
    with pytest.raises(SchemaError):
        w.parse_encoding(m)  # a sampler may not ask for int8 rowwise: the trainer picks that one for everybody


def test_a_poll_for_the_newest_may_name_the_manifest_it_holds():
    have = b"\2" * 32
    m = wire(w.get_manifest(None, "int8-grid", have))
    assert w.parse_have_id(m) == have and w.parse_request(m) == ("get_manifest", None)  # old servers: the manifest
    assert w.parse_have_id(wire(w.get_manifest(None))) is None
    assert "have" not in w.get_manifest(b"\1" * 32, have=have)  # a manifest asked for by id is that one, always
    for bad in (b"\2" * 31, "x" * 32, 5):
        with pytest.raises(SchemaError):
            w.parse_have_id({**w.get_manifest(None), "have": bad})
    assert w.is_same(wire(w.same_reply())) and not w.is_same(wire(w.get_manifest(None)))


# -- the trainer's store: two chains side by side -----------------------------------------------------------------
def nudge(model, step: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).sign() * step)


def publish_both(root: Path, model_dir: Path, versions: int) -> tuple[ChunkStore, Publisher, Publisher, list]:
    """bf16 and int8-grid publishers sharing one store, as the trainer runs them; every version in both."""
    store, key = ChunkStore(root / "trainer"), create_new_key_pair()
    kw = dict(chunk_size=CHUNK, anchor_every=4, patch_max_fraction=0.5)
    native = Publisher(store, key, "t", **kw)
    grid = Publisher(store, key, "t", encoding=GRID_ENCODING, tag=GRID_ENCODING, **kw)
    model, out = load_model(model_dir), []
    for v in range(versions):
        if v:
            nudge(model, 3e-5, v)
        staging = save_model_dir(model, native.staging_dir(v), model_dir, torch.bfloat16)
        shutil.copytree(staging, grid.staging_dir(v))
        out.append((native.publish(staging, v), grid.publish(grid.staging_dir(v), v)))
    return store, native, grid, out


def test_two_encodings_keep_two_chains_in_one_store(tmp_path, tiny_model_dir):
    store, native, grid, out = publish_both(tmp_path, tiny_model_dir, 6)
    (n5, _, m5), (g5, _, gm5) = out[5]
    assert m5.encoding == "native" and gm5.encoding == GRID_ENCODING
    assert gm5.patch is not None and gm5.patch.parent_id == out[4][1][0]  # the grid chain links grid versions
    assert gm5.update_size < 0.1 * gm5.total_size and gm5.total_size < 0.6 * m5.total_size
    assert store.latest()[0] == n5 and store.latest(GRID_ENCODING)[0] == g5  # unnamed: the one every engine runs
    assert native.links != grid.links and (grid.links / "v5.safetensors").exists()
    store.gc(2)
    for enc, mid in (("native", n5), (GRID_ENCODING, g5)):
        chain = store.chain_to_anchor(mid)
        assert chain and store.manifest(chain[-1])[1].has_full, enc  # each chain back to its anchor survives gc
    # a restarted grid publisher finds its own parent (not the bf16 one) and patches against it
    again = Publisher(store, native.key_pair, "t", CHUNK, GRID_ENCODING, 4, 0.5, tag=GRID_ENCODING)
    assert again.parent() is not None and again.parent().mid == g5


def test_a_model_dir_built_in_one_encoding_is_not_built_in_another(tmp_path, tiny_model_dir):
    trainer_store, _native, _grid, out = publish_both(tmp_path, tiny_model_dir, 1)
    (_, signed, m0), (_, _gsigned, g0) = out[0]
    store = ChunkStore(tmp_path / "sampler")
    store.add_manifest(signed, m0)
    store.put_verified({h: trainer_store.read(h) for h in m0.all_chunks()})
    assert store.assemble(m0) is not None and store.built(m0) is not None
    assert store.built(g0) is None  # version 0 built as bf16: the grid one is not there


# -- the MLX engine -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_an_mlx_engine_runs_a_grid_version_of_its_width_as_it_is(tmp_path, tiny_model_dir, bits):
    """An MLX int8 (int4) engine and an int8-grid (int4-grid) version: built from a grid dir, hot-swapped to another,
    updated by the tensors a patch changed: every parameter is the file's bytes, and it generates as the same grid
    loaded into a fresh engine. An engine of another width refuses the version clearly."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from node.engines import make_engine
    from node.weights.patch import WeightChanges

    model = load_model(tiny_model_dir)
    dirs = []
    for v in range(2):
        if v:
            nudge(model, 3e-3, v)
        d = save_model_dir(model, tmp_path / f"bf16-{v}", tiny_model_dir, torch.bfloat16)
        g = tmp_path / f"grid-{v}"
        shutil.copytree(d, g)
        encode_grid_file(d / WEIGHTS_FILE, g / WEIGHTS_FILE, dirs[-1] / WEIGHTS_FILE if dirs else None, bits=bits)
        dirs.append(g)

    def same_as_file(engine, grid_dir: Path) -> None:
        params = dict(tree_flatten(engine._thread.call(lambda: engine.model.parameters())))
        file = {n: a for n, _d, a in mlx_tensors(grid_dir / WEIGHTS_FILE)}
        assert params.keys() == file.keys()
        for name, x in params.items():
            got = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
            assert np.array_equal(got, file[name]), name

    engine = make_engine("mlx", dirs[0], bits=bits, version=0)
    assert engine.quant == f"q{bits}" and engine.compute == "bf16"
    same_as_file(engine, dirs[0])
    engine.swap(dirs[1], 1)
    same_as_file(engine, dirs[1])
    engine.swap(dirs[0], 0)
    changed = {n: np.arange(1) for n in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.scales")}
    engine.update(dirs[1], 1, WeightChanges(0, 1, changed))
    params = dict(tree_flatten(engine._thread.call(lambda: engine.model.parameters())))
    file = {n: a for n, _d, a in mlx_tensors(dirs[1] / WEIGHTS_FILE)}
    assert np.array_equal(np.array(params["model.layers.0.mlp.up_proj.weight"]), file[next(iter(changed))])
    engine.update(dirs[1], 1, WeightChanges(0, 1, {n: np.arange(1) for n in file}))
    same_as_file(engine, dirs[1])
    fresh = make_engine("mlx", dirs[1], bits=bits, version=1)
    kw = dict(temperature=1.0, top_p=1.0, max_tokens=6, seed=3)
    assert engine.generate([[1, 5, 6, 7]] * 4, **kw) == fresh.generate([[1, 5, 6, 7]] * 4, **kw)
    for other in (None, 12 - bits):
        with pytest.raises(Exception, match=f"int{bits}-grid version: it runs on {bits}-bit weights"):
            make_engine("mlx", dirs[0], bits=other)


# -- a swarm ------------------------------------------------------------------------------------------------------
async def test_a_trainer_publishes_bf16_and_grid_chains_to_the_samplers_that_run_them(tmp_path, tiny_model_dir):
    """A trainer that trains on q4 rollouts too, a torch sampler, an MLX int8 sampler that runs int8-grid and an MLX
    int4 one that runs int4-grid: each grid sampler starts on bf16 version 0 (the trainer has not heard it yet),
    then follows its grid chain (an anchor, then patches of codes); its engine holds the trainer's grid file bit for
    bit; every sampler's groups are accepted, nobody is struck."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from node.engines import engine_factory
    from node.roles.sampler import SamplerRole
    from tests.helpers import (
        Running,
        node_config,
        settings,
        start,
        start_bootstrap,
        start_sampler,
        start_trainer,
        trainer_peer_id,
        wait_until,
    )

    async with trio.open_nursery() as nursery:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery,
            tmp_path,
            boot,
            tiny_model_dir,
            weights={"chunk_size": CHUNK, "anchor_every": 10},
            batch_groups=1 << 30,
            publish_dtype="bf16",
            accept_quant="none,q8,q4",
        )

        async def mlx_sampler(name: str, bits: str) -> Running:
            cfg = node_config(
                tmp_path, name, "sampler", bootstrap=(boot.swarm.addrs()[0],), trainer_id=trainer_peer_id(tmp_path)
            )
            role = SamplerRole(cfg, settings(), engine_factory("mlx", bits), encoding=f"int{bits}-grid")
            return await start(nursery, cfg, role)

        mac, mac4 = await mlx_sampler("mac", "8"), await mlx_sampler("mac4", "4")
        linux = await start_sampler(nursery, tmp_path, "linux", boot, engine="torch")
        samplers = [mac, mac4, linux]
        await wait_until(lambda: all(s.role.engine_ready.is_set() for s in samplers), 60, what="engines")
        learner = trainer.role.learner
        grids = [GRID_ENCODING, "int4-grid"]
        await wait_until(lambda: trainer.role.demand.wanted() == grids, 30, what="the grids declared")
        for version in (1, 2, 3):
            nudge(learner.model, 3e-5, version)
            learner.new_version()
            await trainer.role.publish()
            await wait_until(
                lambda v=version: all(s.role.versions.engine == v for s in samplers), 60, what=f"v{version}"
            )
        store = trainer.role.store
        assert store.latest()[2].encoding == "native"  # what a sampler naming nothing gets
        for node, encoding in ((mac, GRID_ENCODING), (mac4, "int4-grid")):
            grid = [m for _, m in store.manifests() if m.encoding == encoding]
            assert sorted(m.version for m in grid) == [1, 2, 3] and grid[0].patch is not None  # v3, a patch of v2
            routes = node.role.weights.routes
            assert routes["patch"] >= 2 and node.role.weights.current == 3 and node.role.weights.has_own
            # the MLX engine holds the trainer's published grid file bit for bit
            published = trainer.role.outbox.extras[encoding].publisher.links / "v3.safetensors"
            assert (node.role.store.versions_dir / "v3" / WEIGHTS_FILE).read_bytes() == published.read_bytes()
            engine = node.role.engine
            params = dict(tree_flatten(engine._thread.call(lambda e=engine: e.model.parameters())))
            for name, _dtype, values in mlx_tensors(published):
                x = params[name]
                assert np.array_equal(np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x), values), name
        assert file_grid_bits(published) == 4 and engine.quant == "q4"
        assert linux.role.store.manifests()[0][1].encoding == "native"
        assert not any(m.encoding in grids for _, m in linux.role.store.manifests())
        before = [(s, s.role.rollouts_accepted) for s in (mac, mac4)]  # groups of the grid versions from now on
        await wait_until(
            lambda: all(s.role.rollouts_accepted > n for s, n in before) and linux.role.rollouts_accepted > 0,
            60,
            what="groups accepted from all three samplers",
        )
        assert all(s.role.strikes == 0 for s in samplers) and trainer.role.intake.status()["banned"] == 0

        # polls for the newest are conditional: a node that names the newest (in its encoding) gets ``same``, not the
        # manifest again; one that names an older one, or none, gets the manifest
        tid, newest_native, newest_grid = trainer.swarm.peer_id, store.latest()[0], store.latest(GRID_ENCODING)[0]
        older_grid = next(mid for mid, m in store.manifests() if m.encoding == GRID_ENCODING and m.version == 2)
        ask = linux.role.weights.client.manifest
        assert await ask(tid, None, 10, have=newest_native) is None
        assert await ask(tid, None, 10, GRID_ENCODING, have=newest_grid) is None
        assert manifest_id(await ask(tid, None, 10, GRID_ENCODING, have=older_grid)) == newest_grid
        assert manifest_id(await ask(tid, None, 10, have=newest_grid)) == newest_native  # not the newest native one
        assert manifest_id(await ask(tid, None, 10)) == newest_native
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--engine", "mlx"], "native"),  # the default: the version as published
        (["--engine", "mlx", "--receive-encoding", "auto"], "int8-grid"),  # a Mac's MLX 8-bit engine
        (["--engine", "mlx", "--bits", "8", "--receive-encoding", "int8-grid"], "int8-grid"),
        (["--engine", "mlx", "--bits", "4", "--receive-encoding", "auto"], "int4-grid"),  # an MLX 4-bit engine
        (["--engine", "mlx", "--bits", "8", "--receive-encoding", "int4-grid"], "error4"),
        (["--engine", "mlx", "--compute", "fp16", "--receive-encoding", "auto"], "native"),  # fp16: no bf16 scale
        (["--engine", "torch", "--bits", "none", "--receive-encoding", "auto"], "native"),
        (["--engine", "torch", "--bits", "none", "--receive-encoding", "int8-grid"], "error"),
    ],
)
def test_the_sampler_command_downloads_the_encoding_its_engine_runs(tmp_path, flags, expected):
    """`swarmrl node --role sampler --receive-encoding auto`: an MLX 8-bit (4-bit) sampler receives int8-grid
    (int4-grid) versions, any other native; asking a torch sampler for int8-grid, or an 8-bit one for int4-grid, is a
    clear error, not a silent bf16 run."""
    import argparse

    from node.cli import add_node_args, build_config, build_role, load_settings
    from node.errors import UserError

    trainer = str(peer_id_of_key(tmp_path / "t.key"))
    p = argparse.ArgumentParser()
    add_node_args(p)
    args = p.parse_args(["--role", "sampler", "--trainer", trainer, "--data-dir", str(tmp_path / "d"), *flags])
    if expected.startswith("error"):
        bits = expected[-1] if expected[-1].isdigit() else "8"
        with pytest.raises(UserError, match=f"int{bits}-grid runs only on an MLX engine with {bits}-bit weights"):
            build_role(build_config(args), load_settings(args))
        return
    assert build_role(build_config(args), load_settings(args)).encoding == expected


def peer_id_of_key(path: Path):
    from node.identity import load_or_create_key, peer_id_of

    return peer_id_of(load_or_create_key(path))
