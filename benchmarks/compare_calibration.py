"""How often does ``cli.compare`` say "holds" when nothing happens, and how often when the signature is there?

    .venv/bin/python benchmarks/compare_calibration.py                    # 200 draws a cell, 2 workers
    .venv/bin/python benchmarks/compare_calibration.py --draws 500 --workers 1 --json calibration.json

For every null process of ``analysis.synthetic.NULLS`` (iid noise; AR(1) with phi 0.5, 0.8, 0.95; a random walk;
a saturating curve in the population against a linear rise in the baseline; both arms drawn from the same
process with a real signal in it) and for the planted signature (``analysis.synthetic.PLANTED``: complexity
up 3 noise SDs in the population and down 3 in the baseline over the run, a solve-rate oscillation of
amplitude 2 noise SDs, 1.5 times the cell scale, growing), at 40 and 100 steps and with 1 and 3 seeds per
arm, it draws ``--draws`` comparisons and runs the signature's verdicts (``analysis.signature.compare_series``,
the functions ``cli.compare`` uses) on each. It prints, per verdict:

- the false "holds" rate on each null where the verdict's claim is false (``synthetic.false_claims``),
  with the largest over the nulls; the goal is at most 5%;
- the power: the "holds" rate on the planted signature; the goal is at least 80%;
- the rate of at least one false "holds" among a null's false claims (family-wise, reported).

A rate from D draws has a binomial standard error of sqrt(p (1 - p) / D): about 1.5 points at 5% and 200 draws.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import defaultdict
from multiprocessing import Pool

import numpy as np
from tqdm import tqdm

from openrlhf_populora.analysis import signature as sig
from openrlhf_populora.analysis import synthetic as syn

KINDS = (*syn.NULLS, syn.PLANTED)


def one_draw(job: tuple[str, int, int, int, int]) -> tuple[str, int, int, dict[str, str]]:
    """Draw one comparison of ``kind`` (n steps, seeds per arm) from ``seed``; its verdicts by claim."""
    kind, n, seeds, seed, surrogates = job
    rng = np.random.default_rng(seed)
    population, baseline = syn.calibration_arms(kind, n, seeds, rng)
    _, _, verdicts = sig.compare_series(population, baseline, surrogates=surrogates, seed=seed % 2 ** 31)
    return kind, n, seeds, {claim: v.verdict for claim, v in verdicts.items()}


def jobs(draws: int, steps: list[int], seeds: list[int], surrogates: int, base_seed: int):
    for (i, kind), n, k in itertools.product(enumerate(KINDS), steps, seeds):
        for d in range(draws):
            yield kind, n, k, int(np.random.SeedSequence([base_seed, i, n, k, d]).generate_state(1)[0]), surrogates


def tally(results) -> dict:
    """{(kind, n, seeds): {claim: holds count, "draws": count, "any_false": count}}."""
    table: dict = defaultdict(lambda: defaultdict(int))
    for kind, n, k, verdicts in results:
        cell = table[(kind, n, k)]
        cell["draws"] += 1
        for claim, verdict in verdicts.items():
            cell[claim] += verdict == sig.HOLDS
        cell["any_false"] += any(verdicts[c] == sig.HOLDS for c in syn.false_claims(kind)) if kind in syn.NULLS else 0
    return table


def short(claim: str) -> str:
    return claim.split("/", 1)[1]


def report(table: dict, steps: list[int], seeds: list[int]) -> str:
    """Markdown: the summary per verdict, then every null's false-holds rate."""
    settings = list(itertools.product(steps, seeds))
    head = " | ".join(f"n={n}, {k} seed{'s' if k > 1 else ''}" for n, k in settings)
    lines = ["## Per verdict: largest false-holds rate over the nulls (which) / power on the planted signature", "",
             f"| verdict | {head} |", "|---|" + "---|" * len(settings)]
    for claim in sig.CLAIMS:
        cells = []
        for n, k in settings:
            rates = {kind: table[(kind, n, k)][claim] / table[(kind, n, k)]["draws"]
                     for kind in syn.NULLS if claim in syn.false_claims(kind)}
            worst = max(rates, key=rates.get)
            power = table[(syn.PLANTED, n, k)][claim] / table[(syn.PLANTED, n, k)]["draws"]
            cells.append(f"{rates[worst]:.1%} ({worst}) / **{power:.0%}**")
        lines.append(f"| {short(claim)} | " + " | ".join(cells) + " |")
    lines += ["", "## False-holds rate per null (a blank: the claim is true under that null)", ""]
    for n, k in settings:
        lines += [f"### n = {n} steps, {k} seed{'s' if k > 1 else ''} per arm", "",
                  "| null | " + " | ".join(short(c) for c in sig.CLAIMS) + " | any false holds |",
                  "|---|" + "---|" * (len(sig.CLAIMS) + 1)]
        for kind in syn.NULLS:
            cell = table[(kind, n, k)]
            rates = [f"{cell[c] / cell['draws']:.1%}" if c in syn.false_claims(kind) else ""
                     for c in sig.CLAIMS]
            lines.append(f"| {kind} | " + " | ".join(rates) + f" | {cell['any_false'] / cell['draws']:.1%} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=200, help="comparisons drawn per (process, steps, seeds)")
    parser.add_argument("--steps", type=int, nargs="+", default=[40, 100])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 3], help="seeds per arm")
    parser.add_argument("--surrogates", type=int, default=199, help="red-noise surrogates per test")
    parser.add_argument("--workers", type=int, default=2, help="processes (the machine is shared: keep it small)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the counts here")
    args = parser.parse_args(argv)
    todo = list(jobs(args.draws, args.steps, args.seeds, args.surrogates, args.seed))
    start = time.perf_counter()
    with Pool(args.workers) as pool:
        results = list(tqdm(pool.imap_unordered(one_draw, todo, chunksize=8), total=len(todo), unit="draw"))
    table = tally(results)
    print(f"# cli.compare calibration: {args.draws} draws per cell, {args.surrogates} red-noise surrogates, "
          f"seed {args.seed}, {time.perf_counter() - start:.0f} s on {args.workers} worker(s)\n")
    print(report(table, args.steps, args.seeds))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({f"{kind}|{n}|{k}": dict(cell) for (kind, n, k), cell in table.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
