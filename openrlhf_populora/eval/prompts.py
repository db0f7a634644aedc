"""Prompt templates for evaluation, following AZR's evaluation (paraphrased, not quoted).

Which template fits which model: a model is evaluated in the prompt format it was trained on.

- an AZR-trained policy, or adapters trained on raw prompts (``populora.chat_template: false``):
  ``azr`` (code) and ``azr_boxed`` (math), the raw R1 text it was trained on;
- an instruct or chat base model (``--base``), a full fine-tuned model whose tokenizer has a chat template
  (``--model``, e.g. stock OpenRLHF's checkpoint), or adapters trained with ``populora.chat_template: true``
  (the training default): ``chat``, its own chat template;
- a base model whose tokenizer has no chat template: ``azr`` / ``azr_boxed``.

The wrong one costs a lot: greedy Qwen2.5-Coder-0.5B-Instruct (the shipped model) solved 1 of the first 8
HumanEval problems under ``azr`` and 16 of the first 20 under ``chat``.

Templates (``--code-template`` / ``--math-template``):

``auto`` (the command line's default for both)
    Resolved once per evaluation by :func:`choose_templates` (through :func:`resolve_templates`): ``chat`` for
    both kinds when the base model's tokenizer has a chat template and no evaluated run was trained on raw
    prompts, else ``azr`` (code) and ``azr_boxed`` (math). A full model (``--model NAME=DIR``) is its own base:
    its tokenizer counts like the base model's (``chat`` needs every such tokenizer to have a chat template),
    and each model is rendered with its own template. The sources are the ``config.yaml`` of ``--run`` and
    ``--baseline`` (``populora.chat_template``); a bare ``--adapter`` is unknown and does not change the choice.
    Sources trained on different formats are refused (name both templates to evaluate them together anyway).
    The resolved name, never ``auto``, is what ``settings.json`` records, so resuming into the same output
    directory with a different resolution is refused like any other changed setting.
``azr``
    DeepSeek-R1-Zero style raw text, no chat template, as AZR trains and evaluates: a short system text saying
    the assistant thinks inside ``<think> </think>`` and answers inside ``<answer> </answer>``, then
    ``User: <task>``, then ``Assistant: <think>``. Code tasks ask for the complete program in a
    ```` ```python ```` block inside ``<answer>``; math tasks give the question alone.
``azr_boxed``
    ``azr`` plus an instruction to put the final answer in ``\\boxed{}`` (AZR's template for Coder models).
``chat``
    The task text (code: "answer in a python block"; math: "reason step by step, final answer in
    ``\\boxed{}``", the Qwen-boxed style) rendered through the model's own chat template.
``completion``
    Plain completion, no instructions: code problems give the function stub (HumanEval style) or the
    statement; math gives ``Question: ...\\nAnswer:``.

The answer is extracted the same way for every template (see ``extract``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from openrlhf_populora.eval.problems import CODE, Problem

TEMPLATES = ("azr", "azr_boxed", "chat", "completion")
AUTO = "auto"  # not a template: "pick one for this model" (see choose_templates)
TEMPLATE_CHOICES = (AUTO, *TEMPLATES)
RAW_TEMPLATES = {"code": "azr", "math": "azr_boxed"}  # for AZR-style policies and raw-prompt adapters
CHAT_TEMPLATES = {"code": "chat", "math": "chat"}  # for instruct/chat models and chat-trained adapters
DEFAULT_TEMPLATES = RAW_TEMPLATES  # ``EvalSettings``' default (library use); the command line defaults to auto

R1_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in its mind and then gives the User the answer. "
    "The reasoning process and the answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>."
)

_CODE_FORMAT = "Write your final solution as complete, self-contained Python code in one ```python``` block."
_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def code_task_text(problem: Problem) -> str:
    """The instruction text for a code problem (without any template wrapping)."""
    tests = problem.tests
    if tests.get("kind") in ("stdin", "functional"):  # LiveCodeBench
        parts = ["You will be given a programming problem. Write a correct Python program that passes all tests.",
                 "", "### Question:", problem.question.strip(), ""]
        if problem.starter_code.strip():
            parts += ["### Starter code (complete it; keep the class and method names):",
                      f"```python\n{problem.starter_code.rstrip()}\n```"]
        else:
            parts += ["### Input/output: read the input from standard input and write the answer to standard output "
                      "(do not test on the sample inputs yourself)."]
        return "\n".join(parts)
    if problem.starter_code.strip():  # HumanEval / HumanEval+: complete a function stub
        return ("Complete the following Python function; return the whole function, including the signature and "
                f"any imports it needs.\n```python\n{problem.starter_code.rstrip()}\n```")
    return (f"Solve the following problem with a self-contained Python function named `{problem.entry_point}`."
            f"\n```python\n{problem.question.strip()}\n```")


def render_prompt(problem: Problem, template: str, chat_render: Callable[[str], str] | None = None) -> str:
    """The exact text given to the model for ``problem`` under ``template``.

    ``chat_render`` turns one user message into the model's chat-formatted prompt; only ``chat`` needs it.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose one of {', '.join(TEMPLATES)}")
    code = problem.kind == CODE
    if template == "completion":
        if code:
            return problem.starter_code or problem.question
        return f"Question: {problem.question.strip()}\nAnswer:"
    if code:
        task = code_task_text(problem) + "\n" + _CODE_FORMAT
    else:
        task = problem.question.strip() + ("\n" + _BOXED if template in ("azr_boxed", "chat") else "")
    if template == "chat":
        if chat_render is None:
            raise ValueError("template 'chat' needs the model's chat template (chat_render)")
        return chat_render(task)
    if code:
        task += " Put that block inside <answer> </answer>."
    return f"{R1_SYSTEM}\nUser: {task}\nAssistant: <think>"


