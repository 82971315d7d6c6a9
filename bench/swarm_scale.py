"""bench/swarm_scale: how many samplers one trainer feeds, on loopback, with N real sampler hosts (issue 29).

One bootstrap node, one trainer and N samplers, each its own process group:

- the trainer is the product's ``TrainerRole`` under ``run_node`` in a process of its own (what ``swarmrl node
  --role trainer`` runs), started by this script rather than by the CLI so that a probe inside its trio loop can
  measure the loop's lag and read its connections, verification seconds and lease refusals without new knobs;
- the samplers are ``SamplerRole``s under ``run_node``, N/K to a process on one trio loop each (K processes):
  every one has its own identity, listening address, connections, DHT participation, gossip, weight downloads and
  version rebuilds. Only the engine is shared: one torch engine per process and version (the embedded tiny model,
  loaded from the first identity of that process to install the version), batching the groups of all identities
  that wait at once into one ``generate_rows`` call. Every token is drawn by the seeded draw rule and every group
  verified by the trainer as in the product.

Per N it waits until most samplers have a group accepted, then measures a steady window: accepted groups/s, the
trainer's CPU (cores and CPU-seconds per group), verification seconds per second, event-loop lag (p50/p99/max),
connections and RSS (per connected peer: the slope against N), time from a version's announcement to 50%/99% of
samplers having installed it, DHT lookup time of the trainer's and the samplers' records, leases refused as busy,
errors, and the machine's CPU share of every process. Writes bench/results/swarm_scale.txt and swarm_scale.png.

    nice -n 10 .venv/bin/python bench/swarm_scale.py [--n 16 64 256] [--per-proc 64] [--window 60]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = Path(__file__).resolve().parents[1] / "runs" / "swarm_scale"
# a version every batch_groups x publish_every = 128 groups: every sampler downloads and rebuilds every version, so
# on one box the samplers' share of the CPU grows with N x versions/s (each real sampler pays its own)
TRAINER = dict(task="reverse", group_size=4, max_tokens=6, batch_groups=32, publish_every=4, eval_every=10**6,
               checkpoint_every=10**6, dashboard="off")  # fmt: skip
GROUPS_PER_VERSION = TRAINER["batch_groups"] * TRAINER["publish_every"]
CLK = os.sysconf("SC_CLK_TCK")


# -- measuring processes from outside --------------------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    """CPU-seconds (user + system) a process used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK
    except (OSError, IndexError, ValueError):
        return 0.0


def proc_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the whole machine since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    return (sum(parts) - idle) / CLK, sum(parts) / CLK


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# -- the processes ---------------------------------------------------------------------------------------------------


def boot_main(args: argparse.Namespace) -> None:
    import trio

    from node.local_swarm import start_bootstrap
    from node.runtime import quiet_gc

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            # every sampler keeps a connection to the bootstrap node: as for the trainer, its --max-inbound must
            # cover N (a bootstrap node at the default 250 hangs up on its idlest peers, who come back later)
            boot = await start_bootstrap(nursery, Path(args.root), max_inbound=max(250, args.count + 64))
            (Path(args.root) / "boot.addr").write_text(str(boot.swarm.addrs()[0]))
            probe = LagProbe()  # every newcomer's first peer and the lookups' trusted peer: is its loop late?
            nursery.start_soon(probe.run)
            stages = trace_dht_serving()
            while True:
                await trio.sleep(2.0)
                write_json(Path(args.root) / "boot.json", {"time": time.time(), "lag": probe.take(), "dht": stages})

    quiet_gc()  # what `swarmrl node` does before its loop runs
    trio.run(main)


def trace_dht_serving() -> dict[str, dict[str, int]]:
    """How long each stage of serving an inbound DHT stream takes in this process (the bootstrap node's): the
    stream's protocol negotiation, the wait for its first request once negotiated, and py-libp2p's handler (the
    answer, and up to ``DHT_IDLE_SECONDS`` for a next request). Counts by stage and duration, updated in place;
    streams whose request was read are counted again by the request's type ("by GET_PROVIDERS: ..."): our lookups
    ask the bootstrap node GET_PROVIDERS, py-libp2p's walks mostly FIND_NODE."""
    from libp2p.kad_dht.kad_dht import KadDHT
    from libp2p.protocol_muxer.multiselect import Multiselect

    import node.host as node_host

    stages: dict[str, dict[str, int]] = {}
    negotiate, first, handle = Multiselect.negotiate, node_host._DhtStream.first_request, KadDHT.handle_stream

    def count(stage: str, took: float) -> None:
        by_label = stages.setdefault(stage, {})
        label = within(took, (0.1, 1, 5, 10, 30))
        by_label[label] = by_label.get(label, 0) + 1

    types = {0: "PUT_VALUE", 1: "GET_VALUE", 2: "ADD_PROVIDER", 3: "GET_PROVIDERS", 4: "FIND_NODE", 5: "PING"}

    async def negotiating(self: Any, communicator: Any, *a: Any, **kw: Any) -> Any:
        t, outcome = time.monotonic(), "failed"
        try:
            protocol, handler = await negotiate(self, communicator, *a, **kw)
            outcome = str(protocol)
            return protocol, handler
        finally:
            if outcome in ("failed", "/ipfs/kad/1.0.0"):
                communicator.read_writer.negotiated_in = took = time.monotonic() - t
                count(f"negotiation {outcome}", took)

    async def first_request(self: Any) -> bool:
        t = time.monotonic()
        got = await first(self)
        count(f"first request {'read' if got else 'none'}", time.monotonic() - t)
        if got:  # the message's type: its field 1 (tag 0x08) comes first after the length varint
            body = self._first[next((i for i, b in enumerate(self._first) if b < 0x80), len(self._first)) + 1 :]
            # py-libp2p writes the length and the message apart: its own requests show here as length only
            self.kind = (types.get(body[1], "?") if body[:1] == b"\x08" and len(body) > 1
                         else "PUT_VALUE" if body else "length only")  # fmt: skip
            if hasattr(self._stream, "negotiated_in"):
                count(f"by {self.kind}: negotiation", self._stream.negotiated_in)
            count(f"by {self.kind}: first request", time.monotonic() - t)
        return got

    async def handling(self: Any, stream: Any) -> None:
        t = time.monotonic()
        try:
            await handle(self, stream)
        finally:
            took = time.monotonic() - t
            count("handler", took)
            count(f"by {getattr(stream, 'kind', '?')}: handler", took)

    Multiselect.negotiate = negotiating  # type: ignore[method-assign]
    node_host._DhtStream.first_request = first_request  # type: ignore[method-assign]
    KadDHT.handle_stream = handling  # type: ignore[method-assign]
    return stages


