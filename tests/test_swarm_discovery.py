"""1 trainer + 3 samplers in one trio process discover each other through the DHT from one bootstrap address."""

from __future__ import annotations

import socket

import trio
from multiaddr import Multiaddr

from tests.helpers import start_bootstrap, start_sampler, start_trainer, wait_until


async def test_samplers_find_trainer_and_each_other_via_dht(tmp_path, tiny_model_dir):
    async with trio.open_nursery() as nursery:
        boot = await start_bootstrap(nursery, tmp_path)
        # samplers first: the trainer appears after them and must still be found
        samplers = [await start_sampler(nursery, tmp_path, f"s{i}", boot) for i in range(3)]
        await trio.sleep(1.0)
        assert not any(s.role.trainer_found.is_set() for s in samplers)
        trainer = await start_trainer(nursery, tmp_path, boot, tiny_model_dir, max_tokens=6)

        await wait_until(lambda: all(s.role.trainer_found.is_set() for s in samplers), timeout=30)
        # nobody was told the trainer's address: the only address given out was the bootstrap's
        for s in samplers:
            assert all(a != trainer.swarm.addrs()[0] for a in s.config.bootstrap)
        assert all(s.role.trainer_found_by["dht"] >= 1 for s in samplers)
        await wait_until(lambda: all(len(s.role.samplers) == 2 for s in samplers), timeout=30)
        for s in samplers:
            others = {str(o.swarm.peer_id) for o in samplers if o is not s}
            assert s.role.samplers == others

        # rollouts reach the trainer straight from every sampler and are accepted
        await wait_until(lambda: all(s.role.rollouts_accepted >= 8 for s in samplers), timeout=60)
        by_peer = trainer.role.intake.ledger.accepted_by_peer
        assert set(by_peer) == {str(s.swarm.peer_id) for s in samplers}
        assert trainer.role.intake.forged == 0

        # a lost trainer is dialled again where it was last reached, and looked up in the DHT only when it is not
        # there any more (it moved): then the new addresses are remembered
        tid = trainer.swarm.peer_id
        back, moved = samplers[0], samplers[1]
        gone = Multiaddr(f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{tid}")
        for s, path in ((back, "last_addresses"), (moved, "dht")):
            before = s.role.trainer_found_by[path]

            def done(s=s, path=path, before=before) -> bool:
                remembered = s is back or (s.role._trainer_addrs and gone not in s.role._trainer_addrs)
                return (
                    s.role.trainer_found_by[path] > before
                    and tid in s.swarm.host.get_connected_peers()
                    and bool(remembered)
                )

            # the trainer's own DHT and gossip traffic may dial a sampler back between our disconnect and the
            # lookup, and a DHT lookup may come back empty on a loaded box: try again, as the discovery loop does
            with trio.fail_after(90):
                while not done():
                    await s.swarm.host.disconnect(tid)
                    if s is moved:
                        s.role._trainer_addrs = [gone]
                        s.swarm.host.get_peerstore().clear_addrs(tid)  # its old addresses are dead, and forgotten
                    await s.role._find_trainer(s.swarm)
                    await trio.sleep(0.2)
        nursery.cancel_scope.cancel()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
