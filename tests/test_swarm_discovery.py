"""1 trainer + 3 samplers in one trio process discover each other through the DHT from one bootstrap address."""

from __future__ import annotations

import trio

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
        await wait_until(lambda: all(len(s.role.samplers) == 2 for s in samplers), timeout=30)
        for s in samplers:
            others = {str(o.swarm.peer_id) for o in samplers if o is not s}
            assert s.role.samplers == others

        # rollouts reach the trainer straight from every sampler and are accepted
        await wait_until(lambda: all(s.role.rollouts_accepted >= 8 for s in samplers), timeout=60)
        by_peer = trainer.role.intake.ledger.accepted_by_peer
        assert set(by_peer) == {str(s.swarm.peer_id) for s in samplers}
        assert trainer.role.intake.forged == 0
        nursery.cancel_scope.cancel()
