"""Every benchmark loader on a small fixture in its published format, and clear errors on bad input."""

from __future__ import annotations

import base64
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
from paths import EVAL_DATA

from openrlhf_populora.eval.benchmarks import (
    BENCHMARKS,
    PAPER_BENCHMARKS,
    BenchmarkFormatError,
    load_benchmark,
    parse_benchmark_names,
)


def test_humaneval_plus_fixture():
    problems = load_benchmark("humaneval_plus", EVAL_DATA)
    assert [p.problem_id for p in problems] == ["HumanEval/0", "HumanEval/2", "HumanEval/32"]
    first = problems[0]
    assert first.kind == "code" and first.entry_point == "below_zero"
    assert first.starter_code.startswith("from typing import List")
    assert first.tests["kind"] == "io"
    assert len(first.tests["inputs"]) == 6  # base_input + plus_input
    assert first.tests["reference"].startswith(first.starter_code)  # stub + body
    assert problems[1].tests["atol"] == 1e-6


def test_mbpp_plus_fixture():
    problems = load_benchmark("mbpp_plus", EVAL_DATA)
    assert [p.problem_id for p in problems] == ["Mbpp/2", "Mbpp/3"]
    assert problems[1].starter_code == ""  # MBPP+ references are whole programs
    assert "def is_not_prime" in problems[1].tests["reference"]


def test_livecodebench_fixture_decodes_compressed_private_tests():
    stdin, functional = load_benchmark("livecodebench", EVAL_DATA)
    assert stdin.tests["kind"] == "stdin" and len(stdin.tests["cases"]) == 3  # 1 public + 2 compressed private
    assert stdin.tests["cases"][2] == ["4\n10 20 30 40\n", "100\n40\n"]
    assert functional.tests["kind"] == "functional" and functional.tests["func_name"] == "twoSum"
    assert functional.starter_code.startswith("class Solution")


@pytest.mark.parametrize(
    ("name", "answers"),
    [
        ("gsm8k", ["10", "2400"]),  # "#### N" with the thousands separator removed
        ("math500", ["\\frac{1}{2}", "3"]),
        ("minerva", ["6"]),  # from the solution's \boxed{} (minerva/test.jsonl layout)
        ("olympiadbench", ["$\\sqrt{2}$"]),  # final_answer list
        ("amc23", ["27"]),  # 27.0 -> "27"
        ("aime24", ["24"]),
        ("aime25", ["99"]),
    ],
)
def test_math_fixtures(name, answers):
    problems = load_benchmark(name, EVAL_DATA)
    assert [p.answer for p in problems] == answers
    assert all(p.kind == "math" and p.question for p in problems)


