"""``moerl generate`` and ``moerl.api.generate``: offline batch generation on a run's rollout engine.

The engine is the one a run's rollout worker builds: ``moerl.runtime.build.make_engine`` over a
``RunConfig``'s ``rollout`` section (``--config RUN.yaml``, else the built-in defaults), so the paged KV
cache by default, ``rollout.max_slots`` sequences decoding together, ``rollout.kv_token_budget`` cache
tokens in all, ``rollout.weight_dtype`` (FP8) and ``rollout.mla_cache`` (latent); the ``--max-slots``,
``--kv-token-budget``, ``--kv-cache``, ``--kv-block-size``, ``--mla-cache``, ``--weight-dtype`` and ``--ep-*``
flags override those fields (``ROLLOUT_FLAGS``). ``--ep-size`` above 1 runs the same engine on local
expert-parallel ranks (``moerl.rollout.ep_generate``).

Input: one JSON object per line with a ``prompt`` string or a ``messages`` list of ``{role, content}``
(rendered with the tokenizer's chat template by ``moerl.tasks.chat.chat_renderer``, the function training
renders chat prompts with; a trailing assistant message is dropped as training drops its SFT target), and an
optional ``id``. With ``task.prompt_format: chat`` in ``--config``, ``prompt`` rows are rendered as one user
message too (``task.template`` shaping it, ``task.system_prompt`` first), as in training; with ``raw``, a
``task.template`` set in the config is filled with the prompt.

Output: one JSON object per sample (``Generation.to_json``): ``id``, ``sample_index``, ``prompt`` (the
prompt text the model was given), ``prompt_ids``, ``completion`` (text, without the stop token),
``token_ids``, ``logprobs``, ``finish_reason`` (``stop`` | ``length`` | ``error``), ``policy_version`` and,
for a prompt that cannot be served (too long for the context, empty), ``error``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moerl.atomic import atomic_write_text
from moerl.choices import DTYPE_NAMES
from moerl.config import RunConfig, load_config
from moerl.ep.registry import DISPATCHERS
from moerl.models import CheckpointError, check_model_folder, from_pretrained
from moerl.models.dtypes import torch_dtype
from moerl.placement import Placement
from moerl.rollout.ep_generate import EPGenerateSpec, generate_ep
from moerl.rollout.memory_check import check_memory
from moerl.rollout.params import FINISH_ERROR, FINISH_STOP, Completion, Request, SamplingParams
from moerl.runtime.build import make_engine
from moerl.tasks import DatasetError, Tokenizer, load_tokenizer
from moerl.tasks.chat import chat_renderer, check_messages
from moerl.tasks.datasets import Record, jsonl_objects

ROLLOUT_FLAGS: dict[str, str] = {
    "max_slots": "--max-slots",
    "kv_token_budget": "--kv-token-budget",
    "kv_cache": "--kv-cache",
    "kv_block_size": "--kv-block-size",
    "mla_cache": "--mla-cache",
    "weight_dtype": "--weight-dtype",
    "ep_size": "--ep-size",
    "ep_dispatcher": "--ep-dispatcher",
    "ep_ranks_per_node": "--ep-ranks-per-node",
}
"""``rollout.*`` field -> the ``moerl generate`` flag that overrides it (the API's keyword of the same name)."""

SAMPLING_FIELDS = ("n", "max_new_tokens", "temperature", "top_p", "top_k")
"""Sampling choices of ``moerl generate``: a given value wins; else, with a run config, its ``rollout``
section's (``n``: ``rollout.group_size``); else greedy, one sample, up to 64 new tokens (fewer where the
prompt leaves less of the model's context)."""

DEFAULT_MAX_NEW_TOKENS = 64
"""New tokens per sample when neither a flag nor a run config says (capped by the context left)."""


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One input row: a plain prompt or a chat conversation (exactly one of the two is set)."""

    id: str
    """The row's id (its ``id`` field, else its position from 0)."""
    prompt: str | None = None
    """A plain prompt text."""
    messages: tuple[dict[str, str], ...] | None = None
    """A conversation ``({"role", "content"}, ...)`` ending before the response to generate."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One generated sample of one prompt (what ``moerl generate`` writes as a JSONL line).

    ``logprobs[i]`` is log softmax(logits_i / T)[token_ids[i]] in float32 under the engine's policy, T the
    sampling temperature (1 for greedy): the behaviour log-prob of a run's rollout (``moerl.rollout.params``).
    """

    id: str
    """The prompt row's id."""
    sample_index: int
    """Which of the prompt's n samples, in [0, n)."""
    prompt: str
    """The prompt text the model was given (a chat row: the rendered template)."""
    prompt_ids: list[int]
    """The prompt's token ids, [P]."""
    completion: str
    """The generated text, decoded without the stop token."""
    token_ids: list[int]
    """Generated token ids, [R] (the stop token included when ``finish_reason`` is ``stop``)."""
    logprobs: list[float]
    """Behaviour log-prob of each generated token, [R], in nats."""
    finish_reason: str
    """``stop`` (a stop token), ``length`` (``max_new_tokens``) or ``error`` (the prompt cannot be served)."""
    policy_version: int
    """Weight version that generated it (0: the model folder's weights)."""
    error: str | None = None
    """Why the prompt could not be served (``finish_reason == "error"``), else None."""

    def to_json(self) -> dict:
        """The JSONL object: every field, ``error`` only when set."""
        row = dataclasses.asdict(self)
        if row["error"] is None:
            del row["error"]
        return row


def prompt_row(obj: object, default_id: str, where: str) -> PromptRow:
    """A ``PromptRow`` from a row object ``{"prompt": str} | {"messages": [...]}`` with an optional ``id``.

    Raises:
        DatasetError: (a ``ValueError``; the message starts with ``where``) not an object, neither or both of
            ``prompt`` / ``messages``, a ``prompt`` that is not a string, bad messages
            (``moerl.tasks.chat.check_messages``), only an assistant message, or an ``id`` that is not a
            string or an integer.
    """
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected an object, got {type(obj).__name__}")
    raw_id = obj.get("id", default_id)
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise DatasetError(f"{where}: field 'id' must be a string or an integer, got {raw_id!r}")
    if ("prompt" in obj) == ("messages" in obj):
        raise DatasetError(f"{where}: expected an object with a string 'prompt' field or a 'messages' list")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise DatasetError(f"{where}: expected an object with a string 'prompt' field")
        return PromptRow(str(raw_id), prompt=obj["prompt"])
    try:
        messages = check_messages(obj["messages"], where)
    except ValueError as e:
        raise DatasetError(str(e)) from None
    if messages[-1]["role"] == "assistant":  # the response to generate, as training drops its SFT target
        messages.pop()
    if not messages:
        raise DatasetError(f"{where}: 'messages' holds only an assistant message, no prompt")
    return PromptRow(str(raw_id), messages=tuple(messages))


def read_prompts(path: str | Path) -> list[PromptRow]:
    """The rows of a JSONL prompts file (``prompt_row``); ``id`` defaults to the row's position (from 0).

    Raises:
        DatasetError: (a ``ValueError``, named ``<file>:<line>:``) a line that is not UTF-8, not a JSON
            object, not a valid row (``prompt_row``), or a duplicate id (``moerl.tasks.datasets.jsonl_objects``
            reads the lines).
    """
    out: list[PromptRow] = []
    seen: set[str] = set()
    for _, where, obj in jsonl_objects(path):
        if obj is None:
            continue
        row = prompt_row(obj, str(len(out)), where)
        if row.id in seen:
            raise DatasetError(f"{where}: duplicate id {row.id!r}")
        seen.add(row.id)
        out.append(row)
    return out


def prompt_renderer(cfg: RunConfig, tokenizer: Tokenizer):
    """``row -> prompt text`` as training builds prompts from ``cfg.task`` (module docstring).

    Raises (from the returned function):
        ValueError: a chat row (or ``task.prompt_format: chat``) and a tokenizer without a chat template.
        ChatTemplateError: the template fails to render the row (``moerl.tasks.chat.render_chat``).
    """
    task = cfg.task
    is_chat = task.prompt_format == "chat"
    render_chat_row = None
    if tokenizer.chat_template is not None:
        render_chat_row = chat_renderer(
            tokenizer.chat_template,
            tokenizer.special_tokens,
            system_prompt=task.system_prompt,
            user_template=task.template if is_chat else None,
        )

    def render(row: PromptRow) -> str:
        if row.messages is None and not is_chat:
            return row.prompt if task.template is None else task.template.format(prompt=row.prompt)
        if render_chat_row is None:
            why = "a 'messages' row" if row.messages is not None else "task.prompt_format=chat"
            raise ValueError(
                f"row {row.id!r}: {why} needs the tokenizer's chat_template ({tokenizer.source} has none)"
            )
        record = Record(0, row.prompt or "", None, None, row.messages)
        return render_chat_row(record)

    return render


@dataclass(kw_only=True, slots=True)
class GenerateSpec:
    """Everything one generation needs besides its rows (``run_generation``)."""

    model: str
    """Hugging Face model folder."""
    cfg: RunConfig
    """The run config: ``rollout`` builds the engine, ``task`` renders prompts, ``seed`` seeds the engine."""
    params: SamplingParams
    """Sampling of every prompt (its stop token: the tokenizer's eos, set by ``run_generation``)."""
    fit_context: bool
    """``max_new_tokens`` chosen by nobody: each prompt gets up to ``params.max_new_tokens``, fewer where
    the prompt leaves less of the model's context."""
    tokenizer: str | None
    """Tokenizer file or folder; None: the model folder's."""
    dtype: str
    """Weights and compute dtype name (``moerl.choices.DTYPE_NAMES``)."""
    device: str
    """Torch device (an EP rank r on CUDA takes ``cuda:r``)."""


def generate_config(
    config: str | Path | RunConfig | None, overrides: Sequence[str] = (), **rollout: object
) -> RunConfig:
    """The run config generation uses: ``config`` (a YAML path with ``overrides`` as ``--set`` takes them, a
    ``RunConfig`` copied, or None: the built-in defaults) with the ``rollout`` fields given (not None), as
    named by ``ROLLOUT_FLAGS``, replaced.

    Raises:
        ConfigError: (a ``ValueError``) a bad config, override or rollout value (the field named).
        FileNotFoundError: no such config file.
        TypeError: a keyword that is not in ``ROLLOUT_FLAGS``, or overrides with a ``RunConfig``.
    """
    unknown = sorted(set(rollout) - set(ROLLOUT_FLAGS))
    if unknown:
        raise TypeError(f"unknown rollout settings {unknown}; choose among {sorted(ROLLOUT_FLAGS)}")
    if isinstance(config, RunConfig):
        if overrides:
            raise TypeError("overrides apply to a config file; change the RunConfig itself instead")
        cfg = copy.deepcopy(config)
    else:
        cfg = load_config(config, list(overrides))
    given = {k: v for k, v in rollout.items() if v is not None}
    cfg.rollout = dataclasses.replace(cfg.rollout, **given)  # validated again (RolloutConfig.__post_init__)
    return cfg


def sampling_for(
    cfg: RunConfig, from_config: bool, *, seed: int, **given: int | float | None
) -> tuple[SamplingParams, bool]:
    """``(params, fit_context)`` of ``SAMPLING_FIELDS``: a given value (not None) wins; else the run config's
    ``rollout`` section when ``from_config``; else greedy, ``n=1``, ``DEFAULT_MAX_NEW_TOKENS``.
    ``fit_context``: nobody chose ``max_new_tokens`` (``GenerateSpec.fit_context``).

    Raises:
        ValueError: a value out of range (``SamplingParams``).
    """
    if from_config:
        base = SamplingParams.from_config(cfg.rollout, seed=seed)
        base.return_routed_experts = False
    else:
        base = SamplingParams(temperature=0.0, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, n=1, seed=seed)
    chosen = {k: v for k, v in given.items() if k in SAMPLING_FIELDS and v is not None}
    fit_context = not from_config and given.get("max_new_tokens") is None
    return dataclasses.replace(base, **chosen), fit_context


def _completions(spec: GenerateSpec, requests: list[Request]) -> list[Completion]:
    """The requests run on the engine a run's rollout builds (``make_engine``) over the model loaded here
    (``rollout.weight_dtype=fp8``: an FP8 release kept as is, else quantized by the engine), or on
    ``rollout.ep_size`` local EP ranks that each load it and build the same engine."""
    cfg = spec.cfg
    if cfg.rollout.ep_size > 1:  # the experts sharded over ep_size local ranks (moerl.rollout.ep_generate)
        ep_spec = EPGenerateSpec(
            model=spec.model,
            dtype=torch_dtype(spec.dtype),
            device=spec.device,
            build_engine=functools.partial(make_engine, cfg=cfg),
            dispatcher=cfg.rollout.ep_dispatcher,
            ranks_per_node=cfg.rollout.ep_ranks_per_node,
        )
        return generate_ep(ep_spec, requests, cfg.rollout.ep_size)
    is_fp8 = Placement.single_process(cfg).rollout.is_fp8
    model = from_pretrained(spec.model, dtype=torch_dtype(spec.dtype), device=spec.device, fp8=is_fp8)
    return make_engine(model, cfg).generate(requests, on_error="return")


def run_generation(spec: GenerateSpec, rows: list[PromptRow]) -> list[Generation]:
    """Generate ``spec.params.n`` samples of every row: rows rendered (``prompt_renderer``) and encoded
    before the model loads, then run on the engine built from ``spec.cfg.rollout`` (``_completions``);
    samples in row order, then sample index. A row that cannot be served (too long for the context or the
    cache) comes back as one ``error`` sample.

    Raises:
        ValueError: a chat row without a chat template (``prompt_renderer``), or no rows.
        RuntimeError: an EP rank failed (``moerl.rollout.ep_generate.generate_ep``).
    """
    if not rows:
        raise ValueError("no prompts to generate from")
    tokenizer = load_tokenizer(spec.tokenizer or spec.model)
    render = prompt_renderer(spec.cfg, tokenizer)
    texts = [render(row) for row in rows]  # a template error before the model loads
    encoded = [tokenizer.encode(text) for text in texts]
    params = dataclasses.replace(spec.params, stop_token_ids=(tokenizer.eos_id,))
    context = check_model_folder(spec.model).max_position_embeddings  # config.json only

    def params_for(ids: list[int]) -> SamplingParams:
        if not spec.fit_context:
            return params
        return dataclasses.replace(
            params, max_new_tokens=max(1, min(params.max_new_tokens, context - len(ids)))
        )

    requests = [
        Request(request_id=row.id, prompt_ids=ids, params=params_for(ids))
        for row, ids in zip(rows, encoded, strict=True)
    ]
    completions = _completions(spec, requests)
    text_of = {row.id: text for row, text in zip(rows, texts, strict=True)}
    return [_generation(c, text_of[c.request_id], tokenizer) for c in completions]


def _generation(c: Completion, prompt: str, tokenizer: Tokenizer) -> Generation:
    text_ids = c.token_ids[:-1] if c.finish_reason == FINISH_STOP else c.token_ids
    return Generation(
        id=c.request_id,
        sample_index=c.sample_index,
        prompt=prompt,
        prompt_ids=list(c.prompt_ids),
        completion=tokenizer.decode(text_ids),
        token_ids=list(c.token_ids),
        logprobs=list(c.logprobs),
        finish_reason=c.finish_reason,
        policy_version=min(c.policy_versions) if c.policy_versions else 0,
        error=c.error,
    )


def generate_main(args: argparse.Namespace) -> int:
    """Run ``moerl generate``: 0 on success, 1 when some prompts failed (their lines carry ``error``), 2 when
    nothing could run (missing or bad model, tokenizer, config or prompts file, bad flags; the reason is
    printed in one line).

    Args:
        args: ``model`` (None: the config's ``model.path``), ``prompts``, ``out``, ``config``, ``overrides``
            (``--set``), the sampling flags ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``n``
            (``SAMPLING_FIELDS``; None: the config's ``rollout`` with ``--config``, else greedy, 1 sample, up
            to 64 tokens), ``seed`` (None: the config's ``seed``, else 0), ``dtype`` / ``device`` (None: the
            config's ``model.dtype`` / ``model.device``, by default float32 on cpu), ``tokenizer`` (None:
            ``task.tokenizer``, else the model folder's), and the ``ROLLOUT_FLAGS`` (None: the config's).
    """
    try:
        return _generate(args)
    except (FileNotFoundError, ValueError) as e:  # ValueError includes DatasetError and ConfigError
        print(f"moerl generate: error: {e}", file=sys.stderr)
        return 2


def check_sizes(args: argparse.Namespace) -> None:
    """Check the size flags of ``moerl generate`` before anything loads.

    Raises:
        ValueError: ``--max-new-tokens``, ``--max-slots``, ``--kv-token-budget``, ``--kv-block-size``, ``-n``,
            ``--ep-size`` or ``--ep-ranks-per-node`` below 1 (only when given), ``--ep-ranks-per-node`` that
            does not divide ``--ep-size`` (the EP ranks form whole nodes, ``moerl.ep.Topology``), or an
            ``--ep-dispatcher`` that is not a ``moerl.ep.parallelize.DISPATCHERS`` name.
    """
    for flag, name in (
        ("--max-new-tokens", "max_new_tokens"),
        ("--max-slots", "max_slots"),
        ("--kv-token-budget", "kv_token_budget"),
        ("--kv-block-size", "kv_block_size"),
        ("-n", "n"),
        ("--ep-size", "ep_size"),
        ("--ep-ranks-per-node", "ep_ranks_per_node"),
    ):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"{flag}={value}: must be >= 1")
    dispatcher = getattr(args, "ep_dispatcher", None)
    if dispatcher is not None and dispatcher not in DISPATCHERS:
        raise ValueError(f"--ep-dispatcher={dispatcher!r}: choose one of {', '.join(DISPATCHERS)}")
    ep_size, per_node = getattr(args, "ep_size", None) or 1, getattr(args, "ep_ranks_per_node", None)
    if per_node is not None and ep_size % per_node:
        raise ValueError(f"--ep-ranks-per-node={per_node} must divide --ep-size={ep_size}")