class LagProbe:
    """How late a trio loop wakes a sleeper: the loop's lag (what every handler on it waits on top of its work)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self, period: float = 0.05) -> None:
        import trio

        while True:
            t0 = trio.current_time()
            await trio.sleep(period)
            self.samples.append(trio.current_time() - t0 - period)

    def take(self) -> list[float]:
        out, self.samples = self.samples, []
        return out


class TaskSteps:
    """A trio instrument: CPU-seconds of the loop's thread spent in each task's steps, summed by task name."""

    def __init__(self) -> None:
        self.started: float | None = None  # None: added in the middle of a step, which is not counted
        self.by_name: dict[str, list[float]] = {}

    def before_task_step(self, task: Any) -> None:
        self.started = time.thread_time()

    def after_task_step(self, task: Any) -> None:
        if self.started is not None:
            entry = self.by_name.setdefault(task.name, [0.0, 0])
            entry[0] += time.thread_time() - self.started
            entry[1] += 1
        self.started = None

    def totals(self) -> dict[str, list[float]]:
        return dict(sorted(self.by_name.items(), key=lambda kv: -kv[1][0]))


def trainer_main(args: argparse.Namespace) -> None:
    import multiaddr
    import trio

    from node.intake import Busy
    from node.local_swarm import node_config, settings
    from node.roles.trainer import TrainerRole
    from node.runtime import quiet_gc, run_node

    root = Path(args.root)
    boot = multiaddr.Multiaddr((root / "boot.addr").read_text().strip())
    # a trainer feeding N samplers holds N inbound connections: its --max-inbound (250 by default) must cover them
    cfg = node_config(root, "trainer", "trainer", bootstrap=(boot,), provide_interval=30.0, status_interval=10.0,
                      max_inbound=max(250, args.count + 64))  # fmt: skip
    s = settings(
        trainer={**TRAINER, "newcomer_rate": args.newcomer_rate},
        learner={"model_dir": Path(args.model), **json.loads(args.learner)},
        weights=json.loads(args.weights),
    )
    role = TrainerRole(cfg, s)
    busy = {"refused": 0}
    lease = role.intake.lease

    def counting_lease(*a: Any, **kw: Any) -> Any:  # counts refusals; the decision is the product's
        try:
            return lease(*a, **kw)
        except Busy:
            busy["refused"] += 1
            raise

    role.intake.lease = counting_lease  # type: ignore[method-assign]
    admit = role.intake.admit_work

    def counting_admit(*a: Any, **kw: Any) -> Any:
        try:
            return admit(*a, **kw)
        except Busy:
            busy["refused"] += 1
            raise

    role.intake.admit_work = counting_admit  # type: ignore[method-assign]
    probe = LagProbe()
    published: dict[int, float] = {}

    async def watch_published() -> None:
        while True:
            if role.outbox.published is not None:
                published.setdefault(role.outbox.published[0], time.time())
            await trio.sleep(0.05)

    async def report(swarm: Any) -> None:
        while True:
            now = time.time()
            lags = probe.take()
            conns = swarm.host.get_network().get_connections()
            st = role.intake.status()
            write_json(root / "trainer.json", {
                "time": now, "cpu": sum(os.times()[:2]), "rss_mb": proc_rss_mb(os.getpid()),
                "connections": len(conns), "peers": len(swarm.host.get_connected_peers()),
                "conn_counts": dict(swarm.conns.counts), "inbound": swarm.conns.status().get("inbound"),
                "dht_streams": swarm.status()["dht_streams"],
                "groups_accepted": st.get("groups_accepted", 0), "groups_rejected": st.get("groups_rejected", 0),
                "groups_forged": st.get("groups_forged", 0), "rate_limited": st.get("rate_limited", 0),
                "leases_issued": st.get("leases_issued", 0), "leases_busy": busy["refused"],
                "peers_accepted": len(st.get("accepted_by_peer", {})),
                "verify_seconds": role.intake.verifier.scoring_seconds,
                "verify_tokens": role.intake.verifier.scored_tokens,
                "busy_seconds": role.meter.busy_seconds, "step": role.learner.steps, "version": role.learner.version,
                "published": published, "lag": lags,
            })  # fmt: skip
            await trio.sleep(1.0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            swarm = await nursery.start(run_node, cfg, role)
            nursery.start_soon(probe.run)
            nursery.start_soon(watch_published)
            nursery.start_soon(report, swarm)

    quiet_gc()  # what `swarmrl node` does before its loop runs
    trio.run(main)


class SharedEngine:
    """One engine per version for every identity of this process, batching the groups that wait at once.

    Each identity downloads, checks and rebuilds its versions itself; the first to install version v here loads it
    (every other identity's copy of v is bit-identical: each tensor's blake3 was checked against the signed
    manifest). Groups are queued by the identities' worker threads and decoded together, per (version, sampling)."""

    def __init__(self, window: float = 0.02) -> None:
        self.window = window
        self.models: dict[int, Any] = {}
        self.cond = threading.Condition()
        self.decoding = threading.Lock()
        self.queue: list[dict[str, Any]] = []
        self.batches = 0
        self.rows = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def load(self, path: Path, version: int) -> None:
        from node.engines.torch_engine import TorchEngine

        with self.decoding:  # one thing at a time on the engines: loading touches torch's global state
            if version in self.models:
                return
            engine = TorchEngine(path, version=version, compute="fp32")
            for p in engine.model.parameters():  # own the weights: the file may be mapped, and the store moves on
                p.data = p.data.clone()
            self.models[version] = engine
            for old in sorted(self.models)[:-8]:  # the staleness bound is 4: older ones are never asked for
                del self.models[old]

    def generate(self, version: int, prompts: list[list[int]], seed: int, **sampling: Any) -> list[Any]:
        job = {"version": version, "prompts": prompts, "seed": seed, "sampling": sampling, "done": threading.Event()}
        with self.cond:
            self.queue.append(job)
            self.cond.notify()
        job["done"].wait()
        if "error" in job:
            raise job["error"]
        return job["out"]

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
            time.sleep(self.window)  # let the other identities' groups join this batch
            with self.cond:
                jobs, self.queue = self.queue, []
            by_kind: dict[tuple, list[dict[str, Any]]] = {}
            for job in jobs:
                by_kind.setdefault((job["version"], *sorted(job["sampling"].items())), []).append(job)
            for (version, *_), group in by_kind.items():
                try:
                    prompts = [p for j in group for p in j["prompts"]]
                    rows = [(j["seed"], k) for j in group for k in range(len(j["prompts"]))]
                    with self.decoding:
                        out = self.models[version].generate_rows(prompts, rows, **group[0]["sampling"])
                    self.batches += 1
                    self.rows += len(rows)
                    i = 0
                    for j in group:
                        j["out"] = out[i : i + len(j["prompts"])]
                        i += len(j["prompts"])
                except Exception as exc:
                    for j in group:
                        j["error"] = exc
                for j in group:
                    j["done"].set()


class IdentityEngine:
    """One sampler identity's view of the shared engine: the Engine protocol, at the version this identity runs."""

    name = "torch"
    quant = "none"
    compute = "fp32"

    def __init__(self, shared: SharedEngine, path: Path, version: int, pace: float = 0.0) -> None:
        self.shared = shared
        self.pace = pace  # seconds a group takes at the least: the emulated speed of one sampler's machine
        self.swap(path, version)

    def swap(self, model_dir: Path, version: int) -> None:
        self.shared.load(model_dir, version)
        self.version = version

    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float, max_tokens: int, seed: int):
        t0 = time.monotonic()
        out = self.shared.generate(
            self.version, prompts, seed, temperature=temperature, top_p=top_p, max_tokens=max_tokens
        )
        # a paced identity is a machine that generates a group in `pace` seconds: it waits out the rest of that time
        # in its worker thread (no CPU), so N identities offer N / pace groups/s whatever this box's cores
        time.sleep(max(0.0, self.pace - (time.monotonic() - t0)))
        return out


