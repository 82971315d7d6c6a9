"""Attackers of bench/draws.py, replayed against the honest records of the realistic trained model.

Each attacker starts from an honest MLX int8 sampler's groups (computing in bf16: the widest mode a default
trainer accepts, mlx/bf16/q8) and rewrites tokens to raise its reward. Its claimed logprobs are the trainer's own
replay plus the honest sampler's logprob errors at the same places, so that its logprobs look as noisy as the mode
it declares (exact ones would get it checked as fp32). A peer is banned at 3 strikes (per-group refusals and the
sequential test alike). For each attacker: whether its first group is refused, groups until the first strike and
the ban, and the reward it gained per group it got accepted against the honest groups it started from.

- inject-all: every sample is the right answer; inject-mixed: half of them.
- inject-k (k = 1, 2, 4, all): wrong samples corrected by substituting at most k tokens per group (the number).
- steer: decodes itself, and wherever an alternative token's interval lies within the tolerance of the draw, takes
  the one that continues a right answer; at most the group's flip budget.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from node.intake.draws import assess_group
from node.intake.noise import EPSILON, FlipHistory, Mode, sequential_check
from protocols.draw import draw_uniform, log_odds_distance
from trainer.draws import completion_draws, tempered_logprobs
from trainer.model import load_model, load_tokenizer
from trainer.realistic_model import DATASET, cached_realistic_model
from trainer.tasks.dataset import JsonlTask
from trainer.text import TextCodec

DECLARED = Mode("mlx", "bf16", "q8")
MAX_STRIKES = 3
NUMBER = re.compile(r"\d+")


@dataclass
class Run:
    name: str
    first_refused: bool | None = None
    first_strike: int | None = None  # 1-based group index
    banned_at: int | None = None
    accepted: int = 0
    gain: float = 0.0  # summed reward gain of accepted groups
    changed: int = 0  # tokens changed in accepted groups
    tokens: int = 0
    modified: int = 0  # groups sent with at least one token changed
    modified_accepted: int = 0

    def line(self, groups: int) -> str:
        gain = self.gain / max(self.accepted, 1)
        return (
            f"{self.name:<14} first group refused: {self.first_refused}; first strike at group {self.first_strike}, "
            f"banned at {self.banned_at} (of {groups} sent); accepted {self.accepted}, reward gain per accepted "
            f"group {gain:+.3f}, tokens chosen in accepted groups {self.changed}/{self.tokens}; altered groups "
            f"accepted {self.modified_accepted}/{self.modified}"
        )


class Attack:
    def __init__(self, records: list) -> None:
        self.records = records
        self.model_dir = cached_realistic_model()
        self.tok = load_tokenizer(self.model_dir)
        self.codec = TextCodec(self.tok, (self.tok.eos_token_id,), chat_template=True)
        self.task = JsonlTask(self.model_dir / DATASET, "numeric")
        self.model = load_model(self.model_dir).eval()
        self.eos = self.tok.eos_token_id
        self.inflate = 1.0

    def prompt(self, seed: int) -> list[int]:
        return self.codec.encode_prompt(self.task.prompt(seed))

    def comps(self, r) -> list[list[int]]:
        """The honest completions (the records keep draws, not ids: each draw's token is recovered by replaying
        honest ids stored alongside; see bench/draws.py Record.ids)."""
        return [list(c) for c in r.ids]

    def claimed(self, r, draws) -> list[list[float]]:
        """Replayed logprobs plus the honest sampler's errors (recycled in order): noise like the declared mode's;
        times ``self.inflate`` for an attacker that fakes noise to widen its limits (they scale with it, up to 4x)."""
        errs = [
            self.inflate * (c - d.logprob)
            for cs, ds in zip(r.claimed, r.draws, strict=True)
            for c, d in zip(cs, ds, strict=True)
        ]
        out, i = [], 0
        for row in draws:
            vals = []
            for d in row:
                vals.append(min(d.logprob + (errs[i % len(errs)] if errs else 0.0), 0.0))
                i += 1
            out.append(vals)
        return out

    def right(self, seed: int) -> list[int]:
        return [*self.tok.encode(self.task.answer(seed), add_special_tokens=False), self.eos]

    def reward(self, seed: int, ids: list[int]) -> float:
        return self.task.reward(seed, self.codec.completion_text(ids))

    def corrected(self, seed: int, ids: list[int]) -> list[int] | None:
        """The completion with its last number replaced by the right answer, re-tokenised (None: no number)."""
        text = self.codec.completion_text(ids)
        found = list(NUMBER.finditer(text))
        if not found:
            return None
        m = found[-1]
        fixed = text[: m.start()] + self.task.answer(seed) + text[m.end() :]
        return [*self.tok.encode(fixed, add_special_tokens=False), self.eos]

    # -- attackers: (record) -> completions ------------------------------------------------------------------
    def inject(self, r, which) -> list[list[int]]:
        return [self.right(r.seed) if which(k) else c for k, c in enumerate(self.comps(r))]

    def inject_k(self, r, k: int | None) -> list[list[int]]:
        out, left = [], math.inf if k is None else k
        for c in self.comps(r):
            if self.reward(r.seed, c) < 1.0 and left > 0:
                fixed = self.corrected(r.seed, c)
                if fixed is not None:
                    diff = sum(a != b for a, b in zip(fixed, c, strict=False)) + abs(len(fixed) - len(c))
                    if diff <= left:
                        out.append(fixed)
                        left -= diff
                        continue
            out.append(c)
        return out

    @torch.no_grad()
    def steer(self, r, tolerance: float, budget: int) -> list[list[int]]:
        """Decode every sample itself; at each position, the drawn token unless a token whose interval lies within
        ``tolerance`` (log-odds) of u continues one of the right answers better; at most ``budget`` such picks."""
        answer = self.task.answer(r.seed)
        targets = [answer, f"The answer is {answer}.", f"{{a}} plus {{b}} is {answer}."]
        ops = NUMBER.findall(self.task.prompt(r.seed))
        targets[2] = f"{ops[0]} plus {ops[1]} is {answer}." if len(ops) >= 2 else answer
        prompt = self.prompt(r.seed)
        out = []
        for k in range(len(r.ids)):
            ids: list[int] = []
            for t in range(16):
                logits = self.model(input_ids=torch.tensor([prompt + ids])).logits[0, -1]
                p = tempered_logprobs(logits[None], r.temperature)[0].exp()
                c = torch.cumsum(p, 0)
                c = c / c[-1]
                u = draw_uniform(r.seed, k, t)
                drawn = int((c <= u).sum().clamp(max=len(c) - 1))
                pick = drawn
                if budget > 0:
                    text = self.codec.completion_text(ids)
                    best = self._progress(text, self.tok.decode([drawn]), targets)
                    lo = torch.cat([torch.zeros(1, dtype=c.dtype), c[:-1]])
                    for cand in range(max(0, drawn - 3), min(len(c), drawn + 4)):
                        if cand == drawn or log_odds_distance(u, float(lo[cand]), float(c[cand])) > tolerance:
                            continue
                        score = self._progress(text, self.tok.decode([cand]), targets)
                        if score > best:
                            best, pick = score, cand
                    if pick != drawn:
                        budget -= 1
                ids.append(pick)
                if pick == self.eos:
                    break
            out.append(ids)
        return out

    @staticmethod
    def _progress(text: str, piece: str, targets: list[str]) -> int:
        """How far the text with ``piece`` appended agrees with the nearest right answer (characters)."""
        new = text + piece
        best = 0
        for tgt in targets:
            n = 0
            while n < min(len(new), len(tgt)) and new[n] == tgt[n]:
                n += 1
            best = max(best, n if n == len(new) else n - 1)
        return best

    # -- one peer sending a run of groups ------------------------------------------------------------------------
    def run(self, name: str, make, groups: int, declared: Mode = DECLARED, cap: float = 1.0) -> Run:
        res = Run(name)
        history, strikes = FlipHistory(), 0
        for i, r in enumerate(self.records[:groups], 1):
            comps = make(r)
            altered = comps != self.comps(r)
            res.modified += altered
            draws = completion_draws(self.model, [self.prompt(r.seed)] * len(comps), comps, r.temperature, r.top_p)
            a = assess_group(draws, self.claimed(r, draws), r.seed, declared, r.temperature, r.top_p, scale_cap=cap)
            ok = a.ok
            if ok:
                history, p = sequential_check(history, a.tails, a.limits.expected)
                if p < EPSILON:
                    ok, history = False, FlipHistory()
            if res.first_refused is None:
                res.first_refused = not ok
            if not ok:
                strikes += 1
                res.first_strike = res.first_strike or i
                if strikes >= MAX_STRIKES:
                    res.banned_at = i
                    break
                continue
            res.accepted += 1
            res.modified_accepted += altered
            honest = [self.reward(r.seed, c) for c in self.comps(r)]
            res.gain += (sum(self.reward(r.seed, c) for c in comps) - sum(honest)) / len(comps)
            res.changed += sum(
                sum(x != y for x, y in zip(a_, b_, strict=False)) + abs(len(a_) - len(b_))
                for a_, b_ in zip(comps, self.comps(r), strict=True)
            )
            res.tokens += sum(len(c) for c in comps)
        return res


def attacks(records_by_mode: dict[str, list], groups: int = 200) -> list[str]:
    base = [r for r in records_by_mode.get("q8-bf16", []) if r.temperature == 1.0 and r.top_p == 1.0]
    if not base:
        return ["attackers: no q8-bf16 records at T=1, top_p=1"]
    atk = Attack(base)
    n = min(groups, len(base))
    lines = [f"attackers declaring {DECLARED}, replayed over {n} honest q8-bf16 groups (T=1, top_p=1), ban at 3:"]
    runs = [
        atk.run("inject-all", lambda r: atk.inject(r, lambda k: True), n),
        atk.run("inject-mixed", lambda r: atk.inject(r, lambda k: k % 2 == 0), n),
    ]
    for k in (1, 2, 4, None):
        runs.append(atk.run(f"inject-k={k or 'all'}", lambda r, k=k: atk.inject_k(r, k), n))
    honest = atk.run("honest", atk.comps, n)
    for res in [honest, *runs]:
        lines.append(res.line(n))

    # the steerer uses the tolerance and budget an honest group of the same prompt gets
    def steerer(declared: Mode):
        def steer(r):
            a = assess_group(r.draws, r.claimed, r.seed, declared, r.temperature, r.top_p)
            return atk.steer(r, a.limits.log_odds, a.limits.budget)

        return steer

    m = min(n, 100)
    lines.append(atk.run("steer", steerer(DECLARED), m).line(m))
    atk.inflate = 4.0  # logprob errors 4x the honest ones: still inside the class's bounds (3x the worst honest)
    lines.append(atk.run("k=1, noise x4", lambda r: atk.inject_k(r, 1), n).line(n))
    lines.append(atk.run("same, cap 4", lambda r: atk.inject_k(r, 1), n, cap=4.0).line(n) + " (--noise-scale-cap 4)")
    atk.inflate = 1.0
    q4 = Mode("mlx", "fp32", "q4")
    lines.append(f"declaring {q4} to a trainer run with --accept-quant none,q8,q4 (the default refuses q4 unblamed):")
    lines.append(atk.run("inject-all", lambda r: atk.inject(r, lambda k: True), n, q4).line(n))
    lines.append(atk.run("inject-mixed", lambda r: atk.inject(r, lambda k: k % 2 == 0), n, q4).line(n))
    for k in (1, None):
        lines.append(atk.run(f"inject-k={k or 'all'}", lambda r, k=k: atk.inject_k(r, k), n, q4).line(n))
    lines.append(atk.run("steer", steerer(q4), m, q4).line(m))
    return lines
