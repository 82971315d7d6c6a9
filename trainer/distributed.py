"""The ranks of a sharded trainer: joining the process group, and the one place that decides their work.

Rank 0 is the node. It decides every command (open the learner, step with its batch, score, generate for
evaluation, write a version, checkpoint, restore, ping, stop) and broadcasts it over a gloo group; every rank then
runs it together, because the collectives inside (FSDP's all-gathers and reduce-scatters) need all of them. Ranks
1..N-1 do nothing else: ``serve`` receives a command, runs it, and waits for the next, until ``stop``.

A rank that dies closes its sockets, so the collective in flight fails on the others; rank 0 then names it. Every
rank's pid and host are gathered when the group forms: a rank on this host is dead when its process is gone (or
is a child of rank 0 that exited), and ``dead()`` lets the node poll that between commands too. A worker whose
command fails exits at once (a rank left waiting in a collective would hang), and rank 0 names it the same way.
Workers started by rank 0 (``spawn``) also die with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective waits this long; rank 0 pings workers well within it
PING_EVERY = 60.0  # seconds between rank 0's pings while it has no other command (node/roles/ranks.py)
DEATH_GRACE = 10.0  # seconds a failed collective waits for a rank's death to show before saying "unknown"


class RankFailed(RuntimeError):
    """A rank of a sharded trainer died or failed: the whole trainer stops (restart it to resume)."""


@dataclass
class Ranks:
    """This process's place in the group, and what rank 0 knows of the others."""

    rank: int
    world: int
    device: torch.device
    control: Any  # the gloo group commands and small objects travel on
    pids: list[int]
    hosts: list[str]
    children: dict[int, subprocess.Popen] = field(default_factory=dict)  # rank -> process, where rank 0 spawned it
    _mesh: Any = None

    @property
    def mesh(self) -> Any:
        """The 1-D device mesh FSDP shards over."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh

    def dead(self) -> list[str]:
        """The other ranks known to be gone, each described (rank, pid, how it ended)."""
        out = []
        me = socket.gethostname()
        for r in range(self.world):
            if r == self.rank:
                continue
            child = self.children.get(r)
            code = child.poll() if child is not None else None
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                out.append(f"rank {r} (pid {self.pids[r]}, {how})")
            elif child is None and self.hosts[r] == me and not process_alive(self.pids[r]):
                out.append(f"rank {r} (pid {self.pids[r]}, gone)")
        return out

    def failure(self, exc: BaseException | None, grace: float = DEATH_GRACE) -> RankFailed:
        """The error that names the dead rank(s), waiting up to ``grace`` seconds for a death to show."""
        deadline = time.monotonic() + grace
        dead = self.dead()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.1)
            dead = self.dead()
        what = ", ".join(dead) if dead else "a rank (none seen dead; a collective failed)"
        detail = f": {exc}" if exc is not None else ""
        return RankFailed(f"trainer {what} died; the sharded trainer stops{detail}")


def process_alive(pid: int) -> bool:
    """A process on this host that has not exited (a zombie counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def backend_for(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def join(rank: int, world: int, init_method: str, device: torch.device) -> Ranks:
    """Join the group (rank 0 hosts its store at ``init_method``), with a gloo group for commands."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    info: list[Any] = [None] * world
    dist.all_gather_object(info, (os.getpid(), socket.gethostname()), group=control)
    return Ranks(rank, world, device, control, [p for p, _ in info], [h for _, h in info])


def join_from_env(device_type: str) -> Ranks:
    """Join as torchrun started this process (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    return join(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", device)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, device_type: str = "cpu", log_dir: Path | None = None) -> Ranks:
    """Start ranks 1..world-1 as child processes of this one (rank 0) on this host, and join them."""
    port = free_port()
    init = f"tcp://127.0.0.1:{port}"
    children = {}
    for r in range(1, world):
        argv = [sys.executable, "-P", "-m", "trainer.rank_worker", "--rank", str(r), "--world", str(world)]
        argv += ["--init", init, "--device", device_type, "--parent", str(os.getpid())]
        out = open(log_dir / f"rank{r}.log", "ab") if log_dir is not None else None
        children[r] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    ranks = join(0, world, init, device)
    ranks.children = children
    return ranks


def die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent exits (a worker never outlives rank 0)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took
        os._exit(1)


def leave(ranks: Ranks, wait: float = 30.0) -> None:
    """Tear the group down; reap spawned workers (they exit after ``stop``)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for child in ranks.children.values():
        try:
            child.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class Leader:
    """Rank 0's end of the command channel: each command is broadcast, then run here; one at a time (the
    learner is called from several threads: training, verification, version writes)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.lock = threading.Lock()
        self.last = time.monotonic()  # when the last command was sent
        self.stopped = False
        self.failed: RankFailed | None = None  # why the ranks stopped, when a command failed

    def call(self, name: str, args: tuple, run: Callable[[], Any]) -> Any:
        """Broadcast (name, args) to every worker, then ``run()`` rank 0's part; a failure names the dead rank."""
        with self.lock:
            if self.stopped:
                raise RankFailed(f"the sharded trainer has stopped; {name!r} cannot run")
            try:
                dist.broadcast_object_list([(name, args)], src=0, group=self.ranks.control)
                self.last = time.monotonic()
                return run()
            except RankFailed as exc:
                self.stopped, self.failed = True, self.failed or exc
                raise
            except Exception as exc:  # the workers went on into collectives rank 0 will never join: all stop
                self.stopped = True
                if self.ranks.dead() or _is_comm_error(exc):
                    self.failed = self.ranks.failure(exc)
                else:
                    why = f"{type(exc).__name__}: {exc}"
                    self.failed = RankFailed(f"rank 0 failed in {name!r} ({why}); the sharded trainer stops")
                raise self.failed from exc

    def ping(self) -> None:
        """A no-op command: it keeps idle workers' waits short of the collective timeout, and finds dead ranks."""
        self.call("ping", (), lambda: None)

    def stop(self) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            try:
                dist.broadcast_object_list([("stop", ())], src=0, group=self.ranks.control)
            except Exception as exc:  # a dead worker: nothing left to stop
                log.debug("stop: %s", exc)


def _is_comm_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(w in text for w in ("gloo", "connection", "nccl", "timed out", "timeout", "broken pipe", "peer"))


def serve(ranks: Ranks, target: Any) -> None:
    """A worker's loop: run each command rank 0 broadcasts on ``target`` (its method of that name) until ``stop``.
    A command that fails, or a lost rank 0, ends the process (its peers then name it)."""
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=ranks.control)
        except Exception as exc:
            log.error("rank %d: rank 0 is gone (%s); exiting", ranks.rank, exc)
            os._exit(3)
        name, args = box[0]
        if name == "stop":
            return
        if name == "ping":
            continue
        try:
            getattr(target, name)(*args)
        except Exception:
            log.exception("rank %d: command %r failed; exiting", ranks.rank, name)
            sys.stderr.flush()
            os._exit(1)