def _tokenizers(models: Sequence[str]) -> tuple[str, str]:
    """(subject, verb) naming the tokenizers of ``models`` in a sentence."""
    if len(models) == 1:
        return f"{models[0]}'s tokenizer", "has"
    return f"the tokenizers of {', '.join(models[:-1])} and {models[-1]}", "have"


def choose_templates(has_chat_template: bool, trained_with_chat: Mapping[str, bool | None],
                     models: Sequence[str] = ("the base model",)) -> tuple[dict[str, str], str]:
    """What ``auto`` means for one evaluation: ``({"code": ..., "math": ...}, why)``.

    ``has_chat_template``: whether the tokenizer of every model that renders prompts has one (``chat`` needs
    it); ``models`` names those models in the reason (those without a chat template when there are any).
    ``trained_with_chat``: for each evaluated source of adapters (a label such as ``--run runs/4t4s``), the
    ``populora.chat_template`` its training recorded, or None when unknown (a bare ``--adapter``). An adapter
    is evaluated in the prompt format it was trained on, so one raw-trained source makes the choice ``azr``;
    sources trained on different formats cannot share one template and raise ``ValueError``.
    """
    raw = [source for source, chat in trained_with_chat.items() if chat is False]
    chat = [source for source, chat in trained_with_chat.items() if chat is True]
    unknown = [source for source, chat in trained_with_chat.items() if chat is None]
    if raw and chat:
        raise ValueError(f"{', '.join(raw)} trained on raw prompts (populora.chat_template: false) but "
                         f"{', '.join(chat)} with the chat template: one prompt template cannot fit both. Fix: "
                         "evaluate them in separate invocations, or pass --code-template and --math-template.")
    if raw:
        return dict(RAW_TEMPLATES), f"{', '.join(raw)} trained on raw R1-style prompts (populora.chat_template: false)"
    tokenizers, verb = _tokenizers(models)
    if not has_chat_template:
        return dict(RAW_TEMPLATES), f"{tokenizers} {verb} no chat template"
    why = f"{tokenizers} {verb} a chat template"
    if chat:
        why += f" and {', '.join(chat)} trained with it (populora.chat_template: true)"
    if unknown:
        why += (f"; how {', '.join(unknown)} was trained is not recorded (pass --code-template azr "
                "--math-template azr_boxed if on raw prompts)")
    return dict(CHAT_TEMPLATES), why


def resolve_templates(
    requested: Mapping[str, str], has_chat_template: bool, trained_with_chat: Mapping[str, bool | None],
    models: Sequence[str] = ("the base model",),
) -> tuple[dict[str, str], str]:
    """The templates one evaluation uses: ``requested`` (``{"code": ..., "math": ...}``, each a template or
    ``auto``) with ``auto`` resolved by :func:`choose_templates`, and a sentence saying why.

    Raises ``ValueError`` for an unknown name, for sources that disagree while a kind is ``auto``, and for
    ``chat`` when the base model's tokenizer has no chat template (``has_chat_template`` and ``models``: as for
    :func:`choose_templates`).
    """
    for kind, name in requested.items():
        if name not in TEMPLATE_CHOICES:
            raise ValueError(f"{kind} template {name!r}: choose one of {', '.join(TEMPLATE_CHOICES)}")
    resolved, reasons = dict(requested), []
    if AUTO in requested.values():
        chosen, why = choose_templates(has_chat_template, trained_with_chat, models)
        auto_kinds = [kind for kind, name in requested.items() if name == AUTO]
        resolved.update({kind: chosen[kind] for kind in auto_kinds})
        reasons.append(f"{' and '.join(auto_kinds)}: auto, because {why}")
    given = [kind for kind, name in requested.items() if name != AUTO]
    if given:
        reasons.append(f"{' and '.join(given)}: as given")
    if not has_chat_template:
        needs_chat = [kind for kind, name in resolved.items() if name == "chat"]
        if needs_chat:
            owners = " and ".join(f"{m}'s" for m in models)
            theirs = "its tokenizer has" if len(models) == 1 else "their tokenizers have"
            raise ValueError(f"the {' and '.join(needs_chat)} template 'chat' needs {owners} chat template, "
                             f"and {theirs} none. Fix: pass --code-template azr --math-template azr_boxed "
                             "(or completion).")
    return resolved, "; ".join(reasons)


def model_has_chat_template(model_dir: str) -> bool:
    """Whether the tokenizer saved in ``model_dir`` (a local HF directory) has a chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return bool(getattr(tokenizer, "chat_template", None))
