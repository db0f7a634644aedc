"""``python -m openrlhf_populora.cli.tasks``: PopuLoRA's code tasks as a prompt dataset for stock OpenRLHF.

    python -m openrlhf_populora.cli.tasks export --run runs/4t4s --out code_tasks.jsonl
    python -m openrlhf_populora.cli.tasks export --seed-file configs/seeds/basic.jsonl --out code_tasks.jsonl
    python -m openrlhf_populora.cli.tasks reward-file      # prints the path for --reward.remote_url

``export`` writes OpenRLHF 0.11.2's prompt dataset (``--data.prompt_dataset``): one JSON object per line,

    {"prompt": <the solver prompt>, "label": <the task as JSON>, "datasource": <its task type>}

one line per (task, task type). The tasks come from a seed file (``--seed-file``, JSONL of ``Task`` records, e.g.
``configs/seeds/basic.jsonl``) or from a run directory (``--run``: the task buffers it saved, ``buffers.jsonl``),
i.e. what its solvers drew their tasks from. From a run, each task is written as the type it was recorded with,
the type its solvers answered it as (``--no-keep-types`` writes a triplet as code_o and code_i both); from a seed
file, a code_o or code_i triplet is written as each triplet type asked for (``--keep-types``: only its own), a
code_f task only as code_f. Identical (type, program, pairs, message) lines are written once; ``--repeat-to N``
then repeats them as evenly as possible to N lines (the extra copies go to the lines whose label has the
smallest SHA-256), so that one episode of stock OpenRLHF answers N prompts. The label is what
``openrlhf_populora/openrlhf_reward.py`` (the reward file) reads: ``Task.to_json()``.

How OpenRLHF reads the file (``openrlhf/datasets/prompts_dataset.py``): ``data[--data.input_key]`` is the
prompt, ``data[--data.label_key]`` the label, ``datasource`` a tag. With ``--data.apply_chat_template`` a string
prompt becomes one user message rendered by the tokenizer's chat template with the generation prompt, which is
exactly how PopuLoRA renders its prompts (``populora.chat_template: true``). So ``--render``:

- ``user`` (default): the solver's user message; train with ``--data.input_key prompt --data.label_key label
  --data.apply_chat_template``. Upstream turns the text ``<image>`` in such a prompt into an image slot, so a task
  whose prompt holds it is left out (counted on stderr); ``--render chat`` keeps it.
- ``chat``: the user message already rendered with ``--model``'s chat template; train WITHOUT
  ``--data.apply_chat_template``.
- ``raw``: AZR's plain-text R1 conversation (PopuLoRA's ``populora.chat_template: false``); train WITHOUT
  ``--data.apply_chat_template``.

``--prompts default|compact`` picks the templates as the training config's ``populora.prompts`` does. From a run,
the prompts and the render follow its ``config.yaml`` (``populora.prompts``; ``populora.chat_template``: ``user``
when true, ``raw`` when false), and a flag that contradicts it is refused: stock OpenRLHF then sees the prompts
the run's solvers saw. Lines keep
the source's order unless ``--shuffle-seed`` is given; ``--limit N`` keeps the first N lines (after shuffling).
Bad input (an unknown task type, no task of the asked types, an unreadable or malformed file) is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from openrlhf_populora.cli.errors import OneLineParser
from openrlhf_populora.errors import InputError
from openrlhf_populora.openrlhf_dataset import PROMPT_SETS, RENDERS, export, reward_file_path
from openrlhf_populora.tasks import TASK_TYPES

PROG = "python -m openrlhf_populora.cli.tasks"


class Parser(OneLineParser):
    with_prog = True  # the line names the subcommand


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    exp = commands.add_parser("export", help="write the prompt dataset of stock OpenRLHF (JSONL: prompt, label)",
                              description="Write OpenRLHF's prompt dataset from a seed file or a run's task buffers.")
    source = exp.add_mutually_exclusive_group(required=True)
    source.add_argument("--seed-file", help="JSONL of Task records (e.g. configs/seeds/basic.jsonl)")
    source.add_argument("--run", help="a run directory: its task buffers (buffers.jsonl)")
    exp.add_argument("--out", required=True, help="the JSONL to write ('-': stdout)")
    exp.add_argument("--task-types", default=",".join(TASK_TYPES),
                     help=f"comma list of task types to export (default: {','.join(TASK_TYPES)})")
    exp.add_argument("--keep-types", action=argparse.BooleanOptionalAction, default=None,
                     help="export each triplet only as the type it was recorded with (default with --run, where "
                          "that is the type its solvers answered; with --seed-file the default writes it as code_o "
                          "and code_i)")
    exp.add_argument("--prompts", default=None, choices=tuple(PROMPT_SETS),
                     help="prompt templates, as the training config's populora.prompts (default: the run's; "
                          "with --seed-file, default)")
    exp.add_argument("--render", default=None, choices=RENDERS,
                     help="user: the user message (train with --data.apply_chat_template); chat: rendered with "
                          "--model's chat template; raw: AZR's plain-text R1 conversation (default: as the run's "
                          "populora.chat_template says; with --seed-file, user)")
    exp.add_argument("--repeat-to", type=int, default=None, metavar="N",
                     help="repeat the distinct lines as evenly as possible to N lines (one episode = N prompts)")
    exp.add_argument("--model", help="for --render chat: the model (local HF directory, hub id or this package's name)")
    exp.add_argument("--limit", type=int, default=None, help="keep the first N lines (after shuffling)")
    exp.add_argument("--shuffle-seed", type=int, default=None, help="shuffle the lines with this seed")
    commands.add_parser("reward-file", help="print the reward file's path, for --reward.remote_url",
                        description="Print the absolute path of openrlhf_populora/openrlhf_reward.py.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "reward-file":
        print(reward_file_path())
        return 0
    try:
        print(export(args), file=sys.stderr)
        return 0
    except InputError as err:
        print(f"{PROG} export: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
