"""GRPO math on hand-computed cases, and the batch policy (staleness bound, no-signal groups)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import pytest
import torch

from node.intake.buffer import take_batch
from trainer.groups import Group, has_signal
from trainer.grpo import LossConfig, group_advantages, grpo_loss


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # mean 0.5, population std 0.5 -> +-1
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.allclose(group_advantages(torch.tensor([0.2, 0.2])), torch.zeros(2))
    assert not has_signal([0.4, 0.4, 0.4]) and has_signal([0.4, 0.6])


def one(x: float) -> torch.Tensor:
    return torch.tensor([[x]])


@pytest.mark.parametrize(
    ("ratio", "adv", "expected"),
    [
        (1.0, 2.0, -2.0),  # on-policy: -A
        (1.5, 1.0, -1.28),  # positive advantage: clipped at 1 + eps_high
        (0.5, 1.0, -0.5),  # min() keeps the unclipped, smaller term
        (0.5, -1.0, 0.8),  # negative advantage: clipped at 1 - eps_low -> -(0.8 * -1)
        (1.5, -1.0, 1.5),  # negative advantage, ratio up: unclipped (pessimistic) term
    ],
)
def test_clipped_surrogate_by_hand(ratio, adv, expected):
    old = -1.0
    loss, stats = grpo_loss(one(old + math.log(ratio)), one(old), one(old), torch.tensor([adv]), one(1.0), LossConfig())
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats.tis_mean == pytest.approx(1.0)


def test_truncated_importance_weight_by_hand():
    cfg = LossConfig(tis_cap=2.0)
    # sampler (mu) less likely than pi_old by e^0.5: weight 1.6487
    loss, stats = grpo_loss(one(-1.0), one(-1.0), one(-1.5), torch.tensor([1.0]), one(1.0), cfg)
    assert loss.item() == pytest.approx(-math.exp(0.5), rel=1e-5)
    # by e^2: capped at 2
    loss, stats = grpo_loss(one(-1.0), one(-1.0), one(-3.0), torch.tensor([1.0]), one(1.0), cfg)
    assert loss.item() == pytest.approx(-2.0, rel=1e-5) and stats.tis_capped_fraction == 1.0


def test_token_level_normalisation_ignores_padding_and_grads_flow():
    logp = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]), mask, LossConfig())
    # tokens: A=+1 twice, A=-1 once -> -(1 + 1 - 1) / 3
    assert loss.item() == pytest.approx(-1 / 3, rel=1e-5)
    loss.backward()
    assert logp.grad[0, 2] == 0 and logp.grad[1, 1] == 0 and logp.grad[0, 0] != 0


def test_kl_penalty_is_zero_at_the_reference_and_positive_away():
    cfg = LossConfig(kl_beta=0.1)
    _, at_ref = grpo_loss(one(-1.0), one(-1.0), one(-1.0), torch.tensor([0.0]), one(1.0), cfg, ref_logp=one(-1.0))
    _, away = grpo_loss(one(-1.0), one(-1.0), one(-1.0), torch.tensor([0.0]), one(1.0), cfg, ref_logp=one(-2.0))
    assert at_ref.kl == pytest.approx(0.0) and away.kl == pytest.approx(math.exp(-1) + 1 - 1, rel=1e-5)


def group(version: int, rewards: tuple[float, ...] = (0.0, 1.0)) -> Group:
    n = len(rewards)
    return Group(
        f"g{version}",
        "p",
        version,
        "reverse",
        version,
        [1],
        [[2]] * n,
        [[-1.0]] * n,
        [[-1.0]] * n,
        list(rewards),
        [False] * n,
        1.0,
    )


def test_batches_take_the_oldest_usable_groups_and_count_the_rest():
    queue = deque((group(v), [f"r{v}"]) for v in (0, 3, 5, 6, 7))
    queue.insert(3, (group(5, rewards=(0.5, 0.5)), ["flat"]))  # no reward variance: no signal
    taken = take_batch(queue, 2, version=6, max_staleness=2)
    assert [g.version for g in taken.batch] == [5, 6]
    assert (taken.stale, taken.no_signal) == (2, 1)
    assert [g.version for g, _ in queue] == [7]  # what was not needed stays, in order
    rest = take_batch(queue, 4, version=6, max_staleness=2)
    assert [g.version for g in rest.batch] == [7] and not queue


def test_batches_give_each_peer_a_fair_share_without_stalling():
    flood = [(dataclasses.replace(group(5), peer="flood", group_id=f"f{i}"), [f"f{i}"]) for i in range(20)]
    honest = [(dataclasses.replace(group(5), peer="honest", group_id=f"h{i}"), [f"h{i}"]) for i in range(3)]
    queue = deque(flood + honest)  # the flood arrived first
    taken = take_batch(queue, 8, version=5, max_staleness=2)
    assert [g.peer for g in taken.batch].count("honest") == 3  # its whole share, though it came last
    assert len(taken.batch) == 8 and len(queue) == 15  # the flood filled the rest: the step does not wait
    assert [g.group_id for g, _ in queue][:2] == ["f5", "f6"]  # what waits keeps its order
