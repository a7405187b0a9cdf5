"""The prompt format, and how numbers and answers are written.

A prompt is its task's template (`data.prompt_template` for gsm8k and arith, `tasks.<name>.prompt`
for a task of yours: `pipeline.data.tasks.task_template`) with `{question}` substituted (plain substitution, not
`str.format`, so braces in a question are harmless). A response is what the policy generates after
the prompt: the SFT target is `response_text(solution)` and ends, after the reasoning, with
`<answer>N</answer>`. The prompt and the response are tokenized separately (prompt ids + response
ids), exactly as a rollout sees them, so no BPE merge crosses the boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeline.core.config import DEFAULT_TEMPLATE, DataConfig
from pipeline.data.tokenizer import ANSWER_CLOSE, ANSWER_OPEN


def format_prompt(question: str, template: str = DEFAULT_TEMPLATE) -> str:
    """The prompt for one question: the template with `{question}` replaced."""
    if "{question}" not in template:
        raise ValueError("prompt template must contain {question}")
    return template.replace("{question}", question.strip())


def format_number(x: float) -> str:
    """Canonical text of a gold number: no commas, no trailing `.0` (72.0 -> "72", -0.5 -> "-0.5")."""
    if not math.isfinite(x):
        raise ValueError(f"not a finite number: {x!r}")
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return repr(float(x))


def format_answer(x: float) -> str:
    """`<answer>N</answer>` with N in canonical form."""
    return f"{ANSWER_OPEN}{format_number(x)}{ANSWER_CLOSE}"


def response_text(solution: str) -> str:
    """The text the policy should generate after the prompt for this solution (a leading space)."""
    return " " + solution


def fewshot_prompt(question: str, shots: Sequence[tuple[str, str]], tokenizer, data: DataConfig,
                   template: str | None = None) -> str:
    """`question` after the worked examples `shots` ((question, solution) pairs), in the prompt format of
    training: under the chat template each example is an earlier user turn (the filled `template`, the
    task's prompt; default `data.prompt_template`) and its assistant answer; without it, each example's
    prompt and response text, a blank line apart. Evaluation's few-shot entries and GRPO's scaffolded
    prompts are both this."""
    template = template or data.prompt_template
    if data.chat_template:
        turns = [(format_prompt(q, template), a) for q, a in shots]
        return tokenizer.chat_prompt(format_prompt(question, template), data.system_prompt, turns)
    shown = "".join(format_prompt(q, template) + response_text(a) + "\n\n" for q, a in shots)
    return shown + format_prompt(question, template)
