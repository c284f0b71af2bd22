"""Datasets: JSONL, Parquet or a folder saved by the ``datasets`` library, in three layouts.

Formats (``dataset_rows``, chosen by the path): a folder is read with ``datasets.load_from_disk`` (its
``train`` split when it holds several; ``split=`` picks another), a ``.parquet`` file with ``pyarrow``,
anything else as JSONL (one JSON object per line). Rows are named ``<file>:<line>`` (JSONL) or
``<path>: row <n>`` in errors.

Layouts (``LAYOUTS``):
- ``gsm8k``: ``{"question": ..., "answer": "<worked solution>\\n#### 18"}``; the gold answer is the
  number after ``####``, the worked solution (with its ``#### N`` line) is the SFT target.
- ``generic``: ``{<prompt_field>: ..., <answer_field>: ...}``; the answer is the gold answer and
  the SFT target.
- ``messages``: ``{<messages_field>: [{"role", "content"}, ...], <answer_field>: ...}``, rendered with the
  tokenizer's chat template (``task.prompt_format=chat``); a trailing assistant message is the SFT target
  (and, without an answer field, the number after its ``####`` the gold answer). Rows may lack an answer
  when a reward function scores them (``task.reward_fn``); the task then has no verifier.
- ``verl``: verl's RL parquet, ``{"prompt": [{"role", "content"}, ...], "data_source": ..., "reward_model":
  {"style": ..., "ground_truth": ...}, "extra_info": {...}}``: the gold answer is
  ``reward_model.ground_truth``; ``prompt_format: chat`` renders the messages, ``raw`` fills ``template`` with
  the last user message. Detected when ``task.layout`` is left at ``gsm8k`` and the first row looks so.

Every column a layout does not consume (verl: all but ``prompt``) is kept as the record's ``extra``, JSON
values as they are (anything else as its ``str``), for a reward function that takes ``extra=``.

Responses are scored by numeric answer extraction (``moerl.tasks.answers``). Every malformed input
raises ``DatasetError`` naming the file and the 1-based line. The split is fixed by a hash of each
record's prompt: of the distinct prompts, the ``held_out_size`` with the smallest hashes are held out, with
every row that repeats one of them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moerl.tasks.answers import answers_match, extract_answer, format_number
from moerl.tasks.base import Prompt, Reward, ScoreFn, Task, stable_hash

LAYOUTS = ("gsm8k", "generic", "messages", "verl")
"""The layouts ``load_records`` reads (``task.layout``; see the module docstring)."""

MAX_HELD_OUT_SHARE = 10
"""Most rows of a dataset held out for evaluation, in percent (at least one row, ``held_out_size``)."""


def held_out_size(num_rows: int, num_eval: int) -> int:
    """Rows held out of a dataset of ``num_rows``: ``min(num_eval, MAX_HELD_OUT_SHARE % of the rows)``, at
    least 1, and never all of them (0 for a one-row dataset). E.g. 60 rows, num_eval=200 -> 6."""
    if num_rows < 2:
        return 0
    return max(1, min(num_eval, num_rows * MAX_HELD_OUT_SHARE // 100))


class DatasetError(ValueError):
    """A dataset file is malformed; the message starts with ``<file>:<line>:``."""


@dataclass(frozen=True, slots=True)
class Record:
    """One dataset problem.

    Attributes:
        line: 1-based line (JSONL) or row number in the source.
        prompt: the question, untemplated (``messages`` layout: the conversation as JSON, for the split hash).
        answer: the gold answer (for GSM8K: the final number, canonical, e.g. ``"1000"``); None: the row has
            none (a reward function scores it).
        solution: the SFT target (for GSM8K: the worked solution ending in ``#### N``); None: none.
    """

    line: int
    prompt: str
    answer: str | None
    solution: str | None
    messages: tuple[dict[str, str], ...] | None = None
    """``messages`` and ``verl`` layouts: the conversation up to the response (a trailing assistant message
    removed)."""
    extra: dict[str, Any] | None = field(default=None, hash=False)
    """The row's columns the layout does not consume (JSON values), for ``extra=`` rewards; None: none."""


def _field(obj: dict, name: str, where: str) -> str:
    if name not in obj:
        raise DatasetError(f"{where}: missing field '{name}' (fields present: {sorted(obj)})")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field '{name}' must be a string or number, got {type(value).__name__}")
    return str(value)


def _final_number(text: str) -> str | None:
    if "####" not in text:
        return None
    value = extract_answer(text[text.rindex("####") :])
    return None if value is None else format_number(value)


def _messages_record(obj: dict, line: int, where: str, messages_field: str, answer_field: str) -> Record:
    from moerl.tasks.chat import check_messages

    if messages_field not in obj:
        raise DatasetError(f"{where}: missing field '{messages_field}' (fields present: {sorted(obj)})")
    try:
        messages = check_messages(obj[messages_field], where)
    except ValueError as e:
        raise DatasetError(str(e)) from None
    solution = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    if not messages:
        raise DatasetError(f"{where}: field '{messages_field}' holds only an assistant message, no prompt")
    answer = _field(obj, answer_field, where) if obj.get(answer_field) is not None else None
    if answer is None and solution is not None:
        answer = _final_number(solution)
    return Record(
        line, json.dumps(messages), answer, solution if solution is not None else answer, tuple(messages)
    )


def _verl_record(obj: dict, line: int, where: str) -> Record:
    """A verl RL row: chat ``prompt``, gold answer ``reward_model.ground_truth`` (None when absent)."""
    from moerl.tasks.chat import check_messages

    if "prompt" not in obj:
        raise DatasetError(f"{where}: missing field 'prompt' (fields present: {sorted(obj)})")
    try:
        messages = check_messages(obj["prompt"], f"{where}: field 'prompt'")
    except ValueError as e:
        raise DatasetError(str(e)) from None
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise DatasetError(f"{where}: field 'prompt' has no user message")
    reward_model = obj.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is not None and (isinstance(truth, bool) or not isinstance(truth, (str, int, float))):
        truth = json.dumps(truth)  # a list of test cases, ...: the reward reads it from extra
    answer = None if truth is None else str(truth)
    return Record(line, users[-1], answer, answer, tuple(messages))


CONSUMED = {
    "gsm8k": lambda f: {"question", "answer"},
    "generic": lambda f: {f["prompt_field"], f["answer_field"]},
    "messages": lambda f: {f["messages_field"], f["answer_field"]},
    "verl": lambda f: {"prompt"},
}
"""The columns each layout consumes (by its field names); the rest of a row is its ``extra``."""


def _json_safe(value: Any) -> Any:
    """``value`` with JSON types kept and anything else (dates, bytes, numpy scalars) as its ``str``."""
    return json.loads(json.dumps(value, default=str))


def is_verl_row(obj: dict) -> bool:
    """Whether a row looks like verl's RL format: a ``prompt`` list and a ``reward_model`` mapping."""
    return isinstance(obj.get("prompt"), (list, tuple)) and isinstance(obj.get("reward_model"), dict)


def _record(
    obj: dict, line: int, where: str, layout: str, prompt_field: str, answer_field: str, messages_field: str
) -> Record:
    names = {"prompt_field": prompt_field, "answer_field": answer_field, "messages_field": messages_field}
    extra = {k: v for k, v in obj.items() if k not in CONSUMED[layout](names)}
    record = _layout_record(obj, line, where, layout, prompt_field, answer_field, messages_field)
    return replace(record, extra=_json_safe(extra)) if extra else record


def _layout_record(
    obj: dict, line: int, where: str, layout: str, prompt_field: str, answer_field: str, messages_field: str
) -> Record:
    if layout == "verl":
        return _verl_record(obj, line, where)
    if layout == "messages":
        return _messages_record(obj, line, where, messages_field, answer_field)
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
                raise DatasetError(
                    f"{where}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield line, where, obj


def dataset_format(path: str | Path) -> str:
    """``"datasets"`` (a folder: ``save_to_disk``), ``"parquet"`` (a ``.parquet`` file) or ``"jsonl"``."""
    path = Path(path)
    return "datasets" if path.is_dir() else "parquet" if path.suffix == ".parquet" else "jsonl"


EVAL_SPLITS = ("test", "validation")
"""Splits of a ``datasets`` DatasetDict used as the held-out set when ``task.val_path`` is not given, in
this order of preference."""


def _load_from_disk(path: Path):
    """``datasets.load_from_disk(path)`` (a Dataset or a DatasetDict), errors as ``DatasetError``."""
    try:
        import datasets

        return datasets.load_from_disk(str(path))
    except ImportError as e:
        raise DatasetError(f"{path}: reading a datasets dataset needs the 'datasets' package ({e})") from None
    except Exception as e:  # noqa: BLE001 - datasets raises its own types for a bad folder
        raise DatasetError(f"{path}: not a readable datasets dataset ({type(e).__name__}: {e})") from None


def dataset_splits(path: str | Path) -> tuple[str, ...]:
    """The split names of a ``datasets`` DatasetDict folder; ``()`` for a single Dataset or a file."""
    path = Path(path)
    if dataset_format(path) != "datasets" or not (path / "dataset_dict.json").is_file():
        return ()
    splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
    return tuple(str(s) for s in splits)


def eval_split(path: str | Path) -> str | None:
    """The split of a DatasetDict folder that serves as its held-out set (``EVAL_SPLITS``), else None.
    Only beside a ``train`` split: a DatasetDict whose only split is ``test`` or ``validation`` trains on
    that split, so holding it out too would evaluate on the training rows (the carve-out applies)."""
    splits = dataset_splits(path)
    if "train" not in splits:
        return None
    return next((s for s in EVAL_SPLITS if s in splits), None)


def _table_rows(path: Path, fmt: str, split: str | None = None) -> list[dict]:
    """The rows of a Parquet file or a ``datasets`` folder as dicts (the library named when missing);
    ``split``: that split of a DatasetDict (default ``train``, or its only split)."""
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        except ImportError as e:
            raise DatasetError(
                f"{path}: reading a parquet dataset needs the 'pyarrow' package ({e})"
            ) from None
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a bad file
            raise DatasetError(f"{path}: not a readable parquet dataset ({type(e).__name__}: {e})") from None
    data = _load_from_disk(path)
    if hasattr(data, "keys"):  # a DatasetDict
        if split is not None:
            if split not in data:
                raise DatasetError(f"{path}: no split {split!r} (splits: {sorted(data)})")
            data = data[split]
        else:
            if "train" not in data and len(data) != 1:
                raise DatasetError(f"{path}: a dataset with splits {sorted(data)} and none named 'train'")
            data = data["train"] if "train" in data else next(iter(data.values()))
    return data.to_list()


def dataset_rows(path: str | Path, split: str | None = None) -> Iterator[tuple[int, str, dict | None]]:
    """``(number, where, row)`` of every row of a dataset in any of the formats (``dataset_format``):
    ``jsonl_objects`` for JSONL, ``(n, "<path>: row <n>", row)`` (1-based) for Parquet and ``datasets``
    (``split``: that split of a DatasetDict folder, ``"<path>[<split>]: row <n>"``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetError: an unreadable file (or its library missing), or a malformed JSONL line.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dataset at {path}")
    fmt = dataset_format(path)
    if fmt == "jsonl":
        yield from jsonl_objects(path)
        return
    name = f"{path}[{split}]" if split is not None else str(path)
    for n, row in enumerate(_table_rows(path, fmt, split), start=1):
        yield n, f"{name}: row {n}", row


def load_records(
    path: str | Path,
    *,
    layout: str = "gsm8k",
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    messages_field: str = "messages",
    require_answer: bool = True,
    split: str | None = None,
) -> list[Record]:
    """Read a dataset (JSONL, Parquet or a ``datasets`` folder; ``dataset_rows``); blank lines are skipped.

    Args:
        path: the file or folder.
        layout: ``"gsm8k"``, ``"generic"``, ``"messages"`` or ``"verl"`` (see the module docstring; ``gsm8k``
            turns into ``verl`` when the first row looks like verl's format, ``is_verl_row``).
        prompt_field, answer_field, messages_field: field names (``answer_field`` for generic and messages).
        require_answer: refuse a ``messages`` or ``verl`` row without a gold answer (no reward function to
            score it).
        split: the split of a DatasetDict folder (None: ``train``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetError: a line that is not UTF-8, not JSON or not an object, a missing or non-text field, a GSM8K
            answer without ``#### N``, malformed messages, or a file without records; the message names file
            and line (or row).
    """
    path = Path(path)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {', '.join(LAYOUTS)}")
    records: list[Record] = []
    num_lines = 0
    for num_lines, where, obj in dataset_rows(path, split):  # noqa: B007 - num_lines is used after the loop
        if obj is not None:
            if not records and layout == "gsm8k" and "question" not in obj and is_verl_row(obj):
                layout = "verl"  # detected: verl's RL parquet
            record = _record(obj, num_lines, where, layout, prompt_field, answer_field, messages_field)
            if record.answer is None and require_answer:
                what = (
                    "no reward_model.ground_truth"
                    if layout == "verl"
                    else f"no field '{answer_field}', no '#### N' in the assistant message"
                )
                raise DatasetError(
                    f"{where}: no gold answer ({what}): add one, or set task.reward_fn to score responses "
                    "without it"
                )
            records.append(record)
    if not records:
        raise DatasetError(f"{path}:{max(num_lines, 1)}: no records (the file is empty or blank)")
    return records


def load_jsonl(
    path: str | Path, *, layout: str = "gsm8k", prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[Record]:
    """``load_records`` of a JSONL file in the gsm8k or generic layout (kept for callers of the old name)."""
    return load_records(path, layout=layout, prompt_field=prompt_field, answer_field=answer_field)


class JsonlTask(Task):
    """A dataset task scored by numeric answer match (its verifier), or by a user reward function.

    Args:
        records: the loaded dataset (``load_records``).
        name: a short dataset name used in prompt ids (``"<name>:<line>"``).
        num_eval: most held-out records (``held_out_size``: at most ``MAX_HELD_OUT_SHARE`` % of them).
        template: prompt template with a ``{prompt}`` placeholder for the question (raw prompts).
        score_fn: a user reward function replacing the numeric match.
        render: builds a record's prompt text instead of ``template`` (chat prompts: ``moerl.tasks.chat``).
        eval_sets: validation sets, name -> records (``task.val_path``, or a DatasetDict's ``test`` split),
            the first the main one: every record of them is held out and ``records`` all train; None: the
            held-out set is carved from ``records``.
        eval_source: what the validation sets are, for ``split_line`` (e.g. ``"task.val_path"``).
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
        render: Callable[[Record], str] | None = None,
        eval_sets: dict[str, list[Record]] | None = None,
        eval_source: str = "task.val_path",
    ) -> None:
        super().__init__(score_fn)
        self.template = template
        every = [*records, *(r for rs in (eval_sets or {}).values() for r in rs)]
        self.has_verifier = all(r.answer is not None for r in every)
        # a raw template's answer follows it after a space; a chat template's generation prompt ends the turn
        lead = "" if render is not None else " "
        render = render or (lambda r: template.format(prompt=r.prompt))

        def prompt_of(r: Record, prefix: str) -> Prompt:
            return Prompt(
                id=f"{prefix}:{r.line}",
                text=render(r),
                answer=r.answer if r.answer is not None else "",
                solution=None if r.solution is None else lead + r.solution,
                extra=r.extra,
            )

        prompts = [prompt_of(r, name) for r in records]
        self.num_eval, self.eval_source = num_eval, eval_source
        self._rows = len(records)
        self._distinct = len({r.prompt for r in records})
        if eval_sets:  # given validation sets: nothing is carved out of the training rows
            self._sets = {k: [prompt_of(r, k) for r in rs] for k, rs in eval_sets.items()}
            self._train, self._distinct_train = prompts, self._distinct
            self._carved = False
            return
        # the split is over distinct prompts: every row of a held-out prompt is held out (one of them is
        # evaluated), so a dataset that repeats a prompt never trains on a held-out one
        first: dict[str, int] = {}
        for i, r in enumerate(records):
            first.setdefault(r.prompt, i)
        order = sorted(first, key=lambda q: (stable_hash(q), first[q]))
        held = set(order[: held_out_size(len(order), num_eval)])
        self._sets = {"held_out": [prompts[first[q]] for q in sorted(held, key=first.__getitem__)]}
        self._train = [p for p, r in zip(prompts, records, strict=True) if r.prompt not in held]
        self._distinct_train = len(first) - len(held)
        self._carved = True

    @property
    def max_train_prompts(self) -> int:
        """The distinct prompts of the training rows (a batch of more groups would repeat a prompt)."""
        return self._distinct_train

    def split_line(self) -> str:
        """One line stating the split, for the first lines of a run, e.g. ``"60 rows: 54 train, 6 held out
        (task.num_eval=200, at most 10% of the prompts)"`` or ``"60 rows: 60 train; held out: test split
        of data/dd (40 rows)"``."""
        n, rest = self._rows, ""
        if not self._carved:
            sets = ", ".join(f"{k} ({len(v)} rows)" for k, v in self._sets.items())
            return f"{n} rows: {n} train; held out: {self.eval_source}: {sets}"
        if self._distinct < n:  # repeated prompts: the split is over the distinct ones
            rest = f" ({self._distinct} distinct prompts: every row of a held-out prompt is held out)"
        return (
            f"{n} rows: {len(self._train)} train, {n - len(self._train)} held out "
            f"(task.num_eval={self.num_eval}, at most {MAX_HELD_OUT_SHARE}% of the prompts){rest}"
        )

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Endless epochs over the training records, each epoch shuffled by ``random.Random(seed)``."""
        rng = random.Random(f"jsonl-train-{seed}")
        while True:
            order = list(range(len(self._train)))
            rng.shuffle(order)
            for i in order:
                yield self._train[i]

    def eval_prompts(self) -> list[Prompt]:
        """The main held-out set's records (the first of ``eval_sets``), in file order."""
        return list(next(iter(self._sets.values())))

    def eval_sets(self) -> dict[str, list[Prompt]]:
        """Every held-out set, name -> prompts in file order; the first is the main one."""
        return {k: list(v) for k, v in self._sets.items()}

    def score(self, prompt_text: str, response_text: str, answer: str) -> Reward:
        """1.0 when the response's final number equals the gold number (``answers_match``)."""
        correct = float(answers_match(response_text, answer))
        has_number = float(extract_answer(response_text) is not None)
        return Reward(correct, {"correct": correct, "format": has_number})
