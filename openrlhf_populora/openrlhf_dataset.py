"""The prompt dataset of stock OpenRLHF (baseline B2) from PopuLoRA's code tasks: ``cli.tasks export``'s work.

One JSON object per line, ``{"prompt": ..., "label": <the task as JSON>, "datasource": <its task type>}``, the
format ``--data.prompt_dataset`` reads; the label is what the reward file (``openrlhf_reward.py``, its pair)
grades. The tasks come from a seed file or a run's task buffers; the prompts are the solver's, rendered as the
run's solvers saw them. The command's help (``cli/tasks.py``) says which flags read each render.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from openrlhf_populora.durable import replace_text
from openrlhf_populora.errors import InputError
from openrlhf_populora.tasks import COMPACT_TEMPLATES, DEFAULT_TEMPLATES, TASK_TYPES, Task, render_raw
from openrlhf_populora.tasks import solver_prompt as make_solver_prompt
from openrlhf_populora.tasks.records import TRIPLET_TYPES

RENDERS = ("user", "chat", "raw")
PROMPT_SETS = {"default": DEFAULT_TEMPLATES, "compact": COMPACT_TEMPLATES}
INPUT_KEY, LABEL_KEY, SOURCE_KEY = "prompt", "label", "datasource"
IMAGE_TAG = "<image>"  # upstream's prompt dataset splits a string prompt on it (an image slot) under apply_chat_template
# the flags that read an exported file, per render
TRAIN_FLAGS = {
    "user": f"--data.input_key {INPUT_KEY} --data.label_key {LABEL_KEY} --data.apply_chat_template",
    "chat": f"--data.input_key {INPUT_KEY} --data.label_key {LABEL_KEY}",
    "raw": f"--data.input_key {INPUT_KEY} --data.label_key {LABEL_KEY}",
}


def reward_file_path() -> str:
    """The absolute path of the reward file for ``--reward.remote_url`` (it imports nothing heavy here)."""
    from importlib.util import find_spec

    spec = find_spec("openrlhf_populora.openrlhf_reward")
    if spec is None or not spec.origin:  # pragma: no cover - the module is part of this package
        raise RuntimeError("openrlhf_populora.openrlhf_reward is not importable")
    return str(Path(spec.origin).resolve())


def parse_task_types(text: str) -> list[str]:
    """``"code_o,code_i"`` -> ``["code_o", "code_i"]``; an unknown or repeated type is an ``InputError``."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASK_TYPES]
    if unknown or not names:
        raise InputError(f"--task-types {text!r}: unknown task type {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(TASK_TYPES)}")
    if len(set(names)) != len(names):
        raise InputError(f"--task-types {text!r}: a task type is named twice")
    return names


def read_tasks(seed_file: str | None = None, run: str | None = None) -> tuple[list[Task], Path]:
    """The task records of a seed file or of a run's ``buffers.jsonl``, in file order, and the file read."""
    if run is not None:
        run_dir = Path(run)
        if not run_dir.is_dir():
            raise InputError(f"--run {run}: no such directory")
        path = run_dir / "buffers.jsonl"
        if not path.is_file():
            raise InputError(f"--run {run}: {path} not found (a run writes its task buffers there when it ends "
                             "and at every checkpoint)")
    else:
        path = Path(str(seed_file))
        if not path.is_file():
            raise InputError(f"--seed-file {seed_file}: no such file")
    tasks: list[Task] = []
    try:
        with path.open(encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    tasks.append(Task.from_dict(json.loads(line)))
                except (ValueError, TypeError, RecursionError) as err:  # RecursionError: JSON nested too deep
                    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                    raise InputError(f"{path}:{lineno}: not a task record ({reason})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read {path}: {err}") from None
    return tasks, path


def playable_as(task: Task, task_types: Sequence[str], keep_types: bool = False) -> list[Task]:
    """``task`` as each of ``task_types`` it can be played as: a triplet as code_o and code_i (just its own type
    with ``keep_types``), a code_f task as code_f."""
    if keep_types or task.task_type not in TRIPLET_TYPES:
        return [task] if task.task_type in task_types else []
    return [task if t == task.task_type else task.retyped(t) for t in task_types if t in TRIPLET_TYPES]


def render_prompt(user_text: str, render: str, tokenizer=None) -> str:
    """The prompt field of one line: the user message, the model's chat rendering of it, or AZR's raw text."""
    if render == "user":
        return user_text
    if render == "raw":
        return render_raw(user_text)
    from openrlhf_populora.engines.base import render_chat

    return render_chat(tokenizer, user_text, chat_template=True)


def dataset_lines(tasks: Iterable[Task], task_types: Sequence[str], *, render: str = "user", prompts: str = "default",
                  tokenizer=None, keep_types: bool = False, shuffle_seed: int | None = None,
                  limit: int | None = None) -> tuple[list[dict], Counter]:
    """The exported objects (``prompt``, ``label``, ``datasource``) and what was left out, by reason."""
    if render not in RENDERS:
        raise InputError(f"--render {render!r}: choose from {', '.join(RENDERS)}")
    templates = PROMPT_SETS[prompts]
    lines, seen, skipped = [], set(), Counter()
    for task in tasks:
        for played in playable_as(task, task_types, keep_types):
            key = played.key()
            if key in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(key)
            user_text = make_solver_prompt(played, templates)
            if render == "user" and IMAGE_TAG in user_text:
                skipped["image_tag"] += 1
                continue
            lines.append({INPUT_KEY: render_prompt(user_text, render, tokenizer), LABEL_KEY: played.to_json(),
                          SOURCE_KEY: played.task_type})
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(lines)
    if limit is not None:
        lines = lines[:limit]
    return lines, skipped


def repeat_to(lines: Sequence[dict], size: int) -> list[dict]:
    """``lines`` repeated as evenly as possible to ``size`` lines: each ``size // len`` times, and once more for
    the ``size % len`` lines whose label has the smallest SHA-256 (fixed, whatever the order); source order."""
    import hashlib

    if size < len(lines):
        raise InputError(f"--repeat-to {size}: fewer than the {len(lines)} distinct lines (use --limit to cut)")
    times, extra = divmod(size, len(lines))
    ranked = sorted(range(len(lines)), key=lambda i: hashlib.sha256(lines[i][LABEL_KEY].encode()).hexdigest())
    more = set(ranked[:extra])
    return [line for i, line in enumerate(lines) for _ in range(times + (i in more))]


def run_prompt_settings(run: str) -> tuple[str, str]:
    """(``--prompts``, ``--render``) of the run's solvers: its ``config.yaml``'s ``populora.prompts`` and
    ``populora.chat_template`` (true: ``user``, rendered by upstream's ``--data.apply_chat_template``)."""
    import yaml

    path = Path(run) / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise InputError(f"--run {run}: cannot read {path} ({str(err).splitlines()[0]})") from None
    populora = config.get("populora") or {}
    prompts = populora.get("prompts", "default")
    if prompts not in PROMPT_SETS:
        raise InputError(f"{path}: populora.prompts {prompts!r} is not one of {', '.join(PROMPT_SETS)}")
    return prompts, "user" if populora.get("chat_template", True) else "raw"


def load_chat_tokenizer(model: str | None):
    """The tokenizer whose chat template ``--render chat`` uses (a local HF directory, a hub id or one of this package's
    model names)."""
    if not model:
        raise InputError("--render chat needs --model (the model whose chat template renders the prompts)")
    from openrlhf_populora.models.embedded import resolve_model

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(model), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to load is bad input here
        raise InputError(f"--model {model}: cannot load its tokenizer ({str(err).splitlines()[0] if str(err) else err!r})"
                         ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"--model {model}: its tokenizer has no chat template; use --render raw")
    return tokenizer


def write_jsonl(lines: Sequence[dict], out: str) -> None:
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    if out == "-":
        sys.stdout.write(text)
        return
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, text)  # written whole, then renamed over ``out`` (a failed write leaves no temporary)
    except OSError as err:
        raise InputError(f"cannot write {out}: {err}") from None


