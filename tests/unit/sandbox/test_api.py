"""The Sandbox API: ordinary programs come back exactly, bad input fails clearly, jobs do not see each other."""

from __future__ import annotations

import ast
import gc
import os

import pytest

from openrlhf_populora.sandbox import ExecResult, Sandbox
from openrlhf_populora.sandbox.isolation import bwrap_problem

ISOLATIONS = ["rlimits"] + (["bwrap"] if bwrap_problem() is None else [])


@pytest.fixture(scope="module", params=ISOLATIONS)
def sb(request):
    with Sandbox(workers=2, timeout_s=3.0, memory_mb=256, isolation=request.param) as box:
        yield box


# (code, expr, the exact repr a plain CPython gives)
ORDINARY = [
    ("def f(x):\n    return x * 2\n", "f(21)", "42"),
    ("def f(s):\n    return s[::-1]\n", "f('hello')", "'olleh'"),
    ("def f(xs):\n    return sorted(xs, reverse=True)\n", "f([3, 1, 2])", "[3, 2, 1]"),
    ("def f(d):\n    return {k: v * v for k, v in d.items()}\n", "f({'a': 2, 'b': 3})", "{'a': 4, 'b': 9}"),
    ("def f():\n    return (1, 'two', 3.5, None, True)\n", "f()", "(1, 'two', 3.5, None, True)"),
    ("def f(n):\n    return 0.1 * n\n", "f(3)", "0.30000000000000004"),
    ("import math\n\ndef f(x):\n    return math.sqrt(x)\n", "f(2)", "1.4142135623730951"),
    ("from collections import Counter\n\ndef f(s):\n    return sorted(Counter(s).items())\n",
     "f('abca')", "[('a', 2), ('b', 1), ('c', 1)]"),
    ("def f(n):\n    return n if n < 2 else f(n - 1) + f(n - 2)\n", "f(15)", "610"),
    ("class P:\n    def __init__(self, x):\n        self.x = x\n    def __repr__(self):\n"
     "        return f'P({self.x})'\n\ndef f(x):\n    return [P(x), P(x + 1)]\n", "f(1)", "[P(1), P(2)]"),
    ("def f(s):\n    return s.upper() + '\\u00e9\\n'\n", "f('x')", "'X\u00e9\\n'"),
    ("def f():\n    return frozenset({3})\n", "f()", "frozenset({3})"),
    ("def f(x):\n    print('side effect', x)\n    return x\n", "f(7)", "7"),
    ("x = 5\ny = [x] * 3\n", "y", "[5, 5, 5]"),
    ("", "2 ** 100", "1267650600228229401496703205376"),
    ("def f(a, b=2, *args, **kw):\n    return a, b, args, sorted(kw)\n", "f(1, 3, 4, z=1, y=2)",
     "(1, 3, (4,), ['y', 'z'])"),
    ("def f():\n    return float('nan'), float('inf'), -0.0\n", "f()", "(nan, inf, -0.0)"),
    ("def f():\n    return b'\\x00ab'\n", "f()", "b'\\x00ab'"),
    ("import itertools\n\ndef f(n):\n    return list(itertools.permutations(range(n)))[:2]\n", "f(3)",
     "[(0, 1, 2), (0, 2, 1)]"),
    ("def f(x):\n    return '\\ud800' + x\n", "f('a')", "'\\ud800a'"),  # a lone surrogate survives
]


def test_ordinary_programs_come_back_exactly_in_order(sb):
    results = sb.run([(code, expr) for code, expr, _ in ORDINARY])
    assert [r.status for r in results] == ["ok"] * len(ORDINARY), [r for r in results if not r.ok]
    assert [r.value for r in results] == [want for _, _, want in ORDINARY]
    assert all(isinstance(r, ExecResult) and r.error is None and r.wall_s >= 0 for r in results)


def test_many_answers_to_one_program_in_any_order(sb):
    """Jobs sharing code are grouped internally; results still map 1:1 to the inputs, in input order."""
    code_a = "def f(x):\n    return x + 1\n"
    code_b = "def f(x):\n    return x * 10\n"
    jobs = [(code_a if k % 3 else code_b, f"f({k})") for k in range(40)]
    results = sb.run(jobs)
    assert [r.value for r in results] == [repr(k + 1 if k % 3 else k * 10) for k in range(40)]


def test_answers_to_one_program_cannot_see_each_other(sb):
    """Each expression runs in its own process: mutations made by one are invisible to the next."""
    code = "STATE = []\n\ndef f(x):\n    STATE.append(x)\n    return list(STATE)\n"
    jobs = [(code, f"f({k})") for k in range(6)]
    jobs.append((code, "(__builtins__.__dict__.__setitem__('len', None), 'patched')[1]"))
    jobs.append((code, "len('abc')"))
    jobs.append((code, "(open('note.txt', 'w').write('x'), 'wrote')[1]"))
    jobs.append((code, "__import__('os').listdir('.')"))
    results = sb.run(jobs)
    assert [r.value for r in results[:6]] == [repr([k]) for k in range(6)]
    assert results[6].value == "'patched'" and results[7].value == "3"
    assert results[8].value == "'wrote'" and results[9].value == "[]"


