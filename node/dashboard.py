"""The trainer's live dashboard: a read-only web page (127.0.0.1 by default) that refreshes itself.

``GET /`` is the page (node/dashboard.html, no external assets: it works offline); ``GET /api/state`` is the
JSON it draws: every peer with its role, version held, rollouts accepted and refused, strikes and bytes served;
the version timeline of the trainer and of every sampler; reward and accuracy curves; the trainer's busy
fraction. Samplers' versions and bytes served are their own reports (sent with each work request) and are
labelled so; everything else is what the trainer itself counted. All state here is bounded.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from importlib import resources
from typing import TYPE_CHECKING, Any

import trio

from protocols.work import SamplerReport

if TYPE_CHECKING:
    from node.intake import RolloutIntake

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD = 8192


class SwarmView:
    """What only the dashboard needs: samplers' latest reports and the version timelines (bounded)."""

    def __init__(self, max_peers: int = 512, max_points: int = 600) -> None:
        self.started = time.time()
        self.max_peers = max_peers
        self.max_points = max_points
        self.reports: OrderedDict[str, tuple[float, SamplerReport]] = OrderedDict()
        self.timelines: OrderedDict[str, deque[tuple[float, int]]] = OrderedDict()

    def _point(self, who: str, version: int) -> None:
        line = self.timelines.get(who)
        if line is None:
            line = self.timelines[who] = deque(maxlen=self.max_points)
            while len(self.timelines) > self.max_peers + 1:  # + the trainer's own line
                self.timelines.popitem(last=False)
        if not line or line[-1][1] != version:
            line.append((round(time.time() - self.started, 2), version))

    def heard(self, peer: str, report: SamplerReport | None) -> None:
        if report is None:
            return
        self.reports[peer] = (time.time(), report)
        self.reports.move_to_end(peer)
        while len(self.reports) > self.max_peers:
            self.reports.popitem(last=False)
        if report.version >= 0:
            self._point(peer, report.version)

    def trainer_version(self, version: int) -> None:
        self._point("trainer", version)

    def state(
        self,
        swarm: str,
        trainer: dict[str, Any],
        intake: RolloutIntake,
        history: Iterable[dict[str, Any]],
    ) -> dict[str, Any]:
        """Everything the page draws: ``trainer`` is the trainer's status with its ``peer_id``, ``history`` its
        metric records."""
        now = time.time()
        peers = set(intake.ledger.accepted_by_peer) | set(self.reports) | set(intake.strikes.counts)
        rows = []
        for peer in sorted(peers):
            seen, report = self.reports.get(peer, (None, None))
            rows.append(
                {
                    "peer_id": peer,
                    "role": "sampler",
                    "version": report.version if report else None,
                    "accepted": intake.ledger.accepted_by_peer.get(peer, 0),
                    "refused": intake.refused_by_peer.get(peer, 0),
                    "strikes": intake.strikes.counts.get(peer, 0),
                    "banned": intake.strikes.is_banned(peer),
                    "bytes_served": report.bytes_served if report else None,
                    "engine": report.engine if report else None,
                    "report_age": round(now - seen, 1) if seen else None,
                }
            )
        trainer_row = {
            "peer_id": trainer["peer_id"],
            "role": "trainer",
            "version": trainer["version"],
            "accepted": 0,
            "refused": 0,
            "strikes": 0,
            "banned": False,
            "bytes_served": trainer["bytes_uploaded"],
            "engine": "learner",
            "report_age": 0.0,
        }
        curve_keys = ("step", "reward", "eval_reward", "eval_accuracy", "busy_fraction")
        return {
            "swarm": swarm,
            "trainer": trainer,
            "peers": [trainer_row, *rows],
            "versions": {who: list(points) for who, points in self.timelines.items()},
            "curves": [{k: r[k] for k in curve_keys if k in r} for r in history],
        }


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def page() -> bytes:
    return resources.files("node").joinpath("dashboard.html").read_bytes()


async def _handle(stream: trio.SocketStream, state: Callable[[], dict[str, Any]]) -> None:
    try:
        with trio.move_on_after(10):
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await stream.receive_some(4096)
                if not chunk or len(head) + len(chunk) > MAX_REQUEST_HEAD:
                    return
                head += chunk
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0].decode("latin-1")
            if method != b"GET":
                reply = _response("405 Method Not Allowed", "text/plain", b"read-only\n")
            elif path in ("/", "/index.html"):
                reply = _response("200 OK", "text/html; charset=utf-8", page())
            elif path.split("?")[0] == "/api/state":
                reply = _response("200 OK", "application/json", json.dumps(state()).encode())
            else:
                reply = _response("404 Not Found", "text/plain", b"not found\n")
            await stream.send_all(reply)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    except Exception as exc:  # the dashboard must never take the trainer down
        log.warning("dashboard request failed: %s: %s", type(exc).__name__, exc)
    finally:
        await stream.aclose()


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"dashboard address {text!r} must be host:port (e.g. 127.0.0.1:8470)")
    return host.strip("[]"), int(port)


async def open_dashboard(nursery: trio.Nursery, address: str, state: Callable[[], dict[str, Any]]) -> str | None:
    """Serve the dashboard at ``address`` (host:port, or "off") in ``nursery``; its URL, None when off."""
    if address == "off":
        return None
    host, port = parse_address(address)
    url = await nursery.start(serve_dashboard, state, host, port)
    log.info("dashboard at %s", url)
    return url


async def serve_dashboard(
    state: Callable[[], dict[str, Any]], host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status.started`` gets the URL. A busy port falls back to a free one."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        if port == 0:
            raise
        log.warning("dashboard port %d is taken (%s); using a free one", port, exc)
        listeners = await trio.open_tcp_listeners(0, host=host)
    bound = listeners[0].socket.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    task_status.started(f"http://{shown}:{bound[1]}/")
    await trio.serve_listeners(lambda s: _handle(s, state), listeners)
