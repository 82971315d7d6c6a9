"""The trainer's two services and their client, side by side (hivemind's rpc_/call_ pairs), so each limit is
written once: ``serve_trainer`` registers the work and rollouts handlers with their frame limits, timeouts and
admission; ``TrainerClient`` is what a sampler calls, with the same limits. A refusal for load ("busy",
"rate_limited") raises RemoteError; ``node.rpc.backpressure`` says how long to wait before asking again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libp2p.abc import IHost
from libp2p.peer.id import ID

from node.rpc import Handler, Remote, request, serve
from protocols import rollouts, work
from protocols.rollouts import RolloutAck, RolloutGroup
from protocols.work import WorkLease, WorkRequest

Admit = Callable[[Remote], None]  # the stream's peer and its IP, before a byte is read


def serve_trainer(
    host: IHost,
    on_work: Handler,
    on_rollouts: Handler,
    *,
    admit_work: Admit,
    admit_rollouts: Admit,
    group_size: int,
    max_tokens: int,
    rollout_timeout: float,
) -> None:
    """Serve work leases and rollout groups; a group's frame may be as large as ``group_size`` completions of
    ``max_tokens`` tokens with their draws, and no larger."""
    host.set_stream_handler(
        work.PROTOCOL_ID,
        serve(
            "work",
            on_work,
            work.MAX_REQUEST_FRAME,
            work.MAX_FRAME,
            admit=admit_work,
            max_containers=work.MAX_REQUEST_CONTAINERS,
        ),
    )
    host.set_stream_handler(
        rollouts.PROTOCOL_ID,
        serve(
            "rollouts",
            on_rollouts,
            rollouts.frame_limit(group_size, max_tokens),
            rollouts.MAX_ACK_FRAME,
            rollout_timeout,
            admit=admit_rollouts,
            max_containers=rollouts.max_containers(group_size),
        ),
    )


class TrainerClient:
    """A sampler's calls to the trainer peer (which it names per call: discovery may find it elsewhere)."""

    def __init__(self, host: IHost, rollout_timeout: float) -> None:
        self.host = host
        self.rollout_timeout = rollout_timeout

    async def lease(self, trainer: ID, req: WorkRequest, timeout: float) -> WorkLease:
        reply = await request(
            self.host,
            trainer,
            work.PROTOCOL_ID,
            req.to_wire(),
            max_request=work.MAX_REQUEST_FRAME,
            max_reply=work.MAX_FRAME,
            timeout=timeout,
        )
        return WorkLease.from_wire(reply)

    async def submit(self, trainer: ID, group: RolloutGroup) -> RolloutAck:
        reply: dict[str, Any] = await request(
            self.host,
            trainer,
            rollouts.PROTOCOL_ID,
            group.to_wire(),
            max_request=rollouts.MAX_FRAME,
            max_reply=rollouts.MAX_ACK_FRAME,
            timeout=self.rollout_timeout,
        )
        return RolloutAck.from_wire(reply)
