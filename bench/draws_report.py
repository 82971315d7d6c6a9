"""The analysis half of bench/draws.py: fit the noise model to the honest records, check every record against the
final limits, and replay attackers against them. Pure functions of runs/draws/*.pkl (plus the realistic model for
the attackers' replays)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from node.intake.draws import Tolerance, assess_group, check_draws
from node.intake.noise import (
    ABSOLUTE,
    EPSILON,
    NOISE,
    QUIET,
    RATE_MARGIN,
    FlipHistory,
    Mode,
    NoiseClass,
    Tail,
    measured_noise,
    sequential_check,
)
from trainer.draws import MAX_ALT_MARGIN

MODE_OF = {
    "torch-fp32": Mode("torch", "fp32", "none"),
    "mlx-fp32": Mode("mlx", "fp32", "none"),
    "q8-fp32": Mode("mlx", "fp32", "q8"),
    "q8-bf16": Mode("mlx", "bf16", "q8"),
    "q8-fp16": Mode("mlx", "fp16", "q8"),
    "bf16": Mode("mlx", "bf16", "none"),
    "fp16": Mode("mlx", "fp16", "none"),
    "torch-bf16": Mode("torch", "bf16", "none"),
    "q4-fp32": Mode("mlx", "fp32", "q4"),
    "q4-bf16": Mode("mlx", "bf16", "q4"),
    # samplers on versions that travel int8 rowwise: measured as their own class, "wire8/<compute>", and checked
    # as the trainer does, the declared mode's class floored at it
    "wire8-fp32": Mode("mlx", "fp32", "none"),
    "wire8-q8-bf16": Mode("mlx", "bf16", "q8"),
    # bench/draws_grid.py: MLX int8 samplers on int8-grid versions (grids frozen since the anchor) and, beside them,
    # ones quantizing the same bf16 version afresh; both declare q8 and are checked with q8's limits
    "grid-q8-bf16": Mode("mlx", "bf16", "q8"),
    "fresh-q8-bf16": Mode("mlx", "bf16", "q8"),
    "grid-q8-fp32": Mode("mlx", "fp32", "q8"),
    "fresh-q8-fp32": Mode("mlx", "fp32", "q8"),
    # and MLX int4 samplers on int4-grid versions (bench/draws_grid.py --bits 4), checked with q4's limits
    "grid-q4-bf16": Mode("mlx", "bf16", "q4"),
    "fresh-q4-bf16": Mode("mlx", "bf16", "q4"),
    "grid-q4-fp32": Mode("mlx", "fp32", "q4"),
    "fresh-q4-fp32": Mode("mlx", "fp32", "q4"),
}
TRANSPORT = {"wire8-fp32": "wire8", "wire8-q8-bf16": "wire8"}


def class_of(mode: str) -> str:
    m = MODE_OF[mode]
    return f"{TRANSPORT[mode]}/{m.compute}" if mode in TRANSPORT else m.noise_class


@dataclass
class Stats:
    """Everything the fit needs from one noise class's honest groups."""

    groups: int = 0
    tokens: int = 0
    flips: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # top_p == 1 -> flips
    exposure: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # sum exposure / T
    scaled: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})  # log-odds x T
    group_mean: list[float] = field(default_factory=list)  # per group mean |dlogprob|
    token_err: list[float] = field(default_factory=list)  # per token |dlogprob|
    noise: list[float] = field(default_factory=list)  # per group normalised noise (measured_noise)
    per_group_flips: list[int] = field(default_factory=list)


def collect(records_by_mode: dict[str, list]) -> dict[str, Stats]:
    by_class: dict[str, Stats] = defaultdict(Stats)
    for mode, records in records_by_mode.items():
        st = by_class[class_of(mode)]
        for r in records:
            everything = check_draws(r.draws, r.seed, Tolerance(MAX_ALT_MARGIN, 0.0), budget=1 << 30)
            devs = everything.flips + everything.forged
            full = r.top_p >= 1.0
            st.groups += 1
            st.tokens += everything.tokens
            st.flips[full] += len(devs)
            st.per_group_flips.append(len(devs))
            st.exposure[full] += sum(d.exposure for row in r.draws for d in row) / r.temperature
            # the log-odds tolerance matters only beyond the absolute floor (float arithmetic near 0 and 1 is
            # admitted whatever its log-odds: u = 1 - 1e-9 against a boundary at 1 - 1e-7 is 4.6 log-odds away)
            st.scaled[full] += [d.log_odds * r.temperature for d in devs if d.distance > ABSOLUTE]
            replayed = [d.logprob for row in r.draws for d in row]
            claimed = [c for row in r.claimed for c in row]
            errs = [abs(a - b) for a, b in zip(claimed, replayed, strict=True)]
            st.token_err += errs
            st.group_mean.append(sum(errs) / max(len(errs), 1))
            nu = measured_noise(claimed, replayed)
            if nu is not None:
                st.noise.append(nu)
    return dict(by_class)


