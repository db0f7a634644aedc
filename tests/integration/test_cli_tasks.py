"""``python -m openrlhf_populora.cli.tasks``: the prompt dataset for stock OpenRLHF, and the reward file's path.

Exact expectations on ``configs/seeds/basic.jsonl``: 28 records, 12 code_o triplets, the same 12 triplets again as
code_i records, and 4 code_f tasks. Every exported label is fed back into the reward file with the right and a
wrong answer, which proves the label is what the reward file reads.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from paths import ROOT
from task_answers import answer_block

from openrlhf_populora import openrlhf_reward as reward_file
from openrlhf_populora.cli.tasks import main
from openrlhf_populora.openrlhf_reward import reward_func
from openrlhf_populora.tasks import COMPACT_TEMPLATES, Task, TaskBuffers, render_raw, solver_prompt

BASIC = ROOT / "configs" / "seeds" / "basic.jsonl"
SEEDS = [Task.from_dict(json.loads(line)) for line in BASIC.read_text(encoding="utf-8").splitlines() if line.strip()]
CODE_O = [t for t in SEEDS if t.task_type == "code_o"]
CODE_I = [t for t in SEEDS if t.task_type == "code_i"]
CODE_F = [t for t in SEEDS if t.task_type == "code_f"]
ERROR_PREFIX = "python -m openrlhf_populora.cli.tasks export: error: "


def test_the_seed_file_is_what_these_tests_assume():
    assert (len(SEEDS), len(CODE_O), len(CODE_I), len(CODE_F)) == (28, 12, 12, 4)
    assert SEEDS == CODE_O + CODE_I + CODE_F  # in this order in the file
    assert [replace(t, task_type="code_i") for t in CODE_O] == CODE_I  # the same triplets, as code_i


def export(tmp_path, capsys, *args: str, name: str = "out.jsonl") -> tuple[list[dict], str]:
    """Run ``export`` in-process; its lines and its (one-line) stderr summary."""
    out = tmp_path / name
    assert main(["export", *args, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wrote ")
    text = out.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()], err


def fails(capsys, *args: str) -> str:
    """Run the CLI in-process on bad input: exit status 2 (returned, or raised by argparse) and ONE stderr line."""
    try:
        status = main(list(args))
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    return captured.err.rstrip("\n")


def labels_of(lines: list[dict]) -> list[Task]:
    return [Task.from_dict(json.loads(line["label"])) for line in lines]


def both_ways(tasks: list[Task]) -> list[Task]:
    return [replace(t, task_type=kind) for t in tasks for kind in ("code_o", "code_i")]


def rewards_of(lines: list[dict], tasks: list[Task], *, correct: bool, think_open: bool = False) -> list[float]:
    """reward_func on each line's prompt + an answer to its task, as upstream calls it: query = prompt + response."""
    opening = "" if think_open else "<think>"
    queries = [f"{line['prompt']}{opening}I work it out.</think>\n<answer>\n{answer_block(task, correct)}\n</answer>"
               for line, task in zip(lines, tasks, strict=True)]
    out = reward_func(queries, [line["prompt"] for line in lines], [line["label"] for line in lines])
    assert out["extra_logs"]["reward_errors"] == 0.0
    return out["rewards"].tolist()


# ---------------------------------------------------------------- export from a seed file


def test_triplets_are_exported_once_as_each_type_and_the_labels_are_what_the_reward_file_reads(
        tmp_path, capsys, task_sandbox, monkeypatch):
    lines, err = export(tmp_path, capsys, "--seed-file", str(BASIC), "--task-types", "code_o,code_i")
    expected = both_ways(CODE_O)  # each triplet as code_o then code_i; the code_i records are duplicates of those
    assert len(lines) == 24 and labels_of(lines) == expected
    assert len({(line["datasource"], line["label"]) for line in lines}) == 24
    assert len({t.key() for t in labels_of(lines)}) == 24
    assert [line["datasource"] for line in lines] == ["code_o", "code_i"] * 12
    assert [line["prompt"] for line in lines] == [solver_prompt(t) for t in expected]
    assert all(set(line) == {"prompt", "label", "datasource"} for line in lines)
    assert err.startswith(f"wrote 24 prompts (code_i: 12, code_o: 12) from {BASIC} to {tmp_path / 'out.jsonl'}")
    assert "--data.apply_chat_template" in err and f"--reward.remote_url {Path(reward_file.__file__).resolve()}" in err

    monkeypatch.setattr(reward_file, "_SANDBOX", task_sandbox)
    monkeypatch.delenv("POPULORA_REWARD_MODE", raising=False)
    assert rewards_of(lines, expected, correct=True) == [1.0] * 24
    assert rewards_of(lines, expected, correct=False) == [-0.5] * 24
    # each answer under the NEXT line (the same triplet as the other type, or another triplet): the reward file
    # reads the label, which asks for the other kind of block, so every answer is a format error
    shifted = lines[1:] + lines[:1]
    assert rewards_of(shifted, expected, correct=True) == [-1.0] * 24


