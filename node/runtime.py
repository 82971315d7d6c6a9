"""Runs one node: host + DHT, the role's handlers, bootstrap join, routing-table feeding, status reporting."""

from __future__ import annotations

import gc
import logging
import resource
import sys
from functools import partial
from typing import Any, Protocol

import trio
from libp2p.peer.id import ID

from node.config import NodeConfig
from node.connmgr import conn_limits
from node.errors import UserError
from node.host import Swarm, bootstrap_peers, join_bootstrap, keep_bootstrap_peers, open_swarm
from node.identity import load_or_create_key, peer_id_of
from node.reachability import ReachOptions
from node.status import status_line, write_status

log = logging.getLogger(__name__)


class Role(Protocol):
    """A node's part. Built before the swarm opens (a trainer loads its model first); ``register`` binds it to
    the swarm once, before ``run`` and ``status`` are called."""

    name: str

    def register(self, swarm: Swarm) -> None: ...

    async def run(self, swarm: Swarm) -> None: ...

    def status(self) -> dict[str, Any]: ...


GC_YOUNG = 10_000  # tracked allocations between young collections (CPython's default: 700)
GC_OLDER = 10  # collections of one generation per collection of the next (CPython's default)


def quiet_gc(young: int = GC_YOUNG) -> None:
    """Keep the cyclic garbage collector off a long-running node's loop. What a process built before it runs
    (imported modules, the model: ~420k objects for torch, transformers and py-libp2p) is never garbage, and
    ``gc.freeze`` keeps every later full collection from walking it again (0.23 s each on this box). Young
    collections every ``young`` allocations instead of 700 let a request's objects die young: under load, with a
    loop lagging seconds, they outlived two young collections, reached the oldest generation and made it grow, and
    full collections of it followed. bench/swarm_scale (N = 128, 32 hosts a process) measured **half of a sampler
    host's CPU in the collector** (7.5 of 14.5 ms/s; a full collection of 1.4M objects every 8 s, 1.25 s each),
    which fed the lag that fed it. Call once per process, after the role is built and before the node runs."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, GC_OLDER, GC_OLDER)


def peak_rss_mb() -> float:
    """This process's peak resident memory (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round(usage.ru_utime + usage.ru_stime, 2)


def node_status(config: NodeConfig, swarm: Swarm, role: Role) -> dict[str, Any]:
    return {
        "peak_rss_mb": peak_rss_mb(),
        "cpu_seconds": cpu_seconds(),
        "role": role.name,
        "peer_id": str(swarm.peer_id),
        "addrs": [str(a) for a in swarm.addrs()],
        "peers": len(swarm.host.get_connected_peers()),
        "routing": swarm.dht.get_routing_table_size(),
        **swarm.status(),  # reachability, connection paths, relay use (node/reachability.py)
        **role.status(),
    }


def reach_options(config: NodeConfig) -> ReachOptions:
    """Reachability for a node: the bootstrap peers and the trainer are asked for dial-backs and used as relays."""
    trusted = {ID.from_base58(a.get_peer_id()) for a in config.bootstrap if a.get_peer_id()}
    if config.trainer_id is not None:
        trusted.add(config.trainer_id)
    infrastructure = config.role in ("trainer", "bootstrap")
    return ReachOptions(
        swarm_name=config.swarm,
        trusted=frozenset(trusted),
        relay=infrastructure if config.relay is None else config.relay,
        relay_slots=config.relay_slots,
        relay_circuit_bytes=config.relay_circuit_bytes,
        relay_circuit_seconds=config.relay_circuit_seconds,
        check_interval=config.reachability_interval,
        provide_interval=config.provide_interval,
        assume_public=infrastructure,
    )


async def run_node(config: NodeConfig, role: Role, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled. ``task_status.started`` receives the Swarm once the node has joined."""
    key_pair = load_or_create_key(config.identity_path)
    allow = config.allowed_peers(peer_id_of(key_pair))
    async with open_swarm(
        key_pair, config.listen, psk=config.psk, allow=allow, reach=reach_options(config), conns=conn_limits(config)
    ) as swarm:
        role.register(swarm)
        others, listed = bootstrap_peers(swarm, config.bootstrap)
        if config.role == "bootstrap" or listed:
            # a bootstrap node needs no one to start: the first of a swarm's bootstrap nodes finds none of the
            # others up, and dials them in the background below until they are
            reached = 0
        else:
            try:
                reached = await join_bootstrap(swarm, others, config.bootstrap_timeout)
            except UserError as exc:
                if config.psk is None:
                    raise
                hint = "this is a private swarm: do the bootstrap peers use the same swarm key?"
                raise UserError(f"{exc} [{hint}]") from None
        log.info(
            "%s %s listening on %s; %d of %d bootstrap peer(s) reached",
            role.name,
            swarm.peer_id,
            ", ".join(map(str, swarm.addrs())),
            reached,
            len(others),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(keep_bootstrap_peers, swarm, others, settles=config.role != "bootstrap"))
            nursery.start_soon(swarm.feed_routing_table, 1.0)
            nursery.start_soon(_report_status, config, swarm, role)
            nursery.start_soon(_run_role, role, swarm, nursery.cancel_scope)
            task_status.started(swarm)


async def _run_role(role: Role, swarm: Swarm, scope: trio.CancelScope) -> None:
    """A role whose work is done (a trainer that reached --max-steps) ends the node."""
    await role.run(swarm)
    log.info("%s finished", role.name)
    scope.cancel()


async def _report_status(config: NodeConfig, swarm: Swarm, role: Role) -> None:
    while True:
        fields = node_status(config, swarm, role)
        write_status(config.data_dir, fields)
        log.info("status %s", status_line(fields))
        await trio.sleep(config.status_interval)