def check_device(device: str, ep_size: int = 1) -> None:
    """Check that torch can use ``device`` (and, for CUDA with ``ep_size`` > 1, one GPU per EP rank).

    Raises:
        ValueError: not a torch device name, a CUDA device on a torch built without CUDA or with no GPU
            visible, or fewer GPUs than EP ranks.
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type != "cuda":
        return
    if not torch.backends.cuda.is_built():
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) is built without CUDA")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"--device {device}: no CUDA GPU is visible")
    needed = ep_size if ep_size > 1 else (dev.index or 0) + 1
    if count < needed:
        what = f"--ep-size {ep_size} needs one GPU per rank" if ep_size > 1 else "no such GPU"
        raise ValueError(f"--device {device}: {what}, and {count} are visible")


def check_model(model: str, tokenizer: str | None, ep_size: int, *, name: str = "--model") -> None:
    """Check the model folder (and its tokenizer unless one is given) before anything loads, and its routed
    experts against ``ep_size`` before any EP rank is spawned; ``name`` is what messages call the folder.

    Raises:
        FileNotFoundError: no such folder, a run folder (naming its exported ``policy/``), or no
            ``tokenizer.json`` in it and no ``tokenizer`` given.
        ValueError: a damaged folder (``moerl.models.check_model_folder``), or routed experts that are not
            a positive multiple of ``ep_size`` > 1.
    """
    if not Path(model).is_dir():
        raise FileNotFoundError(f"{name} {model}: no such folder (a Hugging Face model folder is expected)")
    if (Path(model) / "config.yaml").is_file() and not (Path(model) / "config.json").is_file():
        policy = Path(model) / "policy"
        where = f"its exported policy is {policy}" if policy.is_dir() else "it has no exported policy yet"
        raise FileNotFoundError(f"{name} {model} is a moerl run folder, not a model folder: {where}")
    try:  # config.json, architecture, safetensors headers: before the tokenizer and any tensor load
        arch = check_model_folder(model)
    except (FileNotFoundError, CheckpointError) as e:
        raise ValueError(f"{name} {model}: {e}") from None
    if tokenizer is None and not (Path(model) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{name} {model}: no tokenizer.json in the folder; pass --tokenizer PATH (moerl train "
            "uses the built-in character tokenizer for such a folder and says so)"
        )
    if ep_size > 1 and (arch.num_experts < 1 or arch.num_experts % ep_size):
        raise ValueError(
            f"--ep-size {ep_size}: the model {model} has {arch.num_experts} routed experts per MoE layer, "
            f"which must be a positive multiple of the EP size"
        )


def _check_files(args: argparse.Namespace) -> None:
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a folder; give the path of a .jsonl file to write")
    if Path(args.prompts).is_dir():
        raise ValueError(f"--prompts {args.prompts} is a folder; give the path of a .jsonl file of prompts")
    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts}: no such file")


def _check_weight_dtype(choice: str, ep_size: int) -> None:
    """``--weight-dtype fp8`` only on one engine (the name itself is checked by ``RolloutConfig``)."""
    if choice == "fp8" and ep_size > 1:
        raise ValueError(
            "--weight-dtype fp8 runs one engine; the EP engine's experts are not FP8 yet (--ep-size 1)"
        )


def check_engine_memory(spec: GenerateSpec) -> None:
    """Refuse an engine whose KV cache plus the model's weights cannot fit the device's memory, before
    anything loads (``moerl.rollout.memory_check.check_memory`` as a run checks it, counting the one
    engine and the one copy of the policy that generation holds; EP ranks are not estimated).

    Raises:
        ConfigError: (a ``ValueError``) the estimate exceeds the available memory; the message names
            ``rollout.max_slots`` and ``rollout.kv_token_budget`` (``--max-slots``, ``--kv-token-budget``).
    """
    if spec.cfg.rollout.ep_size > 1:
        return
    one = copy.deepcopy(spec.cfg)  # the run's residents table with nothing but the driver: 1 engine, 1 copy
    one.init_from = None
    one.model.path, one.model.dtype, one.model.device = spec.model, spec.dtype, spec.device
    check_memory(one, Placement.single_process(one), 0, rollouts=False)


def spec_from_args(args: argparse.Namespace) -> GenerateSpec:
    """The ``GenerateSpec`` of ``moerl generate``'s flags (``generate_main``), every flag checked first.

    Raises:
        ValueError: a bad flag, config or model folder (one line naming it).
        FileNotFoundError: no such model folder, prompts file, config file or tokenizer.
    """
    if args.dtype is not None and args.dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype={args.dtype!r}; choose one of {sorted(DTYPE_NAMES)}")
    check_sizes(args)
    rollout = {name: getattr(args, name, None) for name in ROLLOUT_FLAGS}
    cfg = generate_config(getattr(args, "config", None), getattr(args, "overrides", None) or (), **rollout)
    ep_size = cfg.rollout.ep_size
    _check_weight_dtype(Placement.single_process(cfg).rollout.weight_dtype, ep_size)
    device = args.device or cfg.model.device
    check_device(device, ep_size)
    model = args.model or cfg.model.path
    if model is None:
        raise ValueError("--model is required (a Hugging Face model folder), or model.path in --config")
    _check_files(args)
    tokenizer = getattr(args, "tokenizer", None) or cfg.task.tokenizer
    check_model(model, tokenizer, ep_size)
    from_config = getattr(args, "config", None) is not None
    seed = args.seed if args.seed is not None else (cfg.seed if from_config else 0)
    cfg.seed = seed
    sampling = {name: getattr(args, name, None) for name in SAMPLING_FIELDS}
    params, fit_context = sampling_for(cfg, from_config, seed=seed, **sampling)
    dtype = args.dtype or cfg.model.dtype
    spec = GenerateSpec(
        model=model, cfg=cfg, params=params, fit_context=fit_context, tokenizer=tokenizer, dtype=dtype,
        device=device,
    )  # fmt: skip
    check_engine_memory(spec)
    return spec


def _generate(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    rows = read_prompts(args.prompts)
    if not rows:
        raise ValueError(f"--prompts {args.prompts}: no prompts in it (one JSON object per line)")
    samples = run_generation(spec, rows)
    atomic_write_text(args.out, "".join(json.dumps(s.to_json()) + "\n" for s in samples))
    failed = [s for s in samples if s.finish_reason == FINISH_ERROR]
    for s in failed:
        print(f"moerl generate: {s.error}", file=sys.stderr)
    print(
        f"moerl generate: wrote {len(samples)} samples of {len(rows)} prompts to {args.out}", file=sys.stderr
    )
    return 1 if failed else 0