def test_all_types_by_default_with_code_f_and_its_reward(tmp_path, capsys, task_sandbox, monkeypatch):
    lines, err = export(tmp_path, capsys, "--seed-file", str(BASIC))
    assert labels_of(lines) == both_ways(CODE_O) + CODE_F
    assert [line["datasource"] for line in lines] == ["code_o", "code_i"] * 12 + ["code_f"] * 4
    assert err.startswith("wrote 28 prompts (code_f: 4, code_i: 12, code_o: 12)")
    monkeypatch.setattr(reward_file, "_SANDBOX", task_sandbox)
    monkeypatch.delenv("POPULORA_REWARD_MODE", raising=False)
    assert rewards_of(lines[24:], CODE_F, correct=True) == [1.0] * 4
    assert rewards_of(lines[24:], CODE_F, correct=False) == [-0.5] * 4


def test_one_task_type(tmp_path, capsys):
    lines, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--task-types", "code_i")
    assert labels_of(lines) == CODE_I  # the code_o triplets, played as code_i (the code_i records: duplicates)
    lines, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--task-types", "code_f")
    assert labels_of(lines) == CODE_F


def test_keep_types_exports_each_record_as_its_own_type_only(tmp_path, capsys):
    lines, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--keep-types")
    assert labels_of(lines) == SEEDS
    assert [line["datasource"] for line in lines] == [t.task_type for t in SEEDS]
    lines, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--keep-types", "--task-types", "code_o")
    assert labels_of(lines) == CODE_O
    # a file of code_i records only: without --keep-types each is ALSO exported as code_o
    only_i = tmp_path / "only_i.jsonl"
    only_i.write_text("".join(t.to_json() + "\n" for t in CODE_I[:3]), encoding="utf-8")
    lines, _ = export(tmp_path, capsys, "--seed-file", str(only_i), "--task-types", "code_o,code_i")
    assert labels_of(lines) == [replace(t, task_type=k) for t in CODE_I[:3] for k in ("code_o", "code_i")]
    lines, _ = export(tmp_path, capsys, "--seed-file", str(only_i), "--task-types", "code_o,code_i", "--keep-types")
    assert labels_of(lines) == CODE_I[:3]


def test_limit_keeps_the_first_lines(tmp_path, capsys):
    full, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), name="full.jsonl")
    lines, err = export(tmp_path, capsys, "--seed-file", str(BASIC), "--limit", "5")
    assert lines == full[:5] and err.startswith("wrote 5 prompts (code_i: 2, code_o: 3)")
    lines, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--limit", "1000")
    assert lines == full


def test_shuffle_seed_is_a_reproducible_permutation(tmp_path, capsys):
    key = json.dumps
    full, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), name="full.jsonl")
    first, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--shuffle-seed", "7", name="a.jsonl")
    again, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--shuffle-seed", "7", name="b.jsonl")
    other, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--shuffle-seed", "8", name="c.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes() and first == again
    assert sorted(map(key, first)) == sorted(map(key, full)) == sorted(map(key, other))
    assert len(set(map(key, first))) == 28
    assert first != full and other != first
    limited, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--shuffle-seed", "7", "--limit", "4")
    assert limited == first[:4]  # the limit applies after shuffling


