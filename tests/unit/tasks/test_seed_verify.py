"""Seed files are verified when they load: every (program, input) pair runs in the sandbox through the proposal
check, in one batch, and a wrong gold output is an error naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paths import ROOT

from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.selfplay.loop import SelfPlay
from openrlhf_populora.tasks import TaskBuffers
from openrlhf_populora.tasks.seeds import SeedFileError, load_seed_file

SHIPPED = ROOT / "configs" / "seeds" / "basic.jsonl"


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout_s=5.0, memory_mb=256) as sb:
        yield sb


class _CountingSandbox:
    """Passes jobs to the real sandbox and counts the batches."""

    def __init__(self, sandbox):
        self.sandbox, self.batches, self.jobs = sandbox, 0, 0

    def run(self, jobs):
        self.batches += 1
        self.jobs += len(jobs)
        return self.sandbox.run(jobs)


def _write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "seeds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _shipped_records() -> list[dict]:
    return [json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip()]


def test_the_shipped_seeds_load_verified_in_one_sandbox_batch(sandbox):
    """Catches: a verification that runs one sandbox batch per task or per type (the load cost), or that rejects
    the shipped file, or that changes what the buffers hold."""
    counting = _CountingSandbox(sandbox)
    buffers = load_seed_file(SHIPPED, counting)
    plain = TaskBuffers.load(SHIPPED)
    for task_type in ("code_o", "code_i", "code_f"):
        assert buffers.tasks(task_type) == plain.tasks(task_type)
    assert counting.batches == 1
    # each distinct (program, input) pair once, run twice (determinism): code_o and code_i share their 12 triplets,
    # and two code_f pairs are triplets too
    pairs = {(r["program"], x) for r in _shipped_records() for x in r["inputs"]}
    assert len(pairs) == 50 and counting.jobs == 2 * len(pairs)


@pytest.mark.parametrize("line,pair,task_type", [(3, 0, "code_o"), (20, 0, "code_i"), (27, 7, "code_f")])
def test_a_wrong_gold_output_is_an_error_naming_the_file_and_line(sandbox, tmp_path, line, pair, task_type):
    """Catches: loading a seed file without running it (a wrong output then grades every right answer wrong),
    and an error that does not say where. A hidden code_f pair is checked too."""
    records = _shipped_records()
    record = records[line - 1]
    assert record["task_type"] == task_type
    record["outputs"][pair] = "'not what it returns'"
    path = _write(tmp_path, records)
    with pytest.raises(SeedFileError) as err:
        load_seed_file(path, sandbox)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: wrong seed task ({task_type}): its program returns ")
    assert "the file says \"'not what it returns'\"" in message and "\n" not in message


def test_an_invalid_seed_program_is_an_error_naming_the_line_and_why(sandbox, tmp_path):
    """Catches: a seed task whose program breaks the task rules (here a banned module) accepted as gold."""
    records = _shipped_records()
    records[1]["program"] = "import os\ndef f(x):\n    return os.getpid()\n"
    path = _write(tmp_path, records)
    with pytest.raises(SeedFileError, match=rf"^{path}:2: .*not a valid task on input '3' \(banned_module:os\)"):
        load_seed_file(path, sandbox)


def test_every_bad_line_is_counted_and_the_first_named(sandbox, tmp_path):
    records = _shipped_records()
    for index in (4, 9, 14):
        records[index]["outputs"][0] = "0.5"
    path = _write(tmp_path, records)
    with pytest.raises(SeedFileError, match=rf"^{path}:5: .*\(2 more bad line\(s\): 10, 15\)$"):
        load_seed_file(path, sandbox)


def test_a_malformed_record_names_its_line(sandbox, tmp_path):
    path = tmp_path / "seeds.jsonl"
    path.write_text(SHIPPED.read_text().splitlines()[0] + "\n\n" + json.dumps({"task_type": "code_o"}) + "\n")
    with pytest.raises(SeedFileError, match=rf"^{path}:3: not a task record"):
        load_seed_file(path, sandbox)


def test_the_loop_verifies_its_seed_file(sandbox, tmp_path):
    """Catches: SelfPlay.seed_buffers loading --populora.seed_file unverified (TaskBuffers.load)."""
    from openrlhf_populora.config import Config

    records = _shipped_records()
    records[0]["outputs"][0] = "'Hello'"
    config = Config()
    config.populora.seed_file = str(_write(tmp_path, records))
    loop = SelfPlay(config, engine=None, sandbox=sandbox, run_dir=tmp_path / "run")
    with pytest.raises(SeedFileError, match=r"seeds.jsonl:1: wrong seed task \(code_o\)"):
        loop.seed_buffers()


def test_the_callers_rules_verify_the_seed_file(sandbox, tmp_path):
    """Catches: ``load_seed_file`` verifying with the default rules instead of the ``rules`` it was given (a seed
    that breaks the run's own task rules would then be accepted as gold)."""
    from openrlhf_populora.tasks import TaskRules
    from openrlhf_populora.tasks.rules import DEFAULT_BANNED_MODULES

    path = _write(tmp_path, [{"task_type": "code_o", "program": "import math\ndef f(x):\n    return math.floor(x)\n",
                              "inputs": ["2.5"], "outputs": ["2"]}])
    assert load_seed_file(path, sandbox).size("code_o") == 1  # math is allowed by default
    rules = TaskRules(banned_modules=(*DEFAULT_BANNED_MODULES, "math"))
    with pytest.raises(SeedFileError, match=rf"^{path}:1: .*not a valid task on input '2.5' \(banned_module:math\)"):
        load_seed_file(path, sandbox, rules=rules)