def fit_tail(flips: int, exposure: float, scaled: list[float]) -> Tail:
    """One regime's shift and Pareto tail (floors where (almost) no flip was seen)."""
    shift = max(flips / max(exposure, 1e-9), 1e-6)
    d = np.sort(np.array(scaled)) if scaled else np.zeros(0)
    if len(d) >= 50:
        # beyond the 90th percentile: MLE alpha = n / sum ln(x / d0), then its lower 2-sigma bound (standard
        # error alpha / sqrt(n)): a heavier tail than measured, never a lighter one
        d0 = float(np.quantile(d, 0.9))
        tail = d[d > d0]
        alpha = len(tail) / float(np.log(tail / d0).sum()) * max(0.5, 1 - 2 / math.sqrt(len(tail)))
        return Tail(shift, d0, len(tail) / len(d), alpha, float(d.max()))
    largest = float(d.max()) if len(d) else 0.0
    return Tail(shift, max(largest, 0.002), 1.0, 4.0, max(largest, 0.005))


def fit(st: Stats) -> NoiseClass:
    """The class's parameters from its honest groups."""
    full = fit_tail(st.flips[True], st.exposure[True], st.scaled[True])
    # top_p < 1 carries every top_p = 1 boundary's noise plus the kept set's: never a lighter tail than that
    nucleus = (
        fit_tail(st.flips[False], st.exposure[False], st.scaled[False]).heavier(full) if st.exposure[False] else full
    )
    err = np.array(st.token_err) if st.token_err else np.zeros(1)
    return NoiseClass(
        full,
        nucleus,
        logprob_mean=max(3 * max(st.group_mean, default=0.0), 1e-3),
        logprob_max=max(3 * float(err.max()), 1e-2),
        tis_clamp=max(float(np.quantile(err, 0.99)), 0.01),
        noise_ref=float(np.median(st.noise)) if st.noise else 0.0,
    )


def describe(name: str, st: Stats) -> str:
    d = np.array(st.scaled[True]) if st.scaled[True] else np.zeros(1)
    dn = np.array(st.scaled[False]) if st.scaled[False] else np.zeros(1)
    nu = np.array(st.noise) if st.noise else np.zeros(1)
    err = np.array(st.token_err) if st.token_err else np.zeros(1)
    return (
        f"{name:<10} groups {st.groups:>6} tokens {st.tokens:>7} | flips T-scaled top_p=1 {st.flips[True]:>5} over "
        f"exposure {st.exposure[True]:>9.1f} (rho {st.flips[True] / max(st.exposure[True], 1e-9):.2e}), top_p<1 "
        f"{st.flips[False]:>4} / {st.exposure[False]:.1f} | flip log-odds x T p50 {np.median(d):.3f} p99 "
        f"{np.quantile(d, 0.99):.3f} max {d.max():.3f} (top_p<1: p99 {np.quantile(dn, 0.99):.3f} max "
        f"{dn.max():.3f}) | flips/group max {max(st.per_group_flips, default=0)} | "
        f"|dlogprob| p99 {np.quantile(err, 0.99):.2e} max {err.max():.2e} | noise p1 {np.quantile(nu, 0.01):.2e} "
        f"p50 {np.median(nu):.2e} max {nu.max():.2e}"
    )