def test_render_user_raw_and_compact_prompts(tmp_path, capsys, task_sandbox, monkeypatch):
    tasks = both_ways(CODE_O) + CODE_F
    user, err = export(tmp_path, capsys, "--seed-file", str(BASIC), "--render", "user", name="user.jsonl")
    default, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), name="default.jsonl")
    assert user == default and [line["prompt"] for line in user] == [solver_prompt(t) for t in tasks]
    assert "--data.apply_chat_template" in err

    raw, err = export(tmp_path, capsys, "--seed-file", str(BASIC), "--render", "raw", name="raw.jsonl")
    assert [line["prompt"] for line in raw] == [render_raw(solver_prompt(t)) for t in tasks]
    assert all(line["prompt"].endswith("\nAssistant: <think>") for line in raw)
    assert [line["label"] for line in raw] == [line["label"] for line in user]
    assert "--data.apply_chat_template" not in err
    monkeypatch.setattr(reward_file, "_SANDBOX", task_sandbox)
    monkeypatch.delenv("POPULORA_REWARD_MODE", raising=False)
    assert rewards_of(raw, tasks, correct=True, think_open=True) == [1.0] * 28
    assert rewards_of(raw, tasks, correct=False, think_open=True) == [-0.5] * 28

    compact, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--prompts", "compact", name="compact.jsonl")
    assert [line["prompt"] for line in compact] == [solver_prompt(t, COMPACT_TEMPLATES) for t in tasks]
    assert [line["prompt"] for line in compact] != [line["prompt"] for line in user]


def test_stdout_output(capsys):
    assert main(["export", "--seed-file", str(BASIC), "--task-types", "code_o", "--limit", "2", "--out", "-"]) == 0
    captured = capsys.readouterr()
    assert labels_of([json.loads(line) for line in captured.out.splitlines()]) == CODE_O[:2]
    assert captured.err.startswith("wrote 2 prompts (code_o: 2)") and captured.err.count("\n") == 1


# ---------------------------------------------------------------- export from a run's task buffers


