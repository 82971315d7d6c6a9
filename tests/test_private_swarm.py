"""Private swarms: nodes without the swarm key cannot connect at all; peers off the allow-list are shut out."""

from __future__ import annotations

import pytest
import trio
from libp2p.network.exceptions import SwarmException
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.errors import UserError
from node.host import open_swarm
from node.identity import load_or_create_key, peer_id_of
from node.private import load_swarm_key, write_swarm_key
from node.rpc import request
from node.settings import load_config_file
from protocols import weights as weights_proto
from tests.helpers import LOOPBACK, wait_until


def swarm_key(path) -> str:
    write_swarm_key(path)
    return load_swarm_key(path)


async def test_only_nodes_with_the_swarm_key_can_connect(tmp_path):
    key, other_key = swarm_key(tmp_path / "a.key"), swarm_key(tmp_path / "b.key")
    assert key != other_key
    ids = [load_or_create_key(tmp_path / f"id{i}") for i in range(4)]
    async with (
        open_swarm(ids[0], LOOPBACK, psk=key) as a,
        open_swarm(ids[1], LOOPBACK, psk=key) as b,
        open_swarm(ids[2], LOOPBACK, psk=other_key) as wrong,
        open_swarm(ids[3], LOOPBACK) as public,
    ):
        target = info_from_p2p_addr(a.addrs()[0])
        await b.connect(target)
        assert a.peer_id in b.host.get_connected_peers()
        for outsider in (wrong, public):
            # the handshake never makes sense: it times out, or fails (Swarm.connect: ConnectionError, naming each
            # address and what it said; burner run d3 failed here when the handshake failed before the 2 s)
            with pytest.raises((trio.TooSlowError, SwarmException, ConnectionError)):
                await outsider.connect(target, timeout=2)
            assert a.peer_id not in outsider.host.get_connected_peers()
        # and the private node cannot dial out into the public one either
        with pytest.raises((trio.TooSlowError, SwarmException, ConnectionError)):
            await a.connect(info_from_p2p_addr(public.addrs()[0]), timeout=2)
        # the keyed pair still talks after the failed attempts: a libp2p ping round trip through the pnet cipher
        stream = await b.host.new_stream(a.peer_id, ["/ipfs/ping/1.0.0"])
        payload = bytes(range(32))
        await stream.write(payload)
        echoed = b""
        with trio.fail_after(5):
            while len(echoed) < 32:
                echoed += await stream.read(32 - len(echoed))
        assert echoed == payload
        await stream.close()


async def test_peers_off_the_allow_list_are_disconnected_and_their_streams_refused(tmp_path):
    ids = [load_or_create_key(tmp_path / f"id{i}") for i in range(3)]
    friend, stranger = peer_id_of(ids[1]), peer_id_of(ids[2])
    async with (
        open_swarm(ids[0], LOOPBACK, allow=frozenset({peer_id_of(ids[0]), friend})) as gated,
        open_swarm(ids[1], LOOPBACK) as ok,
        open_swarm(ids[2], LOOPBACK) as bad,
    ):
        target = info_from_p2p_addr(gated.addrs()[0])
        await ok.connect(target)
        try:
            await bad.connect(target)
        except Exception:
            pass  # the close may race the dial
        await wait_until(
            lambda: stranger not in gated.host.get_connected_peers(), 10, 0.05, what="the gate to drop the stranger"
        )
        assert friend in gated.host.get_connected_peers()
        assert gated.gate.refused.get(str(stranger), 0) >= 1
        # a stranger cannot use any protocol, even one the node serves
        with pytest.raises(SwarmException):
            await request(
                bad.host,
                gated.peer_id,
                weights_proto.PROTOCOL_ID,
                weights_proto.get_manifest(None),
                max_request=weights_proto.MAX_REQUEST_FRAME,
                max_reply=weights_proto.MAX_REPLY_FRAME,
                timeout=5,
            )
        # and the gated node refuses to dial it
        with pytest.raises(UserError, match="allow-list"):
            await gated.connect(info_from_p2p_addr(bad.addrs()[0]))


def test_swarm_key_files_and_config(tmp_path):
    key_path = tmp_path / "swarm.key"
    write_swarm_key(key_path)
    assert key_path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(UserError, match="already exists"):
        write_swarm_key(key_path)
    (tmp_path / "bad.key").write_text("/key/swarm/psk/1.0.0/\n/base16/\nnot-hex\n")
    with pytest.raises(UserError, match="64 hex digits"):
        load_swarm_key(tmp_path / "bad.key")
    me = peer_id_of(load_or_create_key(tmp_path / "me"))
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text(f'[swarm]\nname = "p"\npsk_file = "swarm.key"\nallow = ["{me}"]\n')
    values = load_config_file(cfg)
    assert values["psk"] == load_swarm_key(key_path) and values["allow"] == frozenset({me})
    cfg.write_text('[swarm]\nallow = ["nope"]\n')
    with pytest.raises(UserError, match="bad peer id"):
        load_config_file(cfg)
