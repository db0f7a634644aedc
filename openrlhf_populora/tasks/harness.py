"""The Python source we append to a program before it runs in the sandbox, and the sandbox items.

A sandbox item is ``(code, expr)``: the sandbox ``exec``s ``code`` in a fresh namespace, then returns
``repr(eval(expr))``; items with identical ``code`` share one ``exec`` and each expression runs in its own
forked process with its own time limit, so answers to one task share the program's start-up work. ``code`` is the program followed by the harness functions below; ``expr`` calls one of
them with every model-provided text passed as a string *literal* (data), never spliced into source.
Argument lists and values reaching the harness have already been checked to be pure value literals.

Each harness function returns a tuple of constants, which the caller reads back with the value-literal
parser (nothing is evaluated in the trainer process).
"""

from __future__ import annotations

from openrlhf_populora.tasks.values import ParseError, literal_value

HARNESS = '''

def __populora_args__(*args, **kwargs):
    return args, kwargs


def __populora_probe__(args_src, cap):
    """Run f on one argument list: ('ok', repr, round_trips) or ('too_long', length, False)."""
    args, kwargs = eval("__populora_args__(" + args_src + "\\n)")
    out = f(*args, **kwargs)
    text = repr(out)
    if not isinstance(text, str) or len(text) > cap:
        return ("too_long", len(text) if isinstance(text, str) else -1, False)
    try:
        same = (eval(text) == out) is True
    except Exception:
        same = False
    return ("ok", text, same)


def __populora_outputs__(arg_srcs, cap):
    """repr of f on each argument list; None where f raised or the repr is over the cap."""
    results = []
    for args_src in arg_srcs:
        try:
            args, kwargs = eval("__populora_args__(" + args_src + "\\n)")
            text = repr(f(*args, **kwargs))
            results.append(text if isinstance(text, str) and len(text) <= cap else None)
        except Exception:
            results.append(None)
    return tuple(results)


def __populora_same_output__(gold_src, pred_src):
    """Is the predicted output literal == the gold output (program classes in scope)?"""
    return (eval(gold_src) == eval(pred_src)) is True


def __populora_input_gives__(args_src, gold_src):
    """Does f(*predicted arguments) == the gold output?"""
    args, kwargs = eval("__populora_args__(" + args_src + "\\n)")
    return (f(*args, **kwargs) == eval(gold_src)) is True
'''


def with_harness(program_source: str) -> str:
    return program_source.rstrip("\n") + "\n" + HARNESS


def probe_item(program_source: str, args_src: str, cap: int, run: int = 0) -> tuple[str, str]:
    """``run`` k > 0 marks the code with a comment so that each run gets its own fresh process (the sandbox
    executes jobs with identical code once and forks per expression)."""
    code = with_harness(program_source) + (f"\n# determinism run {run}\n" if run else "")
    return code, f"__populora_probe__({args_src!r}, {int(cap)})"


def outputs_item(program_source: str, arg_srcs: list[str], cap: int) -> tuple[str, str]:
    return with_harness(program_source), f"__populora_outputs__({tuple(arg_srcs)!r}, {int(cap)})"


def same_output_item(program_source: str, gold_src: str, pred_src: str) -> tuple[str, str]:
    return with_harness(program_source), f"__populora_same_output__({gold_src!r}, {pred_src!r})"


def input_gives_item(program_source: str, args_src: str, gold_src: str) -> tuple[str, str]:
    return with_harness(program_source), f"__populora_input_gives__({args_src!r}, {gold_src!r})"


def read_result(result) -> object | None:
    """The harness's returned tuple/bool from a sandbox result, or None when it did not finish cleanly."""
    if getattr(result, "status", None) != "ok" or not isinstance(getattr(result, "value", None), str):
        return None
    try:
        return literal_value(result.value)
    except ParseError:
        return None