def samplers_main(args: argparse.Namespace) -> None:
    import multiaddr
    import torch
    import trio

    from node.local_swarm import node_config, settings, trainer_peer_id
    from node.roles.sampler import SamplerRole
    from node.runtime import quiet_gc, run_node

    torch.set_num_threads(1)
    root = Path(args.root)
    boot = multiaddr.Multiaddr((root / "boot.addr").read_text().strip())
    trainer_id = trainer_peer_id(root)
    boot_id = boot.value_for_protocol("p2p")

    def kind_of(peer: Any) -> str:
        return "trainer" if peer == trainer_id else "bootstrap" if str(peer) == boot_id else "sampler"

    shared = SharedEngine()
    names = [f"s{i:04d}" for i in range(args.first, args.first + args.count)]
    roles: dict[str, Any] = {}
    swarms: dict[str, Any] = {}
    marks: dict[str, dict[str, Any]] = {n: {"installed": {}, "heard": {}} for n in names}
    probe = LagProbe()
    finds: list[dict[str, float]] = []

    async def one(name: str, delay: float) -> None:
        await trio.sleep(delay)
        cfg = node_config(root, name, "sampler", bootstrap=(boot,), trainer_id=trainer_id, provide_interval=30.0,
                          discover_interval=2.0, status_interval=30.0, bootstrap_timeout=60.0)  # fmt: skip
        s = settings(sampler={"engine": "torch", "bits": "none", "compute": "fp32"}, weights=json.loads(args.weights))
        role = SamplerRole(cfg, s, lambda path, version: IdentityEngine(shared, path, version, args.pace))
        roles[name] = role
        marks[name]["started"] = time.time()
        try:
            swarms[name] = await nursery_ref[0].start(run_node, cfg, role)
        except BaseException as exc:
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # the nursery's: say its cause
                exc = exc.exceptions[0]
            marks[name]["error"] = f"{type(exc).__name__}: {exc}"
            return
        marks[name]["joined"] = time.time()

    async def watch() -> None:
        while True:
            now = time.time()
            for name, role in roles.items():
                m = marks[name]
                if "trainer_found" not in m and role.discovery.trainer_found.is_set():
                    m["trainer_found"] = now
                if "sampler_found" not in m and role.discovery.samplers:
                    m["sampler_found"] = now
                if role.engine is not None:
                    m["installed"].setdefault(str(role.engine.version), now)
                target = getattr(getattr(role, "weights", None), "target", None)
                if target is not None:
                    m["heard"].setdefault(str(target[0]), now)
            await trio.sleep(0.1)

    async def dht_probe() -> None:
        """Time DHT lookups of the trainer's and the samplers' records from one identity of this process."""
        from node.discovery import find_role, role_key

        await trio.sleep(30)
        while True:
            for role_name in ("trainer", "sampler"):
                live = [n for n in names if n in swarms]
                if not live:
                    break
                swarm = swarms[live[len(finds) % len(live)]]
                t0 = time.monotonic()
                found = await find_role(swarm, role_key("test", role_name))
                finds.append({"role": role_name, "seconds": time.monotonic() - t0, "found": len(found)})
            await trio.sleep(10)

    async def report() -> None:
        while True:
            lags = probe.take()
            stats = {}
            for name, role in roles.items():
                m = marks[name]
                stats[name] = {
                    **m,
                    "accepted": role.rollouts_accepted, "sent": role.groups_sent, "rejected": role.rollouts_rejected,
                    "strikes": role.strikes, "rate_limited": role.rate_limited, "last_error": role.last_error,
                    "connections": len(swarms[name].host.get_connected_peers()) if name in swarms else 0,
                    "gossip": swarms[name].gossip.delivered if name in swarms else 0,
                    "conn_counts": dict(swarms[name].conns.counts) if name in swarms else {},
                }  # fmt: skip
            write_json(root / f"procs-{args.first}.json", {
                "time": time.time(), "cpu": sum(os.times()[:2]), "rss_mb": proc_rss_mb(os.getpid()),
                "lag": lags, "finds": finds, "batches": shared.batches, "rows": shared.rows, "samplers": stats,
            })  # fmt: skip
            finds.clear()
            await trio.sleep(2.0)

    async def profile(start: float, seconds: float) -> None:
        """CPU time of this process's event loop per task, by the task's function, for ``seconds`` after ``start``:
        where a sampler host's upkeep goes. A trio instrument times every task step with the thread's CPU clock,
        so the engine's thread is not counted and nothing is sampled (cProfile distorted this code ~30x here)."""
        import struct
        from contextvars import ContextVar

        from libp2p.host.basic_host import BasicHost
        from libp2p.kad_dht.kad_dht import KadDHT
        from libp2p.kad_dht.provider_store import ProviderStore
        from libp2p.kad_dht.routing_table import KBucket
        from libp2p.network.stream.net_stream import NetStream
        from libp2p.network.swarm import Swarm as Network
        from libp2p.protocol_muxer.multiselect import Multiselect
        from libp2p.stream_muxer.yamux import yamux

        await trio.sleep(start)
        steps, streams, frames, conns = TaskSteps(), Counter(), Counter(), Counter()
        set_protocol, read_exactly, add_conn, remove_conn = (
            NetStream.set_protocol, yamux.read_exactly, Network.add_conn, Network.remove_conn)  # fmt: skip
        negotiate, inbound = Multiselect.negotiate, Counter()
        new_stream, outbound, origins = BasicHost.new_stream, Counter(), Counter()
        source: ContextVar[str] = ContextVar("source", default="other")  # which DHT job opened a stream (tasks
        # started inside a job copy its context, so its walk's streams carry its name)
        jobs = {(KadDHT, "provide"): "provide", (KadDHT, "find_providers"): "find providers",
                (KadDHT, "refresh_routing_table"): "refresh", (KBucket, "_ping_peer"): "bucket ping",
                (ProviderStore, "_republish_provider_records"): "republish"}  # fmt: skip
        jobs = {k: v for k, v in jobs.items() if hasattr(*k)}
        unwrapped = {k: getattr(*k) for k in jobs}

        def tagged(call: Any, name: str) -> Any:
            async def wrapper(*a: Any, **kw: Any) -> Any:
                token = source.set(name)
                try:
                    return await call(*a, **kw)
                finally:
                    source.reset(token)

            return wrapper

        kinds = {yamux.TYPE_DATA: "data", yamux.TYPE_WINDOW_UPDATE: "window", yamux.TYPE_PING: "ping",
                 yamux.TYPE_GO_AWAY: "go-away"}  # fmt: skip
        flags = ((yamux.FLAG_SYN, "SYN"), (yamux.FLAG_ACK, "ACK"), (yamux.FLAG_FIN, "FIN"), (yamux.FLAG_RST, "RST"))

        def counting(self: Any, protocol_id: Any) -> None:  # every stream negotiated, either side, by protocol
            streams[str(protocol_id)] += 1
            set_protocol(self, protocol_id)

        async def negotiating(self: Any, communicator: Any, *a: Any, **kw: Any) -> Any:
            """Each inbound negotiation (of a stream; of a connection's upgrade too: /noise, /yamux), by what it
            ended with: its task is renamed after the protocol, so the handler's CPU shows by protocol (a refused
            or abandoned one shows the last thing it read)."""
            read, asked = communicator.read, []

            async def recording() -> Any:
                command = await read()
                asked.append(command)
                return command

            communicator.read = recording
            task = trio.lowlevel.current_task()
            try:
                protocol, handler = await negotiate(self, communicator, *a, **kw)
            except BaseException as exc:
                inbound[f"{type(exc).__name__} after {asked[-1] if asked else 'nothing'}"] += 1
                raise
            inbound[str(protocol)] += 1
            task.name = f"inbound {protocol}"
            return protocol, handler

        frames_on: Counter = Counter()  # frame headers read, by connection (id of its secure session)

        async def reading(conn: Any, n: int) -> bytes:  # every yamux frame header read, by type and flags
            data = await read_exactly(conn, n)
            if n == yamux.HEADER_SIZE:
                frames_on[id(conn)] += 1
                _, typ, flag, _, length = struct.unpack(yamux.YAMUX_HEADER_FORMAT, data)
                named = "+".join(name for bit, name in flags if flag & bit)
                frames[
                    f"{kinds.get(typ, typ)}{' ' + named if named else ''}{' empty' if typ == 0 and not length else ''}"
                ] += 1
            return data

        async def opening(self: Any, peer: Any, protocols: Any, *a: Any, **kw: Any) -> Any:
            """Each stream py-libp2p's own negotiation opens (the DHT, gossip, identify; not node/rpc.py's lazy
            ones), by its first protocol and how the opening ended."""
            outcome = "opened"
            try:
                return await new_stream(self, peer, protocols, *a, **kw)
            except BaseException as exc:
                outcome = type(exc).__name__
                raise
            finally:
                outbound[f"{source.get()}: {outcome} {protocols[0] if protocols else '?'}"] += 1
                if source.get() == "other":  # by the tasks it was opened under, innermost first
                    chain, task = [], trio.lowlevel.current_task()
                    while task is not None and len(chain) < 6:
                        chain.append(".".join(task.name.split(".")[-2:]))
                        task = task.parent_nursery.parent_task if task.parent_nursery is not None else None
                    origins[" < ".join(chain)] += 1

        async def adding(self: Any, *args: Any, **kwargs: Any) -> Any:
            conns["opened"] += 1
            return await add_conn(self, *args, **kwargs)

        def removing(self: Any, conn: Any) -> None:
            conns["closed"] += 1
            remove_conn(self, conn)

        gc_time: dict[str, list[float]] = {}  # generation -> [seconds, collections, objects collected]
        gc_started = [0.0]

        def gc_timer(phase: str, info: dict[str, int]) -> None:  # the collector's own time, inside task steps
            if phase == "start":
                gc_started[0] = time.thread_time()
                return
            entry = gc_time.setdefault(f"gen{info['generation']}", [0.0, 0, 0])
            entry[0] += time.thread_time() - gc_started[0]
            entry[1] += 1
            entry[2] += info.get("collected", 0)

        from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL

        import node.discovery as discovery
        from node import rpc
        from node.host import Swarm as NodeSwarm
        from node.roles.trainer_rpc import TrainerClient

        lease, connect, find_role = TrainerClient.lease, NodeSwarm.connect, discovery.find_role
        leases, looks = Counter(), Counter()

        def timed(call: Any, counts: Counter, label: str, ok: str) -> Any:
            """``call``, counting each of its calls in ``counts`` by how it ended and how long it took."""

            async def wrapper(*a: Any, **kw: Any) -> Any:
                t, outcome = time.monotonic(), ok
                try:
                    return await call(*a, **kw)
                except BaseException as exc:
                    outcome = type(exc).__name__
                    raise
                finally:
                    counts[f"{label}{outcome} in {within(time.monotonic() - t)} s"] += 1

            return wrapper

        timing_lease = timed(lease, leases, "", "answered")  # each work request
        timed_connect = timed(connect, looks, "dial ", "connected")  # each dial
        names_of = {str(sw.peer_id): n for n, sw in swarms.items()}
        failed_dials: dict[str, list[str]] = {}  # identity -> its last failed dials: whom, how, after how long

        async def timing_connect(self: Any, info: Any, *a: Any, **kw: Any) -> Any:
            t = time.monotonic()
            try:
                return await timed_connect(self, info, *a, **kw)
            except BaseException as exc:
                whom = names_of.get(str(info.peer_id)) or kind_of(info.peer_id)
                said = f"{whom}: {type(exc).__name__} {str(exc)[:160]} after {time.monotonic() - t:.1f} s"
                failed_dials.setdefault(names_of.get(str(self.peer_id), "?"), []).append(said)
                raise

        async def timing_find(swarm: Any, key: str, *a: Any, **kw: Any) -> Any:  # each role lookup: what it found
            t, found = time.monotonic(), None
            try:
                found = await find_role(swarm, key, *a, **kw)
                return found
            finally:
                what = "raised" if found is None else "found none" if not found else "found some"
                looks[f"{key.rsplit('/', 1)[-1]} lookup {what} in {within(time.monotonic() - t)} s"] += 1

        asked = discovery.providers_from_peer

        async def timing_asked(dht: Any, peer: Any, cid: str) -> Any:  # each question to a trusted peer
            t, outcome = time.monotonic(), "raised"
            try:
                found = await asked(dht, peer, cid)
                outcome = f"answered {'none' if not found else 'some'}"
                return found
            except BaseException as exc:
                outcome = type(exc).__name__
                raise
            finally:
                who = kind_of(peer)
                looks[f"trusted peer ({who}) {outcome} in {within(time.monotonic() - t)} s"] += 1

        asks, slow_asks = Counter(), Counter()  # each DHT request on a lazy stream to a trusted peer, by stage
        open_lazy = rpc.open_stream

        async def opening_lazy(host: Any, peer: Any, protocol: str, first: bytes = b"") -> Any:
            who = kind_of(peer)
            if protocol != KAD_PROTOCOL or who == "sampler":
                return await open_lazy(host, peer, protocol, first)
            t = time.monotonic()
            stream = await open_lazy(host, peer, protocol, first)  # the request leaves in the opening write
            asks[f"{who} open with the request in {within(time.monotonic() - t)} s"] += 1
            return TimedAsk(stream, who, asks, slow_asks, frames_on)

        closes, stream_close = Counter(), NetStream.close

        async def closing(self: Any) -> None:
            """Each stream close, by peer and whether its caller was cancelled already (before patch 10,
            yamux-cancelled-close, such a close kept its yamux backlog slot for the connection's life)."""
            who = kind_of(self.muxed_conn.peer_id)
            cancelled = trio.current_effective_deadline() == float("-inf")
            closes[f"to the {who}{', cancelled' if cancelled else ''}"] += 1
            await stream_close(self)

        NetStream.close = closing  # type: ignore[method-assign]
        rpc.open_stream = opening_lazy  # type: ignore[assignment]
        NodeSwarm.connect, discovery.find_role = timing_connect, timing_find  # type: ignore[method-assign]
        discovery.providers_from_peer = timing_asked  # type: ignore[assignment]
        TrainerClient.lease = timing_lease  # type: ignore[method-assign]
        NetStream.set_protocol, yamux.read_exactly = counting, reading  # type: ignore[method-assign]
        Multiselect.negotiate, BasicHost.new_stream = negotiating, opening  # type: ignore[method-assign]
        Network.add_conn, Network.remove_conn = adding, removing  # type: ignore[method-assign]
        for (cls, attr), name in jobs.items():
            setattr(cls, attr, tagged(unwrapped[cls, attr], name))
        trio.lowlevel.add_instrument(steps)
        gc.callbacks.append(gc_timer)
        t0 = time.thread_time()
        window_lag = LagProbe()  # the loop's lag over the whole window (the report's probe is emptied every 2 s)
        with trio.move_on_after(seconds):
            await window_lag.run()
        gc.callbacks.remove(gc_timer)
        trio.lowlevel.remove_instrument(steps)
        TrainerClient.lease = lease  # type: ignore[method-assign]
        NodeSwarm.connect, discovery.find_role = connect, find_role  # type: ignore[method-assign]
        discovery.providers_from_peer = asked  # type: ignore[assignment]
        rpc.open_stream = open_lazy  # type: ignore[assignment]
        NetStream.close = stream_close  # type: ignore[method-assign]
        NetStream.set_protocol, yamux.read_exactly = set_protocol, read_exactly  # type: ignore[method-assign]
        Multiselect.negotiate, BasicHost.new_stream = negotiate, new_stream  # type: ignore[method-assign]
        Network.add_conn, Network.remove_conn = add_conn, remove_conn  # type: ignore[method-assign]
        for (cls, attr), call in unwrapped.items():
            setattr(cls, attr, call)
        # the tasks alive at the window's end, by name: what waits (a backlog shows here)
        live: Counter = Counter(task.name for task in task_tree(trio.lowlevel.current_root_task()))
        lags = sorted(window_lag.samples)
        stuck = {}  # identities without the trainer at the window's end: where each of their tasks waits
        for task in nursery_ref[0].child_tasks:
            config = getattr(task.coro, "cr_frame", None) and task.coro.cr_frame.f_locals.get("config")
            name = getattr(getattr(config, "data_dir", None), "name", None)
            if name in roles and not roles[name].discovery.trainer_found.is_set():
                stuck[name] = {"waits": awaiting(task), "failed_dials": failed_dials.get(name, [])[-4:]}
        backlog: Counter = Counter()  # outbound yamux streams holding a backlog slot (of 256), per connection
        for sw in swarms.values():
            for peer, held in sw.host.get_network().get_connections_map().items():
                who = kind_of(peer)
                for conn in held:
                    mux = conn.muxed_conn
                    taken = mux.stream_backlog_limit - mux.stream_backlog_semaphore.value
                    backlog[f"to the {who}: {within(taken, (1, 8, 64, 256))} slots taken"] += 1
        write_json(root / f"profile-{args.first}.json", {
            "seconds": seconds, "identities": len(names), "loop_cpu": time.thread_time() - t0,
            "live_tasks": dict(live.most_common(12)), "tasks_alive": sum(live.values()),
            "lag_p50": pct(lags, 0.5), "lag_p99": pct(lags, 0.99), "leases": dict(sorted(leases.items())),
            "looks": dict(sorted(looks.items())), "asks": dict(sorted(asks.items())),
            "slow_asks": dict(slow_asks.most_common()), "backlog": dict(sorted(backlog.items())),
            "closes": dict(sorted(closes.items())),
            "tasks": steps.totals(), "streams": dict(streams.most_common()), "inbound": dict(inbound.most_common()),
            "outbound": dict(outbound.most_common()), "outbound_origins": dict(origins.most_common(20)),
            "frames": dict(frames.most_common()),
            "connections": dict(conns), "gc": gc_time, "gc_objects": len(gc.get_objects()), "stuck": stuck,
        })  # fmt: skip

    nursery_ref: list[Any] = []

    async def main() -> None:
        limiter = trio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, 2 * args.count + 8)  # identities wait on the batcher
        async with trio.open_nursery() as nursery:
            nursery_ref.append(nursery)
            nursery.start_soon(probe.run)
            nursery.start_soon(watch)
            nursery.start_soon(report)
            nursery.start_soon(dht_probe)
            if args.profile:
                nursery.start_soon(profile, *args.profile)
            for i, name in enumerate(names):
                nursery.start_soon(one, name, i * args.stagger)

    quiet_gc()  # what `swarmrl node` does before its loop runs
    trio.run(main)


