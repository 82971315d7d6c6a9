"""The one place swarmrl touches py-libp2p's internals: its private attributes, monkeypatches and overrides of
private methods. The rest of node/ uses the library's public API and what this package exposes:

- ``install()``: the version check, the in-place fixes (``patches.apply``) and the library's logs routed through
  ours (``logs.route_library_logs``); ``node.host.build_host`` calls it for every host;
- reachability (node/reachability.py decides, these act): ``DialBack`` (AutoNAT), ``RelayHop`` and ``RelayClient``
  (circuit relay v2), ``HolePuncher`` (DCUtR), ``advertise`` (what the host puts in identify and provider
  records), ``conn_kind`` / ``is_relayed_addr``;
- discovery: ``providers_from_peer``, ``provide_to_peer``, ``set_dht_handlers``, ``dht_slots``; the allow-list gate:
  ``inbound_stream_entry``.

Every fix is a row of ``patches.PATCHES`` (bug, target, ours, the test reproducing it, the report for upstream in
docs/upstream/); every private read without a fix is a row of ``patches.INTERNALS``. Upgrading py-libp2p means
re-deriving those rows, here only.
"""

from __future__ import annotations

from node.libp2p import patches
from node.libp2p.access import dht_slots, inbound_stream_entry, provide_to_peer, providers_from_peer, set_dht_handlers
from node.libp2p.logs import route_library_logs
from node.libp2p.nat import (
    MAX_HOLE_PUNCH_ATTEMPTS,
    DialBack,
    HolePuncher,
    RelayClient,
    RelayHop,
    advertise,
    conn_kind,
    is_relayed_addr,
)
from node.libp2p.version import LIBP2P_VERSION, check_version

__all__ = [
    "LIBP2P_VERSION",
    "MAX_HOLE_PUNCH_ATTEMPTS",
    "DialBack",
    "HolePuncher",
    "RelayClient",
    "RelayHop",
    "advertise",
    "check_version",
    "conn_kind",
    "dht_slots",
    "inbound_stream_entry",
    "install",
    "is_relayed_addr",
    "patches",
    "provide_to_peer",
    "providers_from_peer",
    "route_library_logs",
    "set_dht_handlers",
]


def install() -> None:
    """Everything a host needs before it is built: version check, fixes, log routing (idempotent)."""
    patches.apply()  # checks the version first
    route_library_logs()