def test_answers_that_do_not_compile_are_errors_among_good_ones(sb):
    """Answers to one program are compiled before their process forks; one that is not Python (anywhere in
    the group, the last included) is an error, and the answers around it still run, each on its own."""
    code = "COUNT = [0]\n\ndef f(x):\n    COUNT[0] += 1\n    return (x, COUNT[0])\n"
    exprs = ["f(1)", "f(", "f(2)", "f(3) +", "(lambda: yield)()", "f(4)", "f(5"]
    results = sb.run([(code, e) for e in exprs])
    assert [r.status for r in results] == ["ok", "error", "ok", "error", "error", "ok", "error"]
    assert [r.value for r in results if r.ok] == ["(1, 1)", "(2, 1)", "(4, 1)"]
    assert all(r.error.startswith("SyntaxError: ") for r in results if not r.ok)


def test_code_state_is_shared_by_its_answers_but_not_across_programs(sb):
    results = sb.run([("import os\nos.environ['MARK'] = '1'\n", "os.environ.get('MARK')"),
                      ("import os\n", "os.environ.get('MARK')")])
    assert [r.value for r in results] == ["'1'", "None"]


def test_errors_name_the_exception(sb):
    results = sb.run([
        ("def f(:\n", "f()"),                        # code is not Python
        ("def f():\n    return 1\n", "f("),          # expr is not Python
        ("def f(x):\n    return 1 / x\n", "f(0)"),
        ("raise KeyError('k')\n", "1"),
        ("def f():\n    assert False\n", "f()"),
        ("import sys\n", "sys.exit(3)"),
        ("class E(Exception):\n    def __str__(self):\n        raise ValueError\n", "(_ for _ in ()).throw(E())"),
    ])
    assert [r.status for r in results] == ["error"] * 7
    assert results[0].error.startswith("SyntaxError: ")
    assert results[1].error.startswith("SyntaxError: ")
    assert results[2].error == "ZeroDivisionError: division by zero"
    assert results[3].error == "KeyError: 'k'"
    assert results[4].error == "AssertionError: "
    assert results[5].error == "SystemExit: 3"
    assert results[6].error == "E: <unprintable>"
    assert all(r.value is None for r in results)


def test_one_bad_job_does_not_affect_the_others(sb):
    code = "def f(x):\n    return x\n"
    jobs = [(code, "f(1)"), (code, "__import__('os')._exit(0)"), (code, "f(2)"),
            ("import time\n", "time.sleep(60)"), (code, "f(3)"), ("x = 1\n", "[0] * (10 ** 10)")]
    results = sb.run(jobs)
    assert [r.status for r in results] == ["ok", "killed", "ok", "timeout", "ok", "memory"]
    assert [r.value for r in results if r.ok] == ["1", "2", "3"]


def test_output_limits():
    with Sandbox(workers=1, timeout_s=3.0, max_output_chars=50, max_stdout_chars=1000,
                 isolation="rlimits") as box:
        results = box.run([("", "'x' * 48"), ("", "'x' * 49"), ("print('y' * 999)\n", "1"),
                           ("print('y' * 1000)\n", "1"), ("", "print('z' * 5000)"),
                           ("import sys\n", "sys.stdout.write('w' * 2000)"),
                           ("try:\n    print('q' * 5000)\nexcept BaseException:\n    pass\n", "'caught'")])
    assert [r.status for r in results] == ["ok", "output_limit", "ok", "output_limit", "output_limit",
                                           "output_limit", "output_limit"]
    assert results[0].value == "'" + "x" * 48 + "'"
    assert all(r.value is None for r in results[1:] if not r.ok)


def test_empty_batch_and_bad_input(sb):
    assert sb.run([]) == []
    for bad in ["print(1)", None, 3, [("a",)], [("a", "b", "c")], [(b"x", "1")], [("x", 1)], ["ab"]]:
        with pytest.raises(TypeError):
            sb.run(bad)
    assert sb.run((("", "1"),))[0].value == "1"  # any sequence of pairs will do


@pytest.mark.parametrize("kwargs, exc", [
    ({"workers": 0}, ValueError), ({"workers": 1.5}, TypeError), ({"timeout_s": 0}, ValueError),
    ({"timeout_s": "1"}, TypeError), ({"memory_mb": 8}, ValueError), ({"isolation": "docker"}, ValueError),
    ({"max_output_chars": 0}, ValueError), ({"hash_seed": -1}, ValueError),
])
def test_bad_arguments_fail_clearly(kwargs, exc):
    with pytest.raises(exc):
        Sandbox(**kwargs)