class TimedAsk:
    """A lazy DHT stream to a trusted peer (node/libp2p/access.py ``_kad_request``), opened with its request: times
    the wait for its answer's first bytes into ``asks``. An answer that took 5 s or more, or none, is described in
    ``slow_asks``: how many yamux frames its connection read meanwhile (none: the connection, not the peer, was
    stalled), and whether bytes for it lay unread in its buffer at the end (the reading task was not woken)."""

    def __init__(self, stream: Any, who: str, asks: Counter, slow_asks: Counter, frames_on: Counter) -> None:
        self._stream, self._who, self._asks, self._slow, self._frames_on = stream, who, asks, slow_asks, frames_on
        self._asked = time.monotonic()  # the request is out: the wait for its answer starts now
        self._frames = frames_on[id(self._muxed()[1].secured_conn)]  # the connection's frame count then
        self._reading = self._answered = False  # a provide writes and closes: never read, not an ask

    def _muxed(self) -> tuple[Any, Any]:
        muxed = self._stream._stream.muxed_stream
        return muxed, muxed.muxed_conn

    async def read(self, n: int | None = None) -> bytes:
        self._reading = True
        data = await self._stream.read(n)
        if not self._answered:
            self._answered = True
            waited = time.monotonic() - self._asked
            self._asks[f"{self._who} answered in {within(waited)} s"] += 1
            if waited >= 5:
                self._describe(f"answered after {within(waited)} s")
        return data

    def _describe(self, outcome: str) -> None:
        muxed, conn = self._muxed()
        read = self._frames_on[id(conn.secured_conn)] - self._frames
        buffered = len(conn.stream_buffers.get(muxed.stream_id, b""))
        state = "reset" if muxed.reset_received else "ended" if muxed.recv_closed else "open"
        unread = "" if self._answered else f", {'bytes' if buffered else 'nothing'} unread"  # (an answer's rest is)
        self._slow[f"{self._who} {outcome}: connection read {within(read, (1, 10, 100))} frames meanwhile"
                   f"{unread}, stream {state}"] += 1  # fmt: skip

    async def close(self) -> None:
        if self._reading and not self._answered:
            self._asks[f"{self._who} not answered, closed after {within(time.monotonic() - self._asked)} s"] += 1
            self._describe("not answered")
        await self._stream.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def within(took: float, bounds: tuple[float, ...] = (1, 5, 10, 30)) -> str:
    """A duration's bucket label: "<b" for the first bound above it, else ">=" the last."""
    return next((f"<{b}" for b in bounds if took < b), f">={bounds[-1]}")