def check_all(records_by_mode: dict[str, list]) -> list[str]:
    """Every honest record against the final limits, and each mode's records as one peer's history."""
    lines = []
    for mode, records in records_by_mode.items():
        m = MODE_OF[mode]
        refused, worst_p, history, strikes = 0, 1.0, FlipHistory(), 0
        reasons: dict[str, int] = defaultdict(int)
        classes: dict[str, int] = defaultdict(int)
        budget_hi, tols = 0, []
        for r in records:
            a = assess_group(r.draws, r.claimed, r.seed, m, r.temperature, r.top_p, transport=TRANSPORT.get(mode))
            classes[a.cls] += 1
            budget_hi = max(budget_hi, a.limits.budget)
            tols.append(a.limits.log_odds)
            if not a.ok:
                refused += 1
                reasons[a.reason()[:60]] += 1
                continue
            history, p = sequential_check(history, a.tails, a.limits.expected)
            worst_p = min(worst_p, p)
            if p < EPSILON:
                strikes += 1
                history = FlipHistory()
        lines.append(
            f"{mode:<10} ({m}) groups {len(records):>6}: REFUSED {refused}, sequential strikes {strikes} (lowest "
            f"p {worst_p:.1e}); classes applied {dict(classes)}; budgets up to {budget_hi}, tolerance median "
            f"{np.median(tols):.2f} max {max(tols):.2f} log-odds" + (f"; reasons {dict(reasons)}" if reasons else "")
        )
    return lines


def noise_table(fits: dict[str, NoiseClass]) -> str:
    def tail(t: Tail) -> str:
        return f"Tail({t.shift:.3g}, {t.start:.3g}, {t.share:.3g}, {t.alpha:.3g}, {t.largest:.3g})"

    rows = [
        f'    "{n}": NoiseClass({tail(c.full)}, {tail(c.nucleus)}, {c.logprob_mean:.3g}, {c.logprob_max:.3g}, '
        f"{c.tis_clamp:.3g}, {c.noise_ref:.3g}),"
        for n, c in fits.items()
    ]
    return "NOISE: dict[str, NoiseClass] = {\n" + "\n".join(rows) + "\n}"


def install(fits: dict[str, NoiseClass]) -> None:
    """Write the fitted table into node/intake/noise.py (the NOISE block), keeping classes not measured this run."""
    from pathlib import Path

    import node.intake.noise as noise

    path = Path(noise.__file__)
    src = path.read_text()
    start = src.index("NOISE: dict[str, NoiseClass] = {")
    end = src.index("\n}\n", start) + 3
    path.write_text(src[:start] + noise_table({**NOISE, **fits}) + "\n" + src[end:])
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(path)], check=False)  # the repo's style
    print(f"wrote {sorted(fits)} into {path}")


def plot(stats: dict[str, Stats], fits: dict[str, NoiseClass], path) -> None:
    """Survival of honest flip distances (log-odds x T, top_p = 1) per class, with the fitted Pareto tails."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, st) in enumerate(stats.items()):
        d = np.sort(np.array(st.scaled[True]))
        if len(d) < 20:
            continue
        color = f"C{i}"
        ax.loglog(d, 1.0 - np.arange(len(d)) / len(d), color=color, lw=1.5, label=f"{name} ({len(d)} flips)")
        t = fits[name].full
        x = np.geomspace(t.start * 1.001, 3 * t.largest, 50)
        ax.loglog(x, [t.survival(v, 1.0) for v in x], color=color, ls="--", lw=1)
    ax.set_xlabel("flip distance from the replayed interval (log-odds x T)")
    ax.set_ylabel("share of honest flips at least this far")
    ax.set_title("Honest near-boundary flips on the trained model (solid), Pareto tails fitted (dashed)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def report(records_by_mode: dict[str, list], attack: bool = True, write: bool = False, plot_path=None) -> None:
    stats = collect(records_by_mode)
    print(f"honest noise per class (kappa {RATE_MARGIN}, epsilon {EPSILON:g}, fp32-quiet bound {QUIET:g}):")
    for name, st in stats.items():
        print(describe(name, st))
    fits = {name: fit(st) for name, st in stats.items()}
    print("fitted (node/intake/noise.py NOISE):")
    print(noise_table(fits))
    if plot_path is not None:
        plot(stats, fits, plot_path)
    fp32 = stats.get("none/fp32")
    if fp32 and fp32.noise:
        quiet = max(fp32.noise)
        others = {n: min(s.noise) for n, s in stats.items() if n != "none/fp32" and s.noise}
        print(f"fp32 normalised noise max {quiet:.2e}; smallest of every other class: {others}")
    if write:
        install(fits)
        NOISE.update(fits)
    missing = [n for n in fits if n not in NOISE]
    if missing:
        print(f"{missing} not in node/intake/noise.py NOISE: checking with the fitted table")
        NOISE.update({n: fits[n] for n in missing})
    print("honest groups against the limits of node/intake/noise.py (target: 0 refused, 0 strikes):")
    for line in check_all(records_by_mode):
        print(line)
    if attack:
        from bench.draws_attack import attacks

        for line in attacks(records_by_mode):
            print(line, flush=True)
