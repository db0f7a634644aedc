"""``python -m openrlhf_populora.cli.collapse RUN_DIR [RUN_DIR ...] [--out DIR]``

Checks each run against the mode-collapse definition fixed before the 120-step study (``analysis/collapse.py``):
a window of 20 steps is collapsed when its mean solve rate is at least 0.9, its mean AST nodes at most steps
1-20's, and fewer than 5% of its valid proposals are programs the run had not proposed before. Prints one row per
run: the first step whose window is collapsed, whether the last window is, and the last window's numbers.
``--out DIR`` also writes ``collapse.md`` and ``collapse.json`` (every window of every run).
Exit status: 0 when every run was read, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openrlhf_populora.cli.errors import OneLineParser
from openrlhf_populora.metrics.keys import METRICS_FILE, PROBLEMS_FILE


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m openrlhf_populora.cli.collapse", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None, help="write collapse.md and collapse.json here")
    args = parser.parse_args(argv)
    for path in args.runs:
        missing = [name for name in (METRICS_FILE, PROBLEMS_FILE) if not (path / name).is_file()]
        if missing:
            print(f"error: {path} has no {' or '.join(missing)}: not a run directory", file=sys.stderr)
            return 2
    from openrlhf_populora.analysis.collapse import collapse, collapse_table
    from openrlhf_populora.analysis.runs import load_run

    results = [collapse(load_run(path)) for path in args.runs]
    table = collapse_table(results)
    print(table, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "collapse.md").write_text(table, encoding="utf-8")
        data = [r.to_dict() for r in results]
        (args.out / "collapse.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote collapse.md and collapse.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