def test_limit_takes_the_first_problems():
    assert [p.problem_id for p in load_benchmark("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_benchmark_names():
    assert parse_benchmark_names("humaneval, GSM8K,humaneval") == ["humaneval", "gsm8k"]
    assert parse_benchmark_names("paper") == list(PAPER_BENCHMARKS)
    assert len(PAPER_BENCHMARKS) == 10 and set(PAPER_BENCHMARKS) <= set(BENCHMARKS)
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'"):
        parse_benchmark_names("humaneval,mmlu")


# ------------------------------------------------------------------------------------ bad input


def write(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_missing_file_names_the_paths_and_the_fix(tmp_path):
    with pytest.raises(BenchmarkFormatError) as err:
        load_benchmark("mbpp_plus", tmp_path)
    assert str(tmp_path / "MbppPlus.jsonl") in str(err.value) and "--data-dir" in str(err.value)
    with pytest.raises(BenchmarkFormatError, match="no data file found"):
        load_benchmark("gsm8k", None)


def test_missing_field_names_file_line_and_field(tmp_path):
    record = json.loads((EVAL_DATA / "MbppPlus.jsonl").read_text().splitlines()[0])
    del record["base_input"]
    path = write(tmp_path / "MbppPlus.jsonl", [json.loads((EVAL_DATA / "MbppPlus.jsonl").read_text().splitlines()[1]), record])
    with pytest.raises(BenchmarkFormatError) as err:
        load_benchmark("mbpp_plus", tmp_path)
    message = str(err.value)
    assert f"{path}:2" in message and "'base_input'" in message and "EvalPlus records" in message


def test_malformed_json_line(tmp_path):
    path = write(tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "#### 1"}, "{not json"])
    with pytest.raises(BenchmarkFormatError, match=f"{path}:2: not valid JSON"):
        load_benchmark("gsm8k", tmp_path)


def test_wrong_field_type(tmp_path):
    write(tmp_path / "math500.jsonl", [{"problem": ["a list"], "answer": "1"}])
    with pytest.raises(BenchmarkFormatError, match="field 'problem' should be str, got list"):
        load_benchmark("math500", tmp_path)


def test_math_record_without_an_answer(tmp_path):
    write(tmp_path / "aime24.jsonl", [{"problem": "p", "solution": "no box here"}])
    with pytest.raises(BenchmarkFormatError, match="no gold answer"):
        load_benchmark("aime24", tmp_path)


def test_duplicate_ids(tmp_path):
    write(tmp_path / "aime25.jsonl", [{"id": 1, "problem": "p", "answer": "1"}, {"id": 1, "problem": "q", "answer": "2"}])
    with pytest.raises(BenchmarkFormatError, match="duplicate problem id '1'"):
        load_benchmark("aime25", tmp_path)


def test_livecodebench_rejects_undecodable_tests(tmp_path):
    record = json.loads((EVAL_DATA / "livecodebench.jsonl").read_text().splitlines()[0])
    record["private_test_cases"] = "this is not base64 nor json"
    write(tmp_path / "livecodebench.jsonl", [record])
    with pytest.raises(BenchmarkFormatError, match="private_test_cases"):
        load_benchmark("livecodebench", tmp_path)


def test_livecodebench_refuses_pickled_objects(tmp_path):
    """The compressed test format is a pickle: anything but plain data is refused, never executed."""

    # eval, not print: an in-process Ray progress bar swaps builtins.print for ray's safe_print in this process
    class Evil:
        def __reduce__(self):
            return (eval, ("__import__('os').environ.__setitem__('POPULORA_PWNED', '1')",))

    record = json.loads((EVAL_DATA / "livecodebench.jsonl").read_text().splitlines()[0])
    record["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    write(tmp_path / "livecodebench.jsonl", [record])
    with pytest.raises(BenchmarkFormatError, match="refusing to load builtins.eval"):
        load_benchmark("livecodebench", tmp_path)
    assert "POPULORA_PWNED" not in os.environ


def test_livecodebench_functional_needs_func_name(tmp_path):
    record = json.loads((EVAL_DATA / "livecodebench.jsonl").read_text().splitlines()[1])
    record["metadata"] = "{}"
    write(tmp_path / "livecodebench.jsonl", [record])
    with pytest.raises(BenchmarkFormatError, match="metadata.func_name"):
        load_benchmark("livecodebench", tmp_path)


def test_livecodebench_directory_of_release_files(tmp_path):
    lines = (EVAL_DATA / "livecodebench.jsonl").read_text().splitlines()
    write(tmp_path / "livecodebench" / "test.jsonl", [lines[0]])
    write(tmp_path / "livecodebench" / "test2.jsonl", [lines[1]])
    assert [p.problem_id for p in load_benchmark("livecodebench", tmp_path)] == ["abc999_a", "9001"]


def test_gzipped_evalplus_release(tmp_path):
    import gzip

    with gzip.open(tmp_path / "HumanEvalPlus-v0.1.10.jsonl.gz", "wt") as handle:
        handle.write((EVAL_DATA / "HumanEvalPlus.jsonl").read_text())
    assert len(load_benchmark("humaneval_plus", tmp_path)) == 3