def write_buffers(run_dir: Path, tasks: list[Task]) -> Path:
    """buffers.jsonl as TaskBuffers.save writes it: one ``Task.to_json()`` per line, code_o, code_i, code_f."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ordered = [t for kind in ("code_o", "code_i", "code_f") for t in tasks if t.task_type == kind]
    path = run_dir / "buffers.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in ordered), encoding="utf-8")
    return path


def test_run_dir_buffers(tmp_path, capsys):
    proposed_o = Task("code_o", "def f(a, b):\n    return a - b\n", ["9, 4"], ["5"], proposer="m0", step=3)
    proposed_i = Task("code_i", "def f(s):\n    return s * 2\n", ["'ab'"], ["'abab'"], proposer="m1", step=4)
    same_as_o = replace(proposed_o, task_type="code_i", proposer="m2", step=5)  # the code_o triplet, as code_i
    induction = Task("code_f", "def f(x):\n    return x * 3\n", ["1", "2", "3"], ["3", "6", "9"],
                     message="Triple it.", shown=[0, 1], proposer="m0", step=6)
    path = write_buffers(tmp_path / "run", [proposed_o, proposed_i, same_as_o, induction])
    (tmp_path / "run" / "config.yaml").write_text("populora:\n  prompts: default\n  chat_template: true\n")
    buffers = TaskBuffers.load(path)  # the format a run writes and reads back
    assert buffers.sizes() == {"code_o": 1, "code_i": 2, "code_f": 1}

    # from a run, each task as the type its solvers answered it as (catches: every triplet exported both ways,
    # tasks the run never trained on in that role)
    lines, err = export(tmp_path, capsys, "--run", str(tmp_path / "run"))
    assert labels_of(lines) == [proposed_o, proposed_i, same_as_o, induction]
    assert err.startswith(f"wrote 4 prompts (code_f: 1, code_i: 2, code_o: 1) from {path} ")
    # file order: code_o (both ways), code_i (both ways; the retyped code_o triplet is a duplicate), code_f
    lines, err = export(tmp_path, capsys, "--run", str(tmp_path / "run"), "--no-keep-types")
    assert labels_of(lines) == [proposed_o, replace(proposed_o, task_type="code_i"),
                                replace(proposed_i, task_type="code_o"), proposed_i, induction]
    lines, _ = export(tmp_path, capsys, "--run", str(tmp_path / "run"), "--task-types", "code_f")
    assert labels_of(lines) == [induction]
    assert lines[0]["prompt"] == solver_prompt(induction) and "Triple it." in lines[0]["prompt"]


# ---------------------------------------------------------------- bad input: exit status 2, one stderr line


def test_bad_input_is_one_stderr_line_and_status_2(tmp_path, capsys):
    out = tmp_path / "never.jsonl"
    seed = ["export", "--seed-file", str(BASIC), "--out", str(out)]

    err = fails(capsys, *seed, "--task-types", "code_o,code_x")
    assert err.startswith(ERROR_PREFIX) and "unknown task type code_x" in err
    assert "named twice" in fails(capsys, *seed, "--task-types", "code_o,code_o")
    assert "(none given)" in fails(capsys, *seed, "--task-types", ",")
    assert fails(capsys, *seed, "--limit", "0") == ERROR_PREFIX + "--limit must be >= 1, got 0"
    assert fails(capsys, *seed, "--limit", "-3") == ERROR_PREFIX + "--limit must be >= 1, got -3"
    assert "invalid int value" in fails(capsys, *seed, "--limit", "many")
    assert "invalid choice" in fails(capsys, *seed, "--render", "html")
    assert "--render chat needs --model" in fails(capsys, *seed, "--render", "chat")

    missing = tmp_path / "nope.jsonl"
    assert fails(capsys, "export", "--seed-file", str(missing), "--out", str(out)) == (
        ERROR_PREFIX + f"--seed-file {missing}: no such file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    assert fails(capsys, "export", "--seed-file", str(empty), "--out", str(out)) == (
        ERROR_PREFIX + f"{empty} holds no task")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n", encoding="utf-8")
    assert fails(capsys, "export", "--seed-file", str(blank), "--out", str(out)) == (
        ERROR_PREFIX + f"{blank} holds no task")

    for name, bad_line in (("not_json", "{not json"), ("not_a_dict", "[1, 2]"),
                           ("not_a_task", json.dumps({"task_type": "code_o", "program": "def f(x): return x"})),
                           ("unknown_type", json.dumps({**CODE_O[0].to_dict(), "task_type": "code_z"})),
                           ("too_deep", "[" * 100_000)):
        bad = tmp_path / f"{name}.jsonl"
        bad.write_text(BASIC.read_text(encoding="utf-8").splitlines()[0] + "\n" + bad_line + "\n", encoding="utf-8")
        err = fails(capsys, "export", "--seed-file", str(bad), "--out", str(out))
        assert err.startswith(ERROR_PREFIX + f"{bad}:2: not a task record ("), err

    run_dir = tmp_path / "run_without_buffers"
    run_dir.mkdir()
    err = fails(capsys, "export", "--run", str(run_dir), "--out", str(out))
    assert err.startswith(ERROR_PREFIX + f"--run {run_dir}: {run_dir / 'buffers.jsonl'} not found")
    err = fails(capsys, "export", "--run", str(tmp_path / "no_such_run"), "--out", str(out))
    assert err == ERROR_PREFIX + f"--run {tmp_path / 'no_such_run'}: no such directory"
    assert "not allowed with argument" in fails(capsys, "export", "--seed-file", str(BASIC), "--run", str(run_dir),
                                                "--out", str(out))
    assert "required" in fails(capsys, "export", "--seed-file", str(BASIC))

    only_f = tmp_path / "only_f.jsonl"
    only_f.write_text(CODE_F[0].to_json() + "\n", encoding="utf-8")
    assert fails(capsys, "export", "--seed-file", str(only_f), "--out", str(out), "--task-types", "code_o") == (
        ERROR_PREFIX + f"{only_f} has no task playable as code_o (it holds code_f: 1)")
    assert not out.exists()  # nothing written on bad input


def test_unwritable_out_leaves_nothing_behind(tmp_path, capsys):
    target = tmp_path / "a_directory"
    target.mkdir()
    err = fails(capsys, "export", "--seed-file", str(BASIC), "--out", str(target))
    assert err.startswith(ERROR_PREFIX + f"cannot write {target}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_directory"]  # no temporary file left


def test_an_existing_out_is_replaced_whole(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n" * 1000, encoding="utf-8")
    lines, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--limit", "3")
    assert len(lines) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


# ---------------------------------------------------------------- reward-file, and the module entry point


def test_reward_file_prints_the_reward_files_path(capsys):
    assert main(["reward-file"]) == 0
    captured = capsys.readouterr()
    path = captured.out.rstrip("\n")
    assert captured.out.count("\n") == 1 and captured.err == ""
    assert path.endswith("openrlhf_reward.py") and Path(path).is_absolute() and Path(path).is_file()
    assert Path(path) == Path(reward_file.__file__).resolve()


def test_module_entry_point(tmp_path, capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "sub.jsonl"
    proc = subprocess.run([sys.executable, "-m", "openrlhf_populora.cli.tasks", "export", "--seed-file", str(BASIC),
                           "--task-types", "code_o,code_i", "--shuffle-seed", "3", "--limit", "6", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr.startswith("wrote 6 prompts") and proc.stderr.count("\n") == 1
    in_process, _ = export(tmp_path, capsys, "--seed-file", str(BASIC), "--task-types", "code_o,code_i",
                           "--shuffle-seed", "3", "--limit", "6")
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == in_process

    proc = subprocess.run([sys.executable, "-m", "openrlhf_populora.cli.tasks", "export", "--seed-file",
                           str(tmp_path / "missing.jsonl"), "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ERROR_PREFIX + f"--seed-file {tmp_path / 'missing.jsonl'}: no such file\n"


def test_a_run_export_uses_the_prompts_its_solvers_saw(tmp_path, capsys):
    # a run trained with compact prompts (the signature presets). Catches: exporting the default templates for
    # it (stock OpenRLHF then trains on a prompt B1 never saw: 118 of 118 differed on the real baseline), and a
    # contradicting flag accepted.
    task = Task("code_o", "def f(a, b):\n    return a - b\n", ["9, 4"], ["5"], proposer="m0", step=3)
    write_buffers(tmp_path / "run", [task])
    (tmp_path / "run" / "config.yaml").write_text("populora:\n  prompts: compact\n  chat_template: true\n")
    lines, err = export(tmp_path, capsys, "--run", str(tmp_path / "run"))
    assert lines[0]["prompt"] == solver_prompt(task, COMPACT_TEMPLATES) and "(compact prompts, render user)" in err
    assert "the run's solvers saw populora.prompts compact" in fails(
        capsys, "export", "--run", str(tmp_path / "run"), "--prompts", "default", "--out", str(tmp_path / "x"))
    (tmp_path / "run" / "config.yaml").write_text("populora:\n  prompts: default\n  chat_template: false\n")
    lines, _ = export(tmp_path, capsys, "--run", str(tmp_path / "run"))
    assert lines[0]["prompt"] == render_raw(solver_prompt(task))  # a raw-prompt run: AZR's plain text
    assert "leave --render out" in fails(
        capsys, "export", "--run", str(tmp_path / "run"), "--render", "user", "--out", str(tmp_path / "x"))


def test_repeat_to_spreads_the_tasks_evenly(tmp_path, capsys):
    # 3 distinct tasks to 8 lines: each twice, two of them three times, chosen by label hash whatever the order.
    # Catches: a count other than N, an uneven spread, extra copies that depend on the file order.
    tasks = [Task("code_o", f"def f(x):\n    return x + {k}\n", ["1"], [str(1 + k)], proposer="m0", step=1)
             for k in range(3)]
    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in tasks))
    lines, err = export(tmp_path, capsys, "--seed-file", str(seed), "--keep-types", "--repeat-to", "8")
    counts = {label: sum(line["label"] == label for line in lines) for label in {line["label"] for line in lines}}
    assert len(lines) == 8 and sorted(counts.values()) == [2, 3, 3] and "(3 distinct, repeated to 8)" in err
    seed.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in reversed(tasks)))
    again, _ = export(tmp_path, capsys, "--seed-file", str(seed), "--keep-types", "--repeat-to", "8")
    assert {label: sum(line["label"] == label for line in again) for label in counts} == counts
    assert "fewer than the 3 distinct lines" in fails(
        capsys, "export", "--seed-file", str(seed), "--keep-types", "--repeat-to", "2", "--out", str(tmp_path / "x"))


def test_an_answer_ending_in_the_eos_token_is_graded_as_without_it(task_sandbox, monkeypatch):
    # Upstream decodes the query with skip_special_tokens=False and vLLM keeps the EOS token, so the reward file
    # sees "...<|im_end|>"; B1's engine decodes without special tokens. Catches: an answer whose last block is
    # left open (accepted for B1) graded as a syntax error for stock OpenRLHF.
    monkeypatch.setattr(reward_file, "_SANDBOX", task_sandbox)
    monkeypatch.delenv("POPULORA_REWARD_MODE", raising=False)
    task = Task("code_o", "def f(s):\n    return s[::-1]\n", ["'abc'"], ["'cba'"], proposer="m0", step=1)
    prompt = solver_prompt(task)
    for answer in ("```output\n'cba'", "<answer>'cba'", "```output\n'cba'\n```"):
        plain = reward_func([prompt + answer], [prompt], [task.to_json()])["rewards"].tolist()
        for eos in ("<|im_end|>", "<|im_end|>\n", "<|endoftext|>"):
            assert reward_func([prompt + answer + eos], [prompt], [task.to_json()])["rewards"].tolist() == plain
        assert plain == [1.0], answer
