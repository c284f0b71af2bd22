"""JSONL datasets: the GSM8K layout and a generic ``{prompt, answer}`` layout.

Layouts:
- ``gsm8k``: ``{"question": ..., "answer": "<worked solution>\\n#### 18"}``; the gold answer is the
  number after ``####``, the worked solution (with its ``#### N`` line) is the SFT target.
- ``generic``: ``{<prompt_field>: ..., <answer_field>: ...}``; the answer is the gold answer and
  the SFT target.

Responses are scored by numeric answer extraction (``moerl.tasks.answers``). Every malformed input
raises ``DatasetError`` naming the file and the 1-based line. The split is fixed by a hash of each
record's prompt: the ``num_eval`` records with the smallest hashes are held out (at most half).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moerl.tasks.answers import answers_match, extract_answer, format_number
from moerl.tasks.base import Prompt, Reward, ScoreFn, Task, stable_hash

LAYOUTS = ("gsm8k", "generic")
"""The JSONL layouts ``load_jsonl`` reads (``task.layout``; see the module docstring)."""


class DatasetError(ValueError):
    """A dataset file is malformed; the message starts with ``<file>:<line>:``."""


@dataclass(frozen=True, slots=True)
class Record:
    """One dataset problem.

    Attributes:
        line: 1-based line number in the source file.
        prompt: the question, untemplated.
        answer: the gold answer (for GSM8K: the final number, canonical, e.g. ``"1000"``).
        solution: the SFT target (for GSM8K: the worked solution ending in ``#### N``).
    """

    line: int
    prompt: str
    answer: str
    solution: str


def _field(obj: dict, name: str, where: str) -> str:
    if name not in obj:
        raise DatasetError(f"{where}: missing field '{name}' (fields present: {sorted(obj)})")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field '{name}' must be a string or number, got {type(value).__name__}")
    return str(value)


def _record(obj: dict, line: int, where: str, layout: str, prompt_field: str, answer_field: str) -> Record:
    if layout == "gsm8k":
        question, solution = _field(obj, "question", where), _field(obj, "answer", where)
        if "####" not in solution:
            raise DatasetError(f"{where}: field 'answer' has no '#### <number>' final answer")
        value = extract_answer(solution[solution.rindex("####") :])
        if value is None:
            raise DatasetError(f"{where}: no number after '####' in field 'answer'")
        return Record(line, question, format_number(value), solution)
    prompt, answer = _field(obj, prompt_field, where), _field(obj, answer_field, where)
    return Record(line, prompt, answer, answer)


def jsonl_objects(path: str | Path) -> Iterator[tuple[int, str, dict | None]]:
    """``(line, "<path>:<line>", object)`` for each line of a JSONL file, ``object`` None for a blank
    line (1-based lines), the file read as UTF-8.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetError: a line that is not UTF-8 text, not JSON, or not a JSON object.
    """
    with Path(path).open("rb") as f:
        for line, raw in enumerate(f, start=1):
            where = f"{path}:{line}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start + 1})") from None
            if not text.strip():
                yield line, where, None
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield line, where, obj


def load_jsonl(
    path: str | Path, *, layout: str = "gsm8k", prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[Record]:
    """Read a JSONL dataset; blank lines are skipped.

    Args:
        path: the ``.jsonl`` file, one JSON object per line.
        layout: ``"gsm8k"`` or ``"generic"`` (see the module docstring).
        prompt_field, answer_field: field names of the generic layout.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetError: a line that is not UTF-8, not JSON or not an object, a missing or non-text field, a GSM8K
            answer without ``#### N``, or a file without records; the message names file and line.
    """
    path = Path(path)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {', '.join(LAYOUTS)}")
    records: list[Record] = []
    num_lines = 0
    for num_lines, where, obj in jsonl_objects(path):  # noqa: B007 - num_lines is used after the loop
        if obj is not None:
            records.append(_record(obj, num_lines, where, layout, prompt_field, answer_field))
    if not records:
        raise DatasetError(f"{path}:{max(num_lines, 1)}: no records (the file is empty or blank)")
    return records


class JsonlTask(Task):
    """A dataset task scored by numeric answer match.

    Args:
        records: the loaded dataset (``load_jsonl``).
        name: a short dataset name used in prompt ids (``"<name>:<line>"``).
        num_eval: held-out records; at most half of the dataset.
        template: prompt template with a ``{prompt}`` placeholder for the question.
        score_fn: a user reward function replacing the numeric match.
    """

    name = "jsonl"

    def __init__(
        self,
        records: list[Record],
        *,
        name: str = "data",
        num_eval: int = 200,
        template: str = "Question: {prompt}\nAnswer:",
        score_fn: ScoreFn | None = None,
    ) -> None:
        super().__init__(score_fn)
        self.template = template
        prompts = [
            Prompt(
                id=f"{name}:{r.line}",
                text=template.format(prompt=r.prompt),
                answer=r.answer,
                solution=" " + r.solution,
            )
            for r in records
        ]
        order = sorted(range(len(prompts)), key=lambda i: (stable_hash(records[i].prompt), i))
        num_held = min(num_eval, len(prompts) // 2)
        held = set(order[:num_held])
        self._eval = [p for i, p in enumerate(prompts) if i in held]
        self._train = [p for i, p in enumerate(prompts) if i not in held]

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Endless epochs over the training records, each epoch shuffled by ``random.Random(seed)``."""
        rng = random.Random(f"jsonl-train-{seed}")
        while True:
            order = list(range(len(self._train)))
            rng.shuffle(order)
            for i in order:
                yield self._train[i]

    def eval_prompts(self) -> list[Prompt]:
        """The held-out records, in file order."""
        return list(self._eval)

    def score(self, prompt_text: str, response_text: str, answer: str) -> Reward:
        """1.0 when the response's final number equals the gold number (``answers_match``)."""
        correct = float(answers_match(response_text, answer))
        has_number = float(extract_answer(response_text) is not None)
        return Reward(correct, {"correct": correct, "format": has_number})
