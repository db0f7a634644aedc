"""Build configs/seeds/basic.jsonl: small, easy seed tasks, each checked valid in the sandbox.

Run from the repository root: .venv/bin/python configs/seeds/make_basic.py
"""
from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.tasks import TaskBuffers, check_proposals

TRIPLETS = [
    ("def f(x):\n    return x", "'Hello world'"),
    ("def f(x):\n    return x + 1", "3"),
    ("def f(a, b):\n    return a * b", "4, 5"),
    ("def f(s):\n    return s[::-1]", "'abc'"),
    ("def f(xs):\n    return sum(xs)", "[1, 2, 3]"),
    ("def f(xs):\n    return max(xs) - min(xs)", "[4, 9, 2]"),
    ("def f(s):\n    return s.upper()", "'hi there'"),
    ("def f(n):\n    return [i * i for i in range(n)]", "4"),
    ("def f(s):\n    return len(s.split())", "'a b c d'"),
    ("def f(x):\n    if x % 2 == 0:\n        return 'even'\n    return 'odd'", "7"),
    ("def f(d):\n    return sorted(d.keys())", "{'b': 1, 'a': 2}"),
    ("def f(n):\n    total = 0\n    for i in range(1, n + 1):\n        total += i\n    return total", "5"),
]
INDUCTION = [
    ("def f(x):\n    return x + 1", [str(i) for i in (0, 1, 2, 5, 10, -3, 7, 100, 42, 9)], "Add one."),
    ("def f(s):\n    return s[::-1]", ["'ab'", "'abc'", "'x'", "'hello'", "''", "'level'", "'12'", "'ok'", "'tree'", "'zz'"], "Reverse the string."),
    ("def f(xs):\n    return sum(xs)", ["[1]", "[1, 2]", "[]", "[5, 5]", "[1, 2, 3]", "[-1, 1]", "[10]", "[2, 2, 2]", "[0]", "[7, 3]"], "Add up the list."),
    ("def f(x):\n    return x * 2", [str(i) for i in (0, 1, 2, 3, 4, -1, 10, 25, 8, 11)], "Double it."),
]
def triplet(p, i):
    return f"<answer>\n```python\n{p}\n```\n```input\n{i}\n```\n</answer>"
def induction(ins, msg):
    return "<answer>" + "".join(f"```input\n{x}\n```\n" for x in ins) + f"```message\n{msg}\n```</answer>"
buffers = TaskBuffers()
with Sandbox(workers=2) as sb:
    for tt in ("code_o", "code_i"):
        for c in check_proposals(tt, [triplet(p, i) for p, i in TRIPLETS], sb, proposer="seed", step=0):
            assert c.valid, c.reason
            buffers.add(c.task)
    checks = check_proposals("code_f", [induction(ins, m) for _, ins, m in INDUCTION], sb,
                             programs=[p for p, _, _ in INDUCTION], proposer="seed", step=0)
    for c in checks:
        assert c.valid, c.reason
        buffers.add(c.task)
buffers.save("configs/seeds/basic.jsonl")
print({t: buffers.size(t) for t in ("code_o", "code_i", "code_f")})
