"""Provider records for swarmrl roles live on js-libp2p DHT nodes too (issue 14: DHT keys as CIDs).

A js-libp2p node (tests/js/dht_node.mjs: TCP, Noise, Yamux, identify, ping, kad-dht server on /ipfs/kad/1.0.0)
is the only peer of each Python node. One Python node provides the trainer role; the js node must hold the record
in its own provider store; a second Python node, connected to the js node alone, must find the provider.
The js packages (exact versions in tests/js/package-lock.json) are installed into tests/js/node_modules by
tests/provision.sh (part of the README's test command); the tests skip, saying why, where they are not.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import select
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.discovery import find_role, provide_forever, role_cid, role_key
from node.host import Swarm, open_swarm
from node.identity import load_or_create_key
from tests.helpers import slowdown, wait_until

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")  # as node.local_swarm (not imported: it loads the engines)

JS_DIR = Path(__file__).parent / "js"
NODE_MODULES = JS_DIR / "node_modules"
MARKER = NODE_MODULES / ".swarmrl-installed"  # sha256 of package.json + package-lock.json, by tests/provision.sh


@pytest.fixture(scope="module")
def node_exe() -> str:
    """Path of `node`, where tests/provision.sh installed the pinned packages (the README's test command runs it;
    found here, never installed); skips saying what is missing."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("js-libp2p interop needs node on PATH (and tests/provision.sh run with npm)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < 20:
        pytest.skip(f"js-libp2p 3.x needs Node.js >= 20, found {version}")
    wanted = hashlib.sha256((JS_DIR / "package.json").read_bytes() + (JS_DIR / "package-lock.json").read_bytes())
    if not (MARKER.exists() and MARKER.read_text() == wanted.hexdigest()):
        pytest.skip(
            f"the pinned js-libp2p packages are not installed in {NODE_MODULES} (tests/provision.sh runs npm ci;"
            " see runs/provision-npm-ci.log if it failed)"
        )
    return node


class JsNode:
    """The js-libp2p DHT node process: one JSON line per command (see tests/js/dht_node.mjs)."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log
        hello = self._read(timeout=30)
        self.peer_id: str = hello["peer_id"]
        self.addrs: list[str] = hello["addrs"]

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            what = "exited" if self.proc.poll() is not None else f"did not answer within {timeout:.0f} s"
            raise AssertionError(f"js node {what}; its log:\n{self.log.read_text()[-3000:]}")
        reply = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply

    async def ask(self, command: str, timeout: float = 10.0) -> dict:
        def go() -> dict:
            self.proc.stdin.write(command.encode() + b"\n")
            self.proc.stdin.flush()
            return self._read(timeout)

        return await trio.to_thread.run_sync(go)

    async def providers(self, cid: str) -> dict[str, list[str]]:
        """Providers of ``cid`` in the js node's own provider store: peer id -> addresses it holds."""
        return {p["peer_id"]: p["addrs"] for p in (await self.ask(f"providers {cid}"))["providers"]}


