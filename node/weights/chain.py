"""Which route to take to a version: a chain of patches from a version built here, or an anchor and the patches
after it, whichever costs fewer bytes to fetch (chunks already here cost nothing).

From the target, the planner walks parent links back (fetching manifests it lacks; each must be signed by the
trainer and hash to the id its child names) until it reaches a version built here, a version without a patch,
a link nobody can produce, or a point where the patches alone already cost more than the best anchor route
found. Then, oldest first, best(v) = min(0 if v is built, full(v) if v has a full route, best(parent) + patch(v)).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from node.weights.manifest import chunk_sizes
from node.weights.store import ChunkStore
from protocols.weights import Manifest, SignedManifest

MAX_LINKS = 256  # manifests walked back from a target, at most

FetchManifest = Callable[[bytes], Awaitable[tuple[SignedManifest, Manifest] | None]]


@dataclass(frozen=True)
class Step:
    mid: bytes
    manifest: Manifest
    route: str  # "built" (already here), "full" or "patch"
    cost: int  # bytes still to fetch for this step


def route_cost(store: ChunkStore, manifest: Manifest, route: str, sizes: dict[bytes, int] | None = None) -> int:
    """Bytes still to fetch for one route of a version (math.inf-like huge if the route does not exist)."""
    chunks = store.route_chunks(manifest, route)
    if not chunks:
        return math.inf  # type: ignore[return-value]
    sizes = sizes if sizes is not None else chunk_sizes(manifest)
    return sum(sizes.get(h, 0) for h in chunks if not store.has(h))


async def plan(
    store: ChunkStore,
    mid: bytes,
    manifest: Manifest,
    fetch: FetchManifest | None = None,
    max_links: int = MAX_LINKS,
) -> list[Step] | None:
    """The cheapest way to build ``manifest`` here: steps oldest first, the first one built or full, the others
    patches; None when no route is known. ``fetch`` gets a parent manifest by id (None: only what the store holds).
    """
    chain: list[tuple[bytes, Manifest, dict[bytes, int]]] = []
    best_anchor = math.inf
    patches = 0
    cur_mid, cur = mid, manifest
    while True:
        sizes = chunk_sizes(cur)
        chain.append((cur_mid, cur, sizes))
        if store.built(cur) is not None:
            break
        if cur.has_full:
            best_anchor = min(best_anchor, patches + route_cost(store, cur, "full", sizes))
        if cur.patch is None:
            break
        patches += route_cost(store, cur, "patch", sizes)
        if patches >= best_anchor or len(chain) >= max_links:
            break
        parent = store.manifest(cur.patch.parent_id)
        if parent is None and fetch is not None:
            parent = await fetch(cur.patch.parent_id)
        if parent is None or parent[1].version != cur.parent or parent[1].swarm != cur.swarm:
            break  # a missing (or inconsistent) link: routes below it are out of reach
        cur_mid, cur = cur.patch.parent_id, parent[1]
    # oldest first: best[i] is the cheapest way to have chain[i] built
    best: list[tuple[float, str]] = [(math.inf, "")] * len(chain)
    for i in range(len(chain) - 1, -1, -1):
        _, m, sizes = chain[i]
        options: list[tuple[float, int, str]] = []
        if store.built(m) is not None:
            options.append((0, 0, "built"))
        if m.has_full:
            options.append((route_cost(store, m, "full", sizes), 1, "full"))
        if m.patch is not None and i + 1 < len(chain) and best[i + 1][0] < math.inf:
            options.append((best[i + 1][0] + route_cost(store, m, "patch", sizes), 2, "patch"))
        if options:
            cost, _, route = min(options)
            best[i] = (cost, route)
    if best[0][0] == math.inf:
        return None
    steps: list[Step] = []
    i = 0
    while True:
        step_mid, m, sizes = chain[i]
        route = best[i][1]
        cost = 0 if route == "built" else route_cost(store, m, route, sizes)
        steps.append(Step(step_mid, m, route, int(cost)))
        if route != "patch":
            break
        i += 1
    return steps[::-1]


def plan_bytes(steps: list[Step]) -> int:
    return sum(s.cost for s in steps)
