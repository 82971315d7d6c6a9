"""The seeded-draw rule of protocols/draw.py in torch (float64): the torch sampler draws with it, and the
verifier's scorer replays it to get, for every completion token, the interval of u that picks it.

Pure functions of logits: the same logits rows ``token_logprobs`` computes (trainer/model.py) feed
``token_draws``; ``completion_draws`` runs the forward pass itself for callers that have only a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from protocols.draw import TokenDraw

# alternatives (top_p < 1) whose margin (log-odds) exceeds this are never admissible, so they are not computed
MAX_ALT_MARGIN = 4.0
ROW_ELEMENTS = 1 << 24  # logits elements per chunk of token_draws: 128 MB per float64 copy


def tempered_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(z / T) in float64: the distribution every draw is defined on."""
    return torch.log_softmax(logits.double() / temperature, dim=-1)


@dataclass(frozen=True)
class Nucleus:
    """The kept tokens [N, V] and the nucleus boundary per row: the last kept token, the first dropped one
    (-1 when every token is kept) and the ranked mass before and through the last kept token."""

    keep: torch.Tensor
    last: torch.Tensor
    next: torch.Tensor
    mass_before: torch.Tensor
    mass_through: torch.Tensor


def _ranked(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens per row, ranked by p descending and then token id ascending."""
    if k < p.shape[-1]:
        vals, ids = torch.topk(p, k, dim=-1)
    else:  # all of them: a full (stable) sort
        vals, ids = p, torch.arange(p.shape[-1], device=p.device).expand_as(p)
    by_id = torch.sort(ids, dim=-1, stable=True).indices
    vals, ids = vals.gather(-1, by_id), ids.gather(-1, by_id)
    by_p = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, by_p), ids.gather(-1, by_p)


def nucleus(p: torch.Tensor, top_p: float) -> Nucleus:
    """The nucleus of protocols/draw.py: the smallest highest-p set with mass >= top_p, ties by lower id. Ranks
    only the top few hundred tokens when the boundary lies well inside them (a full sort of a 150k vocabulary
    costs ~20x more), else more."""
    rows, vocab = p.shape
    if top_p >= 1.0:
        none = torch.full((rows,), -1, device=p.device)
        total = p.sum(-1)
        return Nucleus(torch.ones_like(p, dtype=torch.bool), none, none, total, total)
    k = min(vocab, 512)
    while True:
        vals, ids = _ranked(p, k)
        mass = vals.cumsum(-1)
        n = (mass < top_p).sum(-1) + 1  # k + 1 where the top k do not reach top_p
        inner = n < k
        # the boundary and the next token are right unless ties around them reach the edge of the top k
        safe = inner & (vals.gather(-1, n.clamp(max=k - 1)[:, None])[:, 0] > vals[:, -1])
        if k == vocab or bool(safe.all()):
            break
        k = min(vocab, 4 * k)
    n = n.clamp(max=vocab)
    kept_ranks = torch.arange(k, device=p.device).expand(rows, k) < n[:, None]
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, ids, kept_ranks)
    r = torch.arange(rows, device=p.device)
    has_next = n < vocab
    last = ids[r, n - 1]
    nxt = torch.where(has_next, ids[r, n.clamp(max=k - 1)], torch.full_like(last, -1))
    before = torch.where(n > 1, mass[r, (n - 2).clamp(min=0)], torch.zeros_like(mass[:, 0]))
    return Nucleus(keep, last, nxt, before, mass[r, n - 1])


def cdf(p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Inclusive CDF [N, V] of the renormalised kept distribution, exactly 1 from the last kept token on."""
    q = p.masked_fill(~keep, 0.0)
    c = torch.cumsum(q, dim=-1)
    c = c / c[:, -1:]
    vocab = p.shape[-1]
    last = vocab - 1 - torch.argmax((q > 0).flip(-1).to(torch.int8), dim=-1)
    return c.masked_fill(torch.arange(vocab, device=p.device) >= last[:, None], 1.0)


def draw_tokens(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampler's step: logits [B, V], u [B] (float64) -> (chosen ids [B], their tempered logprobs [B])."""
    logp = tempered_logprobs(logits, temperature)
    p = logp.exp()
    c = cdf(p, nucleus(p, top_p).keep)
    tokens = (c <= u.double()[:, None]).sum(-1)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


@dataclass(frozen=True)
class _Sums:
    """A chosen token's interval from kept-mass sums: Z (all kept), below it, and through it (below + its own)."""

    total: torch.Tensor
    below: torch.Tensor
    through: torch.Tensor

    def interval(self) -> tuple[torch.Tensor, torch.Tensor]:
        lo = (self.below / self.total).clamp(max=1.0)
        hi = (self.through / self.total).clamp(max=1.0)  # exactly 1 when no kept mass follows (through == total)
        return lo, hi

    def changed(self, p: torch.Tensor, toks: torch.Tensor, removed: torch.Tensor, added: torch.Tensor) -> _Sums:
        """The sums with token ``removed`` dropped from the nucleus and ``added`` put in (-1: none), per row."""
        out = self
        for ids, sign in ((removed, -1.0), (added, 1.0)):
            pm = torch.where(ids >= 0, p.gather(-1, ids.clamp(min=0)[:, None])[:, 0], torch.zeros_like(self.total))
            pm = sign * pm
            zero = torch.zeros_like(pm)
            out = _Sums(
                out.total + pm,
                out.below + torch.where(ids < toks, pm, zero),
                out.through + torch.where(ids <= toks, pm, zero),
            )
        # no kept mass after the token (up to rounding): its interval reaches 1, as in the rule
        last = out.through >= out.total * (1 - 1e-12)
        return _Sums(out.total, out.below, torch.where(last, out.total, out.through))


def token_draws(
    logits: torch.Tensor, tokens: list[int] | torch.Tensor, temperature: float, top_p: float
) -> list[TokenDraw]:
    """For logits rows [L, V] (untempered, as the model outputs them at the completion positions; any number of
    completions concatenated) and their tokens [L]: each token's tempered logprob and the interval [lo, hi) of
    u that picks it, plus its nucleus-boundary alternatives (top_p < 1).

    Float64 on the logits' device (the CPU for MPS, which has no float64), a bounded number of rows at a time:
    a few float64 copies of a 150k-token vocabulary row add up."""
    device = torch.device("cpu") if logits.device.type == "mps" else logits.device
    toks = torch.as_tensor(tokens, dtype=torch.long)
    step = max(1, ROW_ELEMENTS // logits.shape[-1])
    out: list[TokenDraw] = []
    for i in range(0, len(toks), step):
        out += _token_draws(logits[i : i + step].to(device), toks[i : i + step].to(device), temperature, top_p)
    return out


def _token_draws(logits: torch.Tensor, toks: torch.Tensor, temperature: float, top_p: float) -> list[TokenDraw]:
    with torch.no_grad():
        x = logits.double().div_(temperature)
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        logp = (x.gather(-1, toks[:, None]) - lse)[:, 0]
        p = x.sub_(lse).exp_()  # x is spent: p = softmax(z / T)
        nuc = nucleus(p, top_p) if top_p < 1.0 else None
        c = (p if nuc is None else p.masked_fill(~nuc.keep, 0.0)).cumsum(-1)
        prev = c.gather(-1, (toks - 1).clamp(min=0)[:, None])[:, 0]
        sums = _Sums(c[:, -1], torch.where(toks > 0, prev, torch.zeros_like(prev)), c.gather(-1, toks[:, None])[:, 0])
        lo, hi = sums.interval()
        alts = [[] for _ in range(len(toks))] if nuc is None else _alternatives(p, toks, nuc, sums, top_p)
        exposure = boundary_exposure(c)
        return [
            TokenDraw(lp, a, b, tuple(alt), x)
            for lp, a, b, alt, x in zip(logp.tolist(), lo.tolist(), hi.tolist(), alts, exposure.tolist(), strict=True)
        ]


def boundary_exposure(cumulative: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of C(1 - C) over the CDF boundaries (``cumulative``: unnormalised kept-mass cumsums): how
    likely a draw is to land between a boundary and where an honest sampler's arithmetic put it, per log-odds of
    error (protocols/draw.py ``TokenDraw.exposure``)."""
    c = (cumulative / cumulative[:, -1:]).clamp(0.0, 1.0)
    return (c * (1.0 - c)).sum(-1)


def _alternatives(
    p: torch.Tensor, toks: torch.Tensor, nuc: Nucleus, sums: _Sums, top_p: float
) -> list[list[tuple[float, float, float]]]:
    """Per token, (margin, lo, hi) under the nucleus with its boundary token dropped, the next one added, and the
    two swapped; margin: the log-odds error (ranked mass against top_p, or log-ratio of the two tokens' p) a
    sampler needs for its nucleus to differ that way. Only margins up to MAX_ALT_MARGIN are kept."""
    none = torch.full_like(nuc.last, -1)
    inf = torch.full_like(nuc.mass_before, float("inf"))
    has_next = nuc.next >= 0
    p_last = p.gather(-1, nuc.last[:, None])[:, 0]
    p_next = p.gather(-1, nuc.next.clamp(min=0)[:, None])[:, 0]
    target = math.log(top_p) - math.log1p(-top_p)
    options = (  # (margin, removed, added)
        (torch.where(nuc.mass_before > 0, target - torch.logit(nuc.mass_before), inf), nuc.last, none),
        (torch.where(has_next, torch.logit(nuc.mass_through.clamp(max=1.0)) - target, inf), none, nuc.next),
        (torch.where(has_next, p_last.log() - p_next.log(), inf), nuc.last, nuc.next),
    )
    alts: list[list[tuple[float, float, float]]] = [[] for _ in range(len(toks))]
    for margin, removed, added in options:
        a_lo, a_hi = sums.changed(p, toks, removed, added).interval()
        for j in (margin <= MAX_ALT_MARGIN).nonzero().flatten().tolist():
            alts[j].append((float(margin[j]), float(a_lo[j]), float(a_hi[j])))
    return alts


def split_draws(flat: list[TokenDraw], lengths: list[int]) -> list[list[TokenDraw]]:
    """Flat per-token draws (completions concatenated) back into one list per completion."""
    out, i = [], 0
    for n in lengths:
        out.append(flat[i : i + n])
        i += n
    return out


@torch.no_grad()
def completion_draws(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float,
    top_p: float,
) -> list[list[TokenDraw]]:
    """Each completion's draws under ``model``: one forward pass (trainer/model.py ``completion_logits``), then
    ``token_draws`` on the completion rows."""
    from trainer.model import completion_logits

    logits, _, _, targets = completion_logits(model, prompts, completions)
    flat = token_draws(logits, targets, temperature, top_p)
    return split_draws(flat, [len(c) for c in completions])