@pytest.fixture
def js_node(node_exe: str, tmp_path: Path) -> Iterator[JsNode]:
    log = tmp_path / "js_node.log"
    env = {**os.environ, "DEBUG": "*:error"}  # js-libp2p logs errors to stderr (the log file)
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [node_exe, str(JS_DIR / "dht_node.mjs")],
            cwd=JS_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            bufsize=0,
            env=env,
        )
    try:
        yield JsNode(proc, log)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _run_swarm(root: Path, name: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A swarmrl host + DHT on loopback that feeds its routing table like a node does; runs until cancelled."""
    async with open_swarm(load_or_create_key(root / name / "identity.key"), LOOPBACK) as swarm:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(swarm.feed_routing_table, 0.2)
            task_status.started(swarm)
            await trio.sleep_forever()


def _bare(addrs) -> set[str]:
    """Addresses as text without their /p2p/<id> part (js-libp2p keeps them bare, py-libp2p may not)."""
    return {str(a).split("/p2p/")[0] for a in addrs}


async def _join(swarm: Swarm, js: JsNode) -> None:
    await swarm.connect(info_from_p2p_addr(multiaddr.Multiaddr(js.addrs[0])))
    # the js node enters the routing table once identify told us it speaks /ipfs/kad/1.0.0
    await wait_until(lambda: swarm.dht.get_routing_table_size() >= 1, 10, 0.1, what="the js node in the routing table")


def test_role_cid_is_cidv1_raw_sha256_of_role_key() -> None:
    """Checked against py-libp2p's own CID helpers and a fixed vector (no js needed)."""
    from libp2p.bitswap.cid import CODEC_RAW, cid_to_text, compute_cid_v1
    from libp2p.kad_dht.kad_dht import _encode_key

    key = role_key("test", "trainer")
    assert key == "/swarmrl/test/trainer"
    assert role_cid("test", "trainer") == "bafkreigc2gtfxkff24ufrfysbpkazzp2wev7d5fryk4flvi3tv3g2uloey"
    for swarm, role in [("test", "trainer"), ("interop", "sampler"), ("x" * 300, "trainer"), ("åß", "s")]:
        cid = role_cid(swarm, role)
        assert cid == cid_to_text(compute_cid_v1(role_key(swarm, role).encode(), CODEC_RAW))
        # what goes on the wire: the sha2-256 multihash, not the UTF-8 of the role key
        assert _encode_key(cid) == b"\x12\x20" + hashlib.sha256(role_key(swarm, role).encode()).digest()


async def test_js_dht_node_stores_and_serves_role_provider_record(tmp_path: Path, js_node: JsNode) -> None:
    key, cid = role_key("interop", "trainer"), role_cid("interop", "trainer")
    # an independent implementation (js multiformats) computes the same CID for the role key
    assert (await js_node.ask(f"cid {key}"))["cid"] == cid

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as provider_nursery:
            a = await provider_nursery.start(_run_swarm, tmp_path, "a")
            await _join(a, js_node)
            provider_nursery.start_soon(provide_forever, a, key, 1.0)
            held: dict[str, list[str]] = {}
            with trio.move_on_after(20 * slowdown()):
                while str(a.peer_id) not in held:
                    await trio.sleep(0.2)
                    held = await js_node.providers(cid)
            assert str(a.peer_id) in held, f"js node holds no record of {a.peer_id} for {cid}: {held}"
            assert _bare(a.addrs()) & _bare(held[str(a.peer_id)]), held
            # the js node stores it under the multihash, as the libp2p DHT keys provider records
            multihash = base64.b32decode(cid[1:].upper() + "=" * (-len(cid[1:]) % 8))[2:]
            records = (await js_node.ask("records"))["records"]
            assert {(r["multihash"], r["peer"]) for r in records} == {
                (base64.b32encode(multihash).decode().lower().rstrip("="), str(a.peer_id))
            }, records
            a_id, a_addrs = a.peer_id, _bare(a.addrs())
            provider_nursery.cancel_scope.cancel()  # the provider leaves: the record now lives on the js node only

        b = await nursery.start(_run_swarm, tmp_path, "b")
        await _join(b, js_node)
        assert set(b.host.get_connected_peers()) == {info_from_p2p_addr(multiaddr.Multiaddr(js_node.addrs[0])).peer_id}
        found = []
        with trio.move_on_after(20 * slowdown()):
            while not found:
                found = await find_role(b, key, timeout=5)
        assert [info.peer_id for info in found] == [a_id], found
        assert a_addrs & _bare(found[0].addrs), found[0].addrs
        assert not (await js_node.ask("rejected"))["rejected"]
        nursery.cancel_scope.cancel()


async def test_js_dht_node_refuses_raw_string_key(tmp_path: Path, js_node: JsNode) -> None:
    """The old scheme: py-libp2p sends the UTF-8 bytes of ``/swarmrl/<swarm>/<role>``; js-libp2p refuses it."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(_run_swarm, tmp_path, "a")
        await _join(a, js_node)
        # py-libp2p reports success: ADD_PROVIDER is fire-and-forget, nothing tells it the record was dropped
        assert await a.dht.provide(role_key("interop", "trainer"))
        rejected: list[str] = []
        with trio.move_on_after(10 * slowdown()):
            while not rejected:
                await trio.sleep(0.2)
                rejected = (await js_node.ask("rejected"))["rejected"]
        assert "Invalid CID" in rejected, rejected
        assert (await js_node.ask("records"))["records"] == []
        nursery.cancel_scope.cancel()