def task_tree(root: Any) -> Iterator[Any]:
    """``root`` and every trio task under it."""
    todo = [root]
    while todo:
        task = todo.pop()
        yield task
        todo.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)


def awaiting(root: Any) -> dict[str, int]:
    """Where every task under ``root`` waits, by its innermost three frames outside trio (a stack dump of a
    node's tasks)."""
    waits: Counter = Counter()
    for task in task_tree(root):
        frames, coro = [], task.coro
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                break
            if "/trio/" not in frame.f_code.co_filename:
                frames.append(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        waits[f"{task.name.rsplit('.', 1)[-1]} @ {' > '.join(frames[-3:])}"] += 1
    return dict(waits.most_common())


# -- the orchestrator ------------------------------------------------------------------------------------------------


class Run:
    """One N: the processes, their stats files, and the measurements."""

    def __init__(self, n: int, per_proc: int, root: Path, model: Path, args: argparse.Namespace) -> None:
        self.n, self.root, self.args = n, root, args
        self.procs: dict[str, subprocess.Popen] = {}
        root.mkdir(parents=True, exist_ok=True)
        py = [sys.executable, __file__]
        logs = root / "logs"
        logs.mkdir(exist_ok=True)

        def spawn(name: str, *extra: str) -> None:
            out = open(logs / f"{name}.log", "w")
            self.procs[name] = subprocess.Popen(
                [*py, *extra, "--root", str(root)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

        try:  # a loaded machine (load average 18 on 2 cores seen here) takes minutes to start a process
            spawn("boot", "boot", "--count", str(n))
            self._wait_file(root / "boot.addr", 300)
            rate = str(args.newcomer_rate)
            spawn("trainer", "trainer", "--model", str(model), "--newcomer-rate", rate, "--count", str(n),
                  "--weights", args.weights, "--learner", args.learner)  # fmt: skip
            self._wait_file(root / "trainer.json", 300)
        except BaseException:
            self.stop()
            raise
        k = max(1, -(-n // per_proc))
        for p in range(k):
            first, count = p * n // k, (p + 1) * n // k - p * n // k
            stagger = args.join_seconds / max(1, count)  # every process joins its identities over join_seconds
            profile = ["--profile", *map(str, args.profile)] if args.profile else []
            spawn(f"samplers{p}", "samplers", "--first", str(first), "--count", str(count), "--stagger", f"{stagger}",
                  "--pace", str(args.pace), "--weights", args.weights, *profile)  # fmt: skip
        self.k = k

    def _wait_file(self, path: Path, timeout: float) -> None:
        deadline = time.time() + timeout
        while not path.exists():
            if time.time() > deadline:
                raise TimeoutError(f"{path} did not appear in {timeout:.0f} s (see {self.root / 'logs'})")
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} (see {self.root / 'logs' / name}.log)")
            time.sleep(0.5)

    def trainer(self) -> dict[str, Any]:
        return json.loads((self.root / "trainer.json").read_text())

    def boot_lag(self) -> list[float]:
        """The bootstrap node's loop lag samples of the last 2 s (its process writes them); [] if unreadable."""
        try:
            return json.loads((self.root / "boot.json").read_text())["lag"]
        except (OSError, ValueError, KeyError):
            return []

    def boot_status(self) -> dict[str, Any]:
        """The bootstrap node's status.json (written every second by local_swarm's nodes); {} if unreadable."""
        try:
            return json.loads((self.root / "bootstrap" / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def samplers(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        stats: dict[str, Any] = {}
        procs = []
        for f in sorted(self.root.glob("procs-*.json")):
            try:
                d = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            stats.update(d["samplers"])
            procs.append(d)
        return stats, procs

    def cpu(self) -> dict[str, float]:
        return {name: proc_cpu(p.pid) for name, p in self.procs.items()}

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.procs.items() if p.poll() is not None]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def progress(run: Run, t0: float) -> dict[str, Any]:
    from node.settings import TrainerSettings

    t = run.trainer()
    stats, _ = run.samplers()
    found = sum(1 for s in stats.values() if "trainer_found" in s)
    working = sum(1 for s in stats.values() if s["accepted"] > 0)
    # past its trusted_after groups a sampler no longer draws on the trainer's newcomer budgets: settled
    settled_at = TrainerSettings().trusted_after * TRAINER["group_size"]
    settled = sum(1 for s in stats.values() if s["accepted"] >= settled_at)
    engines = sum(1 for s in stats.values() if s["installed"])  # a sampler works only once it holds a version
    lag = t["lag"]
    print(
        f"  N={run.n} t={time.time() - t0:5.0f}s joined {sum('joined' in s for s in stats.values())}/{run.n} "
        f"found trainer {found} with an engine {engines} accepted>0 {working} settled {settled} | trainer: groups "
        f"{t['groups_accepted']} "
        f"step {t['step']} "
        f"v{t['version']} peers {t['peers']} conns {t['connections']} lag p99 {pct(lag, 0.99) * 1e3:.0f} ms "
        f"rss {t['rss_mb']:.0f} MB busy-leases {t['leases_busy']} dead {run.dead()}",
        flush=True,
    )
    return {"working": working, "settled": settled, "trainer": t}


def measure(run: Run, window: float) -> dict[str, Any]:
    """A steady window: rates from the counters' deltas, the versions published inside it and how they spread."""
    t_a, cpu_a, m_a = run.trainer(), run.cpu(), machine_cpu()
    s_a, _ = run.samplers()
    lags: list[float] = []
    finds: list[dict[str, float]] = []
    proc_lags: list[float] = []
    boot_lags: list[float] = []
    start = time.time()
    while time.time() - start < window:
        time.sleep(2.0)
        lags += run.trainer()["lag"]
        boot_lags += run.boot_lag()
        for d in run.samplers()[1]:
            proc_lags += d["lag"]
            finds += d["finds"]
    time.sleep(0.5)
    t_b, cpu_b, m_b, boot = run.trainer(), run.cpu(), machine_cpu(), run.boot_status()
    s_b, procs = run.samplers()
    dt = t_b["time"] - t_a["time"]
    groups = t_b["groups_accepted"] - t_a["groups_accepted"]
    trainer_cpu = cpu_b["trainer"] - cpu_a["trainer"]
    sampler_cpu = sum(cpu_b[k] - cpu_a.get(k, 0) for k in cpu_b if k.startswith("samplers"))
    busy, total = m_b[0] - m_a[0], m_b[1] - m_a[1]
    # a version published in the window (or shortly before): seconds from its announcement to each sampler
    spread = []
    for v, at in t_b["published"].items():
        if not (start - 10 <= at <= time.time() - 15):
            continue
        heard = [s["heard"][v] - at for s in s_b.values() if v in s.get("heard", {})]
        inst = [s["installed"][v] - at for s in s_b.values() if v in s.get("installed", {})]
        inst_or_later = []
        for s in s_b.values():
            later = [s["installed"][u] for u in s.get("installed", {}) if int(u) >= int(v)]
            if later:
                inst_or_later.append(min(later) - at)
        spread.append({"version": int(v), "heard": heard, "installed": inst, "installed_or_later": inst_or_later})
    end = time.time()
    # every (sampler, version) rebuilt inside the window: the term of the samplers' CPU that grows with N x versions/s
    installs = sum(1 for s in s_b.values() for at in s.get("installed", {}).values() if start <= at <= end)
    live = [s for s in s_b.values() if "joined" in s]
    to_trainer = [s["trainer_found"] - s["started"] for s in s_b.values() if "trainer_found" in s]
    accepted_by = {n: s_b[n]["accepted"] - s_a.get(n, {}).get("accepted", 0) for n in s_b}
    errors = sorted({s["last_error"][:90] for s in s_b.values() if s.get("last_error")})
    return {
        "n": run.n,
        "procs": run.k,
        "seconds": dt,
        "groups_per_s": groups / dt,
        "rollouts_per_s": groups * TRAINER["group_size"] / dt,
        "samplers_accepting": sum(1 for v in accepted_by.values() if v > 0),
        "samplers_joined": len(live),
        # a sampler samples only once it has installed a version: at N = 256 the stall was newcomers without one
        "samplers_with_engine": sum(1 for s in s_b.values() if s.get("installed")),
        "trainer_cores": trainer_cpu / dt,
        "trainer_cpu_per_group": trainer_cpu / max(groups, 1),
        "sampler_cores": sampler_cpu / dt,
        "sampler_cpu_per_group": sampler_cpu / max(groups, 1),
        "verify_per_s": (t_b["verify_seconds"] - t_a["verify_seconds"]) / dt,
        "verify_per_group": (t_b["verify_seconds"] - t_a["verify_seconds"]) / max(groups, 1),
        "learn_per_s": (t_b["busy_seconds"] - t_a["busy_seconds"]) / dt,
        "steps": t_b["step"] - t_a["step"],
        "installs_per_s": installs / dt,
        "lag_p50_ms": pct(lags, 0.5) * 1e3,
        "lag_p99_ms": pct(lags, 0.99) * 1e3,
        "lag_max_ms": max(lags, default=float("nan")) * 1e3,
        "sampler_lag_p99_ms": pct(proc_lags, 0.99) * 1e3,
        "boot_lag_p50_ms": pct(boot_lags, 0.5) * 1e3,
        "boot_lag_p99_ms": pct(boot_lags, 0.99) * 1e3,
        "machine_busy": busy / total * os.cpu_count(),
        "cores": os.cpu_count(),
        "swarm_cores": (trainer_cpu + sampler_cpu + sum(cpu_b[k] - cpu_a.get(k, 0) for k in ("boot",))) / dt,
        "trainer_connections": t_b["connections"],
        "trainer_peers": t_b["peers"],
        "trainer_rss_mb": t_b["rss_mb"],
        "conn_counts": t_b["conn_counts"],
        # inbound DHT streams over the run: served, refused (every slot taken: the asker's lookup fails), cut at the
        # 10 s bound; the bootstrap node is every newcomer's first DHT peer
        "trainer_dht_streams": t_b.get("dht_streams", {}),
        "boot_dht_streams": boot.get("dht_streams", {}),
        "boot_connmgr": boot.get("connmgr", {}),
        # what the samplers' connection managers closed, and why, over the whole run (dead: no pong and nothing heard)
        "sampler_conn_counts": dict(sum((Counter(s.get("conn_counts", {})) for s in s_b.values()), Counter())),
        "sampler_connections_mean": statistics.fmean([s["connections"] for s in live]) if live else 0,
        # gossip messages each sampler's handlers got per second (announcements: the trainer's, and every sampler's
        # on installing a version): on one box the N hosts pay N times this
        "gossip_per_sampler_s": statistics.fmean(
            [(s_b[n].get("gossip", 0) - s_a.get(n, {}).get("gossip", 0)) / dt for n in s_b]
        )
        if s_b
        else 0.0,
        "spread": spread,
        "dht_find_trainer_s": [f["seconds"] for f in finds if f["role"] == "trainer"],
        "dht_find_sampler_s": [f["seconds"] for f in finds if f["role"] == "sampler"],
        "dht_found_samplers": [f["found"] for f in finds if f["role"] == "sampler"],
        "join_to_trainer_s": to_trainer,
        "leases_busy": t_b["leases_busy"] - t_a["leases_busy"],
        "leases_issued": t_b["leases_issued"] - t_a["leases_issued"],
        "rate_limited": t_b["rate_limited"] - t_a["rate_limited"],
        "rejected": t_b["groups_rejected"] - t_a["groups_rejected"],
        "forged": t_b["groups_forged"],
        "strikes": sum(s["strikes"] for s in s_b.values()),
        "join_errors": sorted({s["error"][:90] for s in s_b.values() if "error" in s}),
        "errors": errors,
        "dead": run.dead(),
        "batch_rows": sum(d["rows"] for d in procs) / max(1, sum(d["batches"] for d in procs)),
    }


def summarize_spread(spread: list[dict[str, Any]], n: int, key: str) -> tuple[float, float]:
    """Median over versions of the time to 50% and to 99% of the N samplers (inf: never got there)."""
    p50, p99 = [], []
    for s in spread:
        t = sorted(s[key])
        p50.append(t[int(0.5 * n) - 1] if len(t) >= int(0.5 * n) else float("inf"))
        k99 = max(1, int(0.99 * n))
        p99.append(t[k99 - 1] if len(t) >= k99 else float("inf"))
    return (statistics.median(p50) if p50 else float("nan"), statistics.median(p99) if p99 else float("nan"))


def one_n(n: int, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    root = RUNS / f"n{n}"
    if root.exists():
        subprocess.run(["rm", "-rf", str(root)], check=True)
    t0 = time.time()
    print(f"N={n}: starting a bootstrap node, the trainer and {n} samplers", flush=True)
    run = Run(n, args.per_proc, root, model, args)
    try:
        deadline = t0 + args.ramp
        while time.time() < deadline:
            time.sleep(5)
            p = progress(run, t0)
            if p["settled"] >= 0.95 * n and time.time() - t0 > args.join_seconds + 20:
                break  # a steady state: the samplers past their newcomer budgets, not still earning a record
            if run.dead():
                break
        ramp = time.time() - t0
        print(f"N={n}: measuring {args.window:.0f} s of steady state (ramp took {ramp:.0f} s)", flush=True)
        result = measure(run, args.window)
        result["ramp_s"] = ramp
        progress(run, t0)
    finally:
        run.stop()
    result["announce_50_s"], result["announce_99_s"] = summarize_spread(result["spread"], n, "heard")
    result["install_50_s"], result["install_99_s"] = summarize_spread(result["spread"], n, "installed_or_later")
    print(report_line(result), flush=True)
    for prof in sorted(root.glob("profile-*.json"), key=lambda f: int(f.stem.split("-")[1])):
        print(profile_lines(json.loads(prof.read_text()), title=prof.stem), flush=True)
    return result


def profile_lines(p: dict[str, Any], top: int = 15, title: str = "profile-0") -> str:
    """The --profile summary: the loop's CPU per host, by task and streams negotiated per host (one process)."""
    n, secs = p["identities"], p["seconds"]
    lines = [f"{title}, sampler process of {n} hosts, {secs:.0f} s: loop {p['loop_cpu'] / secs:.2f} cores, "
             f"{p['loop_cpu'] / secs / n * 1e3:.1f} ms/s per host, loop lag p50/p99 "
             f"{p.get('lag_p50', float('nan')):.2f}/{p.get('lag_p99', float('nan')):.2f} s, "
             f"{p.get('tasks_alive', 0)} tasks alive"]  # fmt: skip
    for name, (cpu, steps) in list(p["tasks"].items())[:top]:
        lines.append(f"  {cpu / secs / n * 1e3:6.2f} ms/s per host {steps / secs / n:7.1f} steps/s  {name}")
    for proto, count in p["streams"].items():
        lines.append(f"  {count / secs / n:6.3f} streams/s per host  {proto}")
    for outcome, count in p.get("inbound", {}).items():
        lines.append(f"  {count / secs / n:6.3f} inbound streams/s per host  {outcome}")
    for outcome, count in p.get("outbound", {}).items():
        lines.append(f"  {count / secs / n:6.3f} outbound streams/s per host  {outcome}")
    for kind, count in p.get("frames", {}).items():
        lines.append(f"  {count / secs / n:6.2f} yamux frames read/s per host  {kind}")
    for what, count in p.get("connections", {}).items():
        lines.append(f"  {count / secs / n:6.3f} connections {what}/s per host")
    counted = (("looks", "dials and role lookups"), ("asks", "DHT requests to trusted peers"),
               ("closes", "stream closes"), ("backlog", "connections by yamux backlog"),
               ("leases", "work requests"))  # fmt: skip
    for key, heading in counted:
        if p.get(key):
            lines.append(f"  {heading}: " + ", ".join(f"{k} {v}" for k, v in p[key].items()))
    for what, count in p.get("slow_asks", {}).items():
        lines.append(f"  {count:6d} slow: {what}")
    for task, count in p.get("live_tasks", {}).items():
        lines.append(f"  {count / n:7.1f} tasks alive per host  {task}")
    for gen, (cpu, runs, _) in sorted(p.get("gc", {}).items()):
        lines.append(f"  {cpu / secs / n * 1e3:6.2f} ms/s per host in {runs / secs:.2f} {gen} collections/s "
                     f"(the process holds {p.get('gc_objects', 0):,} objects)")  # fmt: skip
    return "\n".join(lines)


def report_line(r: dict[str, Any]) -> str:
    def med(xs: list[float] | dict[str, float]) -> float:
        if isinstance(xs, dict):  # a result read back from the results file: summarised there
            return xs["p50"]
        return statistics.median(xs) if xs else float("nan")

    def join(key: str, q: float) -> float:
        xs = r["join_to_trainer_s"]
        return xs[f"p{int(q * 100)}"] if isinstance(xs, dict) else pct(xs, q)

    return (
        f"N={r['n']:5d} ({r['procs']} sampler procs): {r['groups_per_s']:6.2f} groups/s accepted "
        f"({r['samplers_accepting']}/{r['samplers_joined']} samplers accepting, "
        f"{r.get('samplers_with_engine', float('nan'))} with an engine) | trainer {r['trainer_cores']:.2f} "
        f"cores, {r['trainer_cpu_per_group'] * 1e3:.1f} ms CPU/group, verify {r['verify_per_s']:.2f} s/s, "
        f"lag p50/p99/max {r['lag_p50_ms']:.0f}/{r['lag_p99_ms']:.0f}/{r['lag_max_ms']:.0f} ms, "
        f"{r['trainer_connections']} conns, RSS {r['trainer_rss_mb']:.0f} MB | samplers {r['sampler_cores']:.2f} "
        f"cores, {r.get('gossip_per_sampler_s', float('nan')):.1f} gossip msgs/s each "
        f"({r['sampler_cpu_per_group'] * 1e3:.0f} ms CPU/group), loop lag p99 {r['sampler_lag_p99_ms']:.0f} ms | "
        f"bootstrap loop lag p50/p99 {r.get('boot_lag_p50_ms', float('nan')):.0f}/"
        f"{r.get('boot_lag_p99_ms', float('nan')):.0f} ms; "
        f"machine busy {r['machine_busy']:.2f}/{r['cores']} cores, this swarm's share {r['swarm_cores']:.2f} "
        f"| version heard 50/99% {r['announce_50_s']:.1f}/{r['announce_99_s']:.1f} s, "
        f"installed 50/99% {r['install_50_s']:.1f}/{r['install_99_s']:.1f} s | DHT find trainer "
        f"{med(r['dht_find_trainer_s']):.2f} s, samplers {med(r['dht_find_sampler_s']):.2f} s | join->trainer "
        f"p50/p99 {join('join_to_trainer_s', 0.5):.1f}/{join('join_to_trainer_s', 0.99):.1f} s | leases busy "
        f"{r['leases_busy']} of {r['leases_busy'] + r['leases_issued']}, rate-limited {r['rate_limited']}, "
        f"rejected {r['rejected']}, forged {r['forged']}, strikes {r['strikes']} | dead {r['dead']} "
        f"join errors {r['join_errors']} errors {r['errors'][:3]} | connection managers: the trainer's "
        f"{r['conn_counts']}, the samplers' {r['sampler_conn_counts']}, the bootstrap's {r.get('boot_connmgr', {})} "
        f"| inbound DHT streams: the bootstrap's "
        f"{r.get('boot_dht_streams', {})}, the trainer's {r.get('trainer_dht_streams', {})}"
    )


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if n > 1 and sxx > 0 else 0.0
    return my - b * mx, b


@dataclass(frozen=True)
class Capacity:
    """docs/capacity.md section 6: the swarm on one box. Each sampler host costs ``h`` CPU-s per second (upkeep and
    its groups at the offered pace) plus ``c_v`` per version it rebuilds; the trainer ``t`` CPU-s per second per
    sampler (its upkeep and its groups: at a fixed pace the two grow together and cannot be told apart); N samplers
    offer ``x_1`` groups/s each; a version every ``groups_per_version`` groups, which every sampler rebuilds."""

    h: float
    c_v: float
    t: float
    x_1: float
    groups_per_version: float

    def throughput(self, n: float, cores: float, procs: int) -> float:
        """Accepted groups/s: what N samplers offer, unless the CPU needed to rebuild every version on N hosts
        (trainer included) is more than ``cores``, or more than one core in one of the ``procs`` sampler processes."""
        per_version = n * self.c_v / self.groups_per_version  # the samplers' CPU-s per accepted group, in rebuilds
        if per_version <= 0:  # versions cost nothing to install (patches): the hosts' own CPU binds, and past it
            # each gets that share of what it needs (the upkeep was fitted at the offered pace, groups included)
            return n * self.x_1 * min(1.0, cores / (n * (self.h + self.t)), procs / (n * self.h))
        by_cpu = (cores - n * (self.h + self.t)) / per_version
        by_procs = (procs - n * self.h) / per_version
        return max(0.0, min(n * self.x_1, by_cpu, by_procs))

    def saturation(self, cores: float, per_proc: int) -> float:
        """The first N whose throughput falls short of what it offers (the knee of X(N)), to 0.1 sampler."""
        n = 1.0
        while n < 4096 and self.throughput(n, cores, -(-int(n) // per_proc)) >= 0.999 * n * self.x_1:
            n += 0.1
        return n


def fit_capacity(runs: list[dict[str, Any]], x_1: float) -> Capacity:
    """Least squares over ``runs`` (unsaturated ones: every rebuild there is a rebuild a real sampler pays):
    sampler cores / N = h + c_v x installs/s / N, and trainer cores / N = t."""
    h, c_v = fit_line([r["installs_per_s"] / r["n"] for r in runs], [r["sampler_cores"] / r["n"] for r in runs])
    t = statistics.fmean(r["trainer_cores"] / r["n"] for r in runs)
    return Capacity(h, c_v, t, x_1, GROUPS_PER_VERSION)


def free_cores(r: dict[str, Any]) -> float:
    """The cores the swarm could have had: the box's, less what other jobs used during its window."""
    return r["cores"] - max(0.0, r["machine_busy"] - r["swarm_cores"])


def usable(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """The runs with accepted groups, the unsaturated ones among them (at least 90% of their offer accepted), and
    x_1, groups/s per sampler at the smallest N (its samplers short of nothing)."""
    versions = {r["n"]: r["steps"] / TRAINER["publish_every"] / r["seconds"] for r in results}  # older results
    ok = [{**r, "installs_per_s": r.get("installs_per_s", r["n"] * versions[r["n"]])} for r in results]
    ok = [r for r in ok if r["groups_per_s"] > 0]
    x_1 = ok[0]["groups_per_s"] / ok[0]["n"] if ok else float("nan")
    return ok, [r for r in ok if r["groups_per_s"] >= 0.9 * r["n"] * x_1], x_1


def capacity_check(results: list[dict[str, Any]]) -> list[str]:
    """The model of docs/capacity.md section 6 fitted to the unsaturated runs, its prediction at every N (that N
    left out of the fit), and its saturation point against the measured one."""
    ok, unsaturated, x_1 = usable(results)
    if len(ok) < 3:
        return ["capacity check: fewer than 3 N with accepted groups"]
    if len(unsaturated) < 2:
        return ["capacity check: fewer than 2 unsaturated N to fit the model on"]
    model = fit_capacity(unsaturated, x_1)
    per_proc = max(-(-r["n"] // r["procs"]) for r in ok)
    cores = statistics.median(free_cores(r) for r in ok)
    lines = [
        "capacity check (docs/capacity.md, section 6), fitted on the unsaturated N "
        f"({', '.join(str(r['n']) for r in unsaturated)}): per sampler host h = {model.h * 1e3:.1f} ms CPU/s + "
        f"c_v = {model.c_v * 1e3:.0f} ms CPU per version rebuilt; trainer t = {model.t * 1e3:.2f} ms CPU/s per "
        f"sampler; x_1 = {x_1:.3f} groups/s per sampler; a version every "
        f"{model.groups_per_version:.0f} groups",
    ]
    for r in ok:
        fit_on = [u for u in unsaturated if u["n"] != r["n"]]
        m = fit_capacity(fit_on, x_1) if len(fit_on) >= 2 else model
        note = "" if len(fit_on) >= 2 else " (in the fit: too few other unsaturated N to leave it out)"
        pred = m.throughput(r["n"], free_cores(r), r["procs"])
        lines.append(
            f"  N={r['n']:4d} ({r['procs']} procs, {free_cores(r):.2f} free cores): measured "
            f"{r['groups_per_s']:6.2f} groups/s of {r['n'] * x_1:.2f} offered, predicted {pred:6.2f} "
            f"({pred / r['groups_per_s']:.2f}x){note}"
        )
    n_sat = model.saturation(cores, per_proc)
    short = [r["n"] for r in ok if r["groups_per_s"] < 0.9 * r["n"] * x_1]
    below = [r["n"] for r in unsaturated]
    bracket = short and any(n < min(short) for n in below)
    measured = (f"between N={max(n for n in below if n < min(short))} and N={min(short)} (the first N under 90% "
                "of its offer)") if bracket else "not bracketed by these N"  # fmt: skip
    lines.append(
        f"  saturation ({cores:.2f} free cores, {per_proc} samplers per process): predicted N_sat = {n_sat:.1f} "
        f"samplers ({n_sat * x_1:.2f} groups/s); measured {measured}"
    )
    return lines


def earlier_results(skip: set[int], name: str) -> list[dict[str, Any]]:
    """The per-N results already in bench/results/<name>.txt, but for the N in ``skip`` (``--merge``: a loaded
    box leaves only short quiet windows, so the N are measured in separate runs)."""
    path = RESULTS / f"{name}.txt"
    if not path.exists():
        return []
    lines = path.read_text().split("raw (per N):", 1)[-1].splitlines()
    out = []
    for line in lines:
        if line.startswith("{"):
            r = json.loads(line)
            if r["n"] not in skip:
                out.append({**r, "spread": [], "merged": True})
    return out


def write_results(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    if args.merge:
        results = sorted(results + earlier_results({r["n"] for r in results}, args.results), key=lambda r: r["n"])
    RESULTS.mkdir(exist_ok=True)
    lines = [
        "bench/swarm_scale: one trainer, N real sampler hosts on loopback (K processes of N/K identities, one shared",
        f"torch engine per process), embedded tiny model, group size {TRAINER['group_size']}, max tokens "
        f"{TRAINER['max_tokens']}, batch {TRAINER['batch_groups']} groups; {os.cpu_count()} cores shared with "
        f"other jobs; window {args.window:.0f} s; newcomer_rate {args.newcomer_rate}",
        f"run: {' '.join(sys.argv)}",
        "",
    ]
    lines += [report_line(r) for r in results]
    lines += ["", *capacity_check(results)]
    lines += ["", "raw (per N):"]
    for r in results:
        raw = {k: v for k, v in r.items() if k not in ("spread",)}
        if r.get("merged"):
            lines.append(json.dumps(raw, default=float))
            continue
        raw["spread"] = [
            {
                "version": s["version"],
                "heard_n": len(s["heard"]),
                "installed_n": len(s["installed_or_later"]),
                "heard_p50": pct(s["heard"], 0.5),
                "installed_p50": pct(s["installed_or_later"], 0.5),
                "installed_p99": pct(s["installed_or_later"], 0.99),
            }
            for s in r["spread"]
        ]
        for key in ("dht_find_trainer_s", "dht_find_sampler_s", "join_to_trainer_s", "dht_found_samplers"):
            xs = r[key]
            raw[key] = {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99)}
        lines.append(json.dumps(raw, default=float))
    (RESULTS / f"{args.results}.txt").write_text("\n".join(lines) + "\n")
    plot(results, args.results)


def plot(results: list[dict[str, Any]], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in results]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].plot(ns, [r["groups_per_s"] for r in results], "o-", label="accepted groups/s")
    ax[0].plot(ns, [r["trainer_cores"] for r in results], "s--", label="trainer cores")
    ax[0].plot(ns, [r["verify_per_s"] for r in results], "^--", label="verification s/s")
    ax[0].plot(ns, [r["machine_busy"] for r in results], "k:", label="machine busy cores")
    ok, unsaturated, x_1 = usable(results)
    if len(unsaturated) >= 2:
        model = fit_capacity(unsaturated, x_1)
        per_proc = max(-(-r["n"] // r["procs"]) for r in ok)
        cores = statistics.median(free_cores(r) for r in ok)
        grid = [2 ** (i / 8) for i in range(8, 8 * 10 + 1) if 2 ** (i / 8) <= 2 * max(ns)]
        model_x = [model.throughput(n, cores, -(-int(n) // per_proc)) for n in grid]
        ax[0].plot(grid, model_x, "-", color="gray", alpha=0.6, label="model: accepted groups/s")
    ax[0].set_title("throughput and where it goes")
    ax[1].plot(ns, [r["trainer_cpu_per_group"] * 1e3 for r in results], "o-", label="trainer ms CPU/group")
    ax[1].plot(ns, [r["lag_p99_ms"] for r in results], "s-", label="trainer loop lag p99 (ms)")
    ax[1].plot(ns, [r["trainer_rss_mb"] for r in results], "^-", label="trainer RSS (MB)")
    ax[1].set_title("trainer costs")
    ax[2].plot(ns, [r["announce_99_s"] for r in results], "o-", label="announcement to 99% (s)")
    ax[2].plot(ns, [r["install_50_s"] for r in results], "s-", label="version installed by 50% (s)")
    ax[2].plot(ns, [r["install_99_s"] for r in results], "^-", label="version installed by 99% (s)")
    ax[2].set_title("a version's spread")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("samplers N")
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    for name in ("boot", "trainer", "samplers"):
        p = sub.add_parser(name)
        p.add_argument("--root", required=True)
        p.add_argument("--model")
        p.add_argument("--newcomer-rate", type=float, default=4.0)
        p.add_argument("--first", type=int, default=0)
        p.add_argument("--count", type=int, default=1)
        p.add_argument("--stagger", type=float, default=0.1)
        p.add_argument("--pace", type=float, default=0.0)
        p.add_argument("--profile", type=float, nargs=2)
        p.add_argument("--weights", default="{}")
        p.add_argument("--learner", default="{}")
    ap.add_argument("--n", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--per-proc", type=int, default=32, help="sampler identities per process")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured per N")
    ap.add_argument("--ramp", type=float, default=420.0, help="most seconds to wait for the samplers to work")
    ap.add_argument("--join-seconds", type=float, default=30.0, help="each process starts its identities over this")
    ap.add_argument("--newcomer-rate", type=float, default=4.0, help="the trainer's newcomer budget (groups/s)")
    ap.add_argument("--pace", type=float, default=0.0,
                    help="seconds one sampler takes per group at the least (an emulated machine's speed; 0: as fast "
                    "as this box's share allows)")  # fmt: skip
    ap.add_argument("--profile", type=float, nargs=2, metavar=("START", "SECONDS"),
                    help="time the first sampler process's loop by task for SECONDS from START s after it starts "
                    "(runs/swarm_scale/n<N>/profile-0.json: CPU-seconds by task)")  # fmt: skip
    ap.add_argument("--learner", default="{}",
                    help="the trainer's [learner] knobs, as JSON. The embedded model's lr (3e-4) changes every weight: "
                    "every version is a full one. RL post-training's rate, published in bf16, makes patch versions: "
                    '{"lr": 1e-6, "publish_dtype": "bf16"}')  # fmt: skip
    ap.add_argument("--weights", default="{}", help="[weights] knobs for every node, as JSON (e.g. a poll interval)")
    ap.add_argument("--no-write", action="store_true", help="print only (a smoke run)")
    ap.add_argument("--merge", action="store_true", help="keep the other N's results already in the results file")
    ap.add_argument("--results", default="swarm_scale",
                    help="bench/results/<this>.txt and .png (a series at other settings: another name)")  # fmt: skip
    args = ap.parse_args()
    if args.cmd is not None:
        from node.cli import setup_logging

        setup_logging(False)  # INFO to the process's log file (runs/swarm_scale/n<N>/logs/)
    if args.cmd == "boot":
        return boot_main(args)
    if args.cmd == "trainer":
        return trainer_main(args)
    if args.cmd == "samplers":
        return samplers_main(args)
    from node.base_model import ensure_base_model

    RUNS.mkdir(parents=True, exist_ok=True)
    model = ensure_base_model(RUNS / "base-model")
    results = []
    for n in args.n:
        results.append(one_n(n, args, model))
        if not args.no_write:
            write_results(results, args)


if __name__ == "__main__":
    main()