def export(args: argparse.Namespace) -> str:
    """Write the prompt dataset ``args`` asks for (``cli/tasks.py export``'s flags); returns the line saying what
    was written and the upstream flags that train on it. Bad input raises ``InputError``."""
    task_types = parse_task_types(args.task_types)
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be >= 1, got {args.limit}")
    if args.repeat_to is not None and args.repeat_to < 1:
        raise InputError(f"--repeat-to must be >= 1, got {args.repeat_to}")
    tasks, source = read_tasks(args.seed_file, args.run)
    if args.run is not None:
        prompts, render = run_prompt_settings(args.run)
        if args.prompts not in (None, prompts):
            raise InputError(f"--prompts {args.prompts}: the run's solvers saw populora.prompts {prompts} "
                             f"({Path(args.run) / 'config.yaml'}); leave --prompts out")
        if args.render not in (None, render) and not (render == "user" and args.render == "chat"):
            raise InputError(f"--render {args.render}: the run's solvers saw "
                             f"{'chat-templated' if render == 'user' else 'raw'} prompts (populora.chat_template "
                             f"{render == 'user'}); leave --render out")
        args.prompts, args.render = prompts, args.render or render
        args.keep_types = True if args.keep_types is None else args.keep_types
    else:
        args.prompts, args.render = args.prompts or "default", args.render or "user"
        args.keep_types = bool(args.keep_types)
    tokenizer = load_chat_tokenizer(args.model) if args.render == "chat" else None
    if not tasks:
        raise InputError(f"{source} holds no task")
    lines, skipped = dataset_lines(tasks, task_types, render=args.render, prompts=args.prompts, tokenizer=tokenizer,
                                   keep_types=args.keep_types, shuffle_seed=args.shuffle_seed, limit=args.limit)
    if not lines:
        found = ", ".join(f"{t}: {n}" for t, n in sorted(Counter(t.task_type for t in tasks).items()))
        raise InputError(f"{source} has no task playable as {', '.join(task_types)} (it holds {found})")
    distinct = len(lines)
    if args.repeat_to is not None:
        lines = repeat_to(lines, args.repeat_to)
        if args.shuffle_seed is not None:
            random.Random(args.shuffle_seed).shuffle(lines)
    write_jsonl(lines, args.out)
    counts = Counter(line[SOURCE_KEY] for line in lines)
    note = ""
    if skipped["image_tag"]:
        note = (f"; left out {skipped['image_tag']} whose prompt holds {IMAGE_TAG!r} (upstream's "
                "--data.apply_chat_template would make it an image slot; --render chat keeps them)")
    if len(lines) != distinct:
        note += f" ({distinct} distinct, repeated to {len(lines)})"
    return (f"wrote {len(lines)} prompts ({', '.join(f'{t}: {n}' for t, n in sorted(counts.items()))}) from {source} "
            f"to {args.out} ({args.prompts} prompts, render {args.render}){note}. Train with: --data.prompt_dataset "
            f"{args.out} {TRAIN_FLAGS[args.render]} --reward.remote_url {reward_file_path()}")
