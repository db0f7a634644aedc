"""The AZR domain: three code task types, their prompts, parsing of model text, validity rules, answer
verification (through the sandbox), task buffers and seeding. No torch, no engine.

Module map: ``records`` (Task), ``prompts``, ``parsing`` (answer regions, fenced blocks), ``values``
(value-literal grammar), ``programs`` (program parsing, entry ``f``), ``rules`` (validity rule list),
``harness`` (sandbox items), ``checks`` (proposal validity), ``verify`` (answer verification), ``buffers``.
"""

from openrlhf_populora.tasks.buffers import Seeder, SeedRequest, TaskBuffers
from openrlhf_populora.tasks.checks import ProposalCheck, check_proposal, check_proposals
from openrlhf_populora.tasks.parsing import ParseError, extract_answer
from openrlhf_populora.tasks.programs import Program, parse_program
from openrlhf_populora.tasks.prompts import (
    COMPACT_TEMPLATES,
    DEFAULT_TEMPLATES,
    R1_SYSTEM,
    PromptTemplates,
    proposer_prompt,
    render_raw,
    solver_prompt,
)
from openrlhf_populora.tasks.records import TASK_TYPES, Task, zero_induction_task, zero_triplet
from openrlhf_populora.tasks.rules import AZR_BANNED_WORDS, DEFAULT_BANNED_MODULES, TaskRules, rule_violations
from openrlhf_populora.tasks.values import literal_value, parse_arguments, parse_value
from openrlhf_populora.tasks.verify import Verdict, verify_answer, verify_answers

__all__ = [
    "AZR_BANNED_WORDS", "COMPACT_TEMPLATES", "DEFAULT_BANNED_MODULES", "DEFAULT_TEMPLATES", "ParseError", "Program", "PromptTemplates",
    "ProposalCheck", "R1_SYSTEM", "SeedRequest", "Seeder", "TASK_TYPES", "Task", "TaskBuffers", "TaskRules",
    "Verdict", "check_proposal", "check_proposals", "extract_answer", "literal_value", "parse_arguments",
    "parse_program", "parse_value", "proposer_prompt", "render_raw", "rule_violations", "solver_prompt",
    "verify_answer", "verify_answers", "zero_induction_task", "zero_triplet",
]
