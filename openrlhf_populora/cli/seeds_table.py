"""``python -m openrlhf_populora.cli.seeds_table EVAL_DIR EVAL_DIR [...] --out DIR``

The pass@1 table across seeds (``eval/across_seeds.py``), from one ``cli.evaluate`` output directory per seed
(``results.json`` and ``samples.jsonl``): the rows every seed has (base, B1, each ``--arm``'s solver, the
population's means, best and worst), each with its mean over seeds, an interval over problems, each seed's
number, and its paired difference from the base and from B1 with the problems gained and lost. Writes
``results.md``, ``results.json`` and ``results.png`` into ``--out``. Exit status: 0, or 2 on bad input (one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openrlhf_populora.cli.errors import OneLineParser


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m openrlhf_populora.cli.seeds_table", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("evaluations", type=Path, nargs="+", metavar="EVAL_DIR",
                        help="cli.evaluate output directories, one per seed")
    parser.add_argument("--out", type=Path, required=True, help="write results.md, results.json, results.png here")
    args = parser.parse_args(argv)
    from openrlhf_populora.eval.across_seeds import combine, load_seed, markdown, write

    try:
        table = combine([load_seed(path) for path in args.evaluations])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(table), end="")
    paths = write(table, args.out)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