def test_hash_seed_makes_set_order_reproducible():
    job = [("s = {'apple', 'banana', 'cherry', 'date', 'elder', 'fig', 'grape'}\n", "list(s)"),
           ("", "hash('populora')")]
    with Sandbox(workers=1, hash_seed=0, isolation="rlimits") as a, Sandbox(workers=1, hash_seed=0) as b:
        first, second = a.run(job), b.run(job)
    with Sandbox(workers=1, hash_seed=1, isolation="rlimits") as c:
        third = c.run(job)
    assert [r.value for r in first] == [r.value for r in second]
    assert first[1].value != third[1].value


def test_stats_count_every_job(sb):
    before = sb.stats()
    sb.run([("", "1"), ("", "1/0"), ("", "2")])
    after = sb.stats()
    assert after["executions"] - before["executions"] == 3
    assert after["status_ok"] - before["status_ok"] == 2
    assert after["status_error"] - before["status_error"] == 1
    assert after["failures"] - before["failures"] == 1
    assert after["batches"] - before["batches"] == 1
    assert 0 < after["latency_mean_s"] and after["latency_p50_s"] <= after["latency_p95_s"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_close_without_context_manager_leaves_no_process():
    box = Sandbox(workers=2, timeout_s=1.0, isolation="rlimits")
    pids = [w.proc.pid for w in box._pool]
    results = box.run([("import time\n", "time.sleep(30)"), ("", "1")] * 2)
    assert [r.status for r in results] == ["timeout", "ok"] * 2
    box.close()
    box.close()  # idempotent
    assert not any(_alive(p) for p in pids)
    with pytest.raises(RuntimeError):
        box.run([("", "1")])


def test_garbage_collected_sandbox_stops_its_workers():
    box = Sandbox(workers=1, isolation="rlimits")
    pid = box._pool[0].proc.pid
    del box
    gc.collect()
    assert not _alive(pid)


def test_many_runs_on_one_sandbox(sb):
    for k in range(20):
        assert sb.run([("", f"{k} + 1")])[0].value == str(k + 1)


def test_job_sees_a_private_empty_directory_and_a_scrubbed_environment(sb):
    os.environ["POPULORA_TEST_SECRET"] = "hunter2"
    try:
        results = sb.run([("import os\n", "(os.listdir('.'), sorted(os.environ))"),
                          ("open('a.txt', 'w').write('1')\n", "__import__('os').listdir('.')"),
                          ("import os\n", "os.listdir('.')")])
    finally:
        del os.environ["POPULORA_TEST_SECRET"]
    listing, names = ast.literal_eval(results[0].value)
    assert listing == [] and "POPULORA_TEST_SECRET" not in names
    assert set(names) <= {"PATH", "LANG", "LC_ALL", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                          "PYTHONIOENCODING", "HOME", "TMPDIR"}
    assert results[1].value == "['a.txt']" and results[2].value == "[]"


def test_site_packages_only_on_request():
    job = [("import yaml\n", "yaml.safe_load('a: 1')")]
    with Sandbox(workers=1, isolation="rlimits") as plain, \
            Sandbox(workers=1, isolation="rlimits", site_packages=True) as full:
        assert plain.run(job)[0].error == "ModuleNotFoundError: No module named 'yaml'"
        assert full.run(job)[0].value == "{'a': 1}"


def test_a_bad_answer_in_a_group_fails_alone():
    """Answers to one program: one that hangs, one that kills the process holding the program, one that
    exits; each fails alone and the others (before and after it) still get their verdicts."""
    code = "import os, signal\n\ndef f(x):\n    return x * x\n"
    exprs = ["f(1)", "[0 for _ in iter(int, 1)]", "f(2)", "os.kill(os.getppid(), signal.SIGKILL)", "f(3)",
             "os._exit(1)", "f(4)"]
    with Sandbox(workers=1, timeout_s=1.0, isolation="rlimits") as box:
        results = box.run([(code, e) for e in exprs])
    assert [r.status for r in results] == ["ok", "timeout", "ok", "killed", "ok", "killed", "ok"]
    assert [r.value for r in results if r.ok] == ["1", "4", "9", "16"]


def test_a_str_subclass_from_repr_cannot_bend_the_verdict():
    code = ("class S(str):\n    def __len__(self):\n        return 0\n    def encode(self, *a, **k):\n"
            "        return b'forged'\n\nclass A:\n    def __repr__(self):\n        return S('x' * 120)\n")
    with Sandbox(workers=1, max_output_chars=100, isolation="rlimits") as box:
        small, big = box.run([(code.replace("120", "20"), "A()"), (code, "A()")])
    assert (small.status, small.value) == ("ok", "x" * 20)
    assert big.status == "output_limit" and big.value is None


def test_interpreter_under_a_private_tmpfs_is_bound_back():
    """A checkout or virtualenv under /tmp (common for CI clones) stays visible inside the sandbox."""
    import os
    import sys

    from openrlhf_populora.sandbox import isolation

    prefix = os.path.realpath(sys.prefix)
    parent = os.path.dirname(prefix)
    hidden = isolation.hidden_interpreter_paths((parent,))
    assert prefix in hidden[parent]
