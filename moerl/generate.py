"""``moerl generate``: offline batch generation from a JSONL file of prompts (for evaluation).

Input: one JSON object per line with a ``prompt`` string and an optional ``id``. Output: one JSON object
per sample: ``id``, ``sample_index``, ``prompt``, ``completion`` (text, without the stop token),
``token_ids``, ``logprobs``, ``finish_reason`` (``stop`` | ``length`` | ``error``), ``policy_version`` and,
for a prompt that cannot be served (too long for the context, empty), ``error``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from moerl.atomic import atomic_write_text
from moerl.choices import DTYPE_NAMES
from moerl.ep.registry import DISPATCHERS
from moerl.models import CheckpointError, check_model_folder, from_pretrained
from moerl.models.dtypes import torch_dtype
from moerl.rollout.engine import Engine
from moerl.rollout.ep_generate import EPGenerateSpec, generate_ep
from moerl.rollout.params import FINISH_ERROR, FINISH_STOP, Completion, Request, SamplingParams
from moerl.tasks import DatasetError, load_tokenizer
from moerl.tasks.datasets import jsonl_objects


def read_prompts(path: str | Path) -> list[tuple[str, str]]:
    """``(id, prompt)`` pairs of a JSONL file; ``id`` defaults to the line number (from 0).

    Raises:
        DatasetError: (a ``ValueError``, named ``<file>:<line>:``) a line that is not UTF-8, not a JSON
            object, without a string ``prompt``, with an ``id`` that is not a string or integer, or a
            duplicate id (``moerl.tasks.datasets.jsonl_objects`` reads the lines).
    """
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for _, where, obj in jsonl_objects(path):
        if obj is None:
            continue
        if not isinstance(obj.get("prompt"), str):
            raise DatasetError(f"{where}: expected an object with a string 'prompt' field")
        raw_id = obj.get("id", len(out))
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            raise DatasetError(f"{where}: field 'id' must be a string or an integer, got {raw_id!r}")
        pid = str(raw_id)
        if pid in seen:
            raise DatasetError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        out.append((pid, obj["prompt"]))
    return out


def _write_jsonl_atomic(path: str | Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def _row(c: Completion, prompt: str, tokenizer, version: int) -> dict:
    text_ids = c.token_ids[:-1] if c.finish_reason == FINISH_STOP else c.token_ids
    row = {
        "id": c.request_id,
        "sample_index": c.sample_index,
        "prompt": prompt,
        "completion": tokenizer.decode(text_ids),
        "token_ids": c.token_ids,
        "logprobs": c.logprobs,
        "finish_reason": c.finish_reason,
        "policy_version": min(c.policy_versions) if c.policy_versions else version,
    }
    if c.error is not None:
        row["error"] = c.error
    return row


def generate_main(args: argparse.Namespace) -> int:
    """Run ``moerl generate``: 0 on success, 1 when some prompts failed (their lines carry ``error``), 2 when
    nothing could run (missing or bad model, tokenizer or prompts file, bad flags; the reason is printed).

    Args:
        args: ``model``, ``prompts``, ``out``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
            ``n``, ``seed``, ``dtype``, ``device``, and optionally ``tokenizer``, ``max_slots``,
            ``kv_token_budget`` (default: room for the longest prompt + max_new_tokens in every slot),
            ``ep_size`` / ``ep_dispatcher`` / ``ep_ranks_per_node`` (expert-parallel ranks; 1: one engine),
            ``weight_dtype`` (``auto``; ``fp8``: block-quantized FP8 weights, ``moerl.models.fp8``). A model
            folder in the DeepSeek-V3 FP8 release format loads dequantized to ``dtype`` (or kept FP8).
    """
    try:
        return _generate(args)
    except (FileNotFoundError, ValueError) as e:  # ValueError includes DatasetError (the --prompts file)
        print(f"moerl generate: error: {e}", file=sys.stderr)
        return 2


def check_sizes(args: argparse.Namespace) -> None:
    """Check the size flags of ``moerl generate`` before anything loads.

    Raises:
        ValueError: ``--max-new-tokens``, ``--max-slots``, ``--kv-token-budget``, ``-n``, ``--ep-size`` or
            ``--ep-ranks-per-node`` below 1 (the optional ones only when given), ``--ep-ranks-per-node``
            that does not divide ``--ep-size`` (the EP ranks form whole nodes, ``moerl.ep.Topology``), or an
            ``--ep-dispatcher`` that is not a ``moerl.ep.parallelize.DISPATCHERS`` name.
    """
    for flag, name in (
        ("--max-new-tokens", "max_new_tokens"),
        ("--max-slots", "max_slots"),
        ("--kv-token-budget", "kv_token_budget"),
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


def _check_experts(model_folder: str, num_experts: int, ep_size: int) -> None:
    if ep_size > 1 and (num_experts < 1 or num_experts % ep_size):
        raise ValueError(
            f"--ep-size {ep_size}: the model {model_folder} has {num_experts} routed experts per MoE layer, "
            f"which must be a positive multiple of the EP size"
        )


def _check_paths(args: argparse.Namespace) -> None:
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a folder; give the path of a .jsonl file to write")
    if not Path(args.model).is_dir():
        raise FileNotFoundError(
            f"--model {args.model}: no such folder (a Hugging Face model folder is expected)"
        )
    try:  # config.json, architecture, safetensors headers: before the tokenizer and any tensor load
        check_model_folder(args.model)
    except (FileNotFoundError, CheckpointError) as e:
        raise ValueError(f"--model {args.model}: {e}") from None
    if getattr(args, "tokenizer", None) is None and not (Path(args.model) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"--model {args.model}: no tokenizer.json in the folder; pass --tokenizer PATH (moerl train "
            "uses the built-in character tokenizer for such a folder and says so)"
        )
    if Path(args.prompts).is_dir():
        raise ValueError(f"--prompts {args.prompts} is a folder; give the path of a .jsonl file of prompts")
    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts}: no such file")


def _fp8_weights(args: argparse.Namespace, ep_size: int) -> bool:
    """Whether ``--weight-dtype fp8`` asks for FP8 weights (an FP8 release kept as is, else quantized);
    ``auto`` (the default): the ``--dtype`` weights (an FP8 release dequantized to it).

    Raises:
        ValueError: an unknown ``--weight-dtype``, or fp8 with ``--ep-size`` above 1.
    """
    choice = getattr(args, "weight_dtype", None) or "auto"
    if choice not in ("auto", "fp8"):
        raise ValueError(f"--weight-dtype={choice!r}; choose auto or fp8")
    if choice == "fp8" and ep_size > 1:
        raise ValueError(
            "--weight-dtype fp8 runs one engine; the EP engine's experts are not FP8 yet (--ep-size 1)"
        )
    return choice == "fp8"


def _generate(args: argparse.Namespace) -> int:
    if args.dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype={args.dtype!r}; choose one of {sorted(DTYPE_NAMES)}")
    check_sizes(args)
    ep_size = getattr(args, "ep_size", None) or 1
    check_device(args.device, ep_size)
    _check_paths(args)
    tokenizer = load_tokenizer(getattr(args, "tokenizer", None) or args.model)
    fp8 = _fp8_weights(args, ep_size)
    model = from_pretrained(args.model, dtype=torch_dtype(args.dtype), device=args.device, fp8=fp8)
    _check_experts(args.model, model.config.num_experts, ep_size)  # before the EP ranks are spawned
    prompts = read_prompts(args.prompts)
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompts in it (one JSON object per line)")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=64 if args.max_new_tokens is None else args.max_new_tokens,
        stop_token_ids=(tokenizer.eos_id,),
        n=args.n,
        seed=args.seed,
    )
    encoded = [tokenizer.encode(text) for _, text in prompts]
    context = model.config.max_position_embeddings

    def params_for(ids: list[int]) -> SamplingParams:
        # no --max-new-tokens: up to 64 new tokens, fewer where the prompt leaves less context
        if args.max_new_tokens is not None:
            return params
        return dataclasses.replace(params, max_new_tokens=max(1, min(64, context - len(ids))))

    max_slots = getattr(args, "max_slots", None) or 64
    longest = max((len(ids) + params_for(ids).max_new_tokens for ids in encoded), default=1)
    budget = getattr(args, "kv_token_budget", None) or max_slots * min(
        longest, model.config.max_position_embeddings
    )
    requests = [
        Request(request_id=pid, prompt_ids=ids, params=params_for(ids))
        for (pid, _), ids in zip(prompts, encoded, strict=True)
    ]
    if ep_size > 1:  # the experts sharded over ep_size local ranks (moerl.rollout.ep_generate)
        spec = EPGenerateSpec(
            model=args.model,
            dtype=torch_dtype(args.dtype),
            device=args.device,
            max_slots=max_slots,
            kv_token_budget=budget,
            seed=args.seed,
            dispatcher=getattr(args, "ep_dispatcher", None) or "alltoall",
            ranks_per_node=getattr(args, "ep_ranks_per_node", None),
        )
        completions, version = generate_ep(spec, requests, ep_size), 0
    else:
        engine = Engine(model, max_slots=max_slots, kv_token_budget=budget, seed=args.seed)
        completions, version = engine.generate(requests, on_error="return"), engine.version
    text_of = dict(prompts)
    rows = [_row(c, text_of[c.request_id], tokenizer, version) for c in completions]
    _write_jsonl_atomic(args.out, rows)
    failed = [c for c in completions if c.finish_reason == FINISH_ERROR]
    for c in failed:
        print(f"moerl generate: {c.error}", file=sys.stderr)
    print(
        f"moerl generate: wrote {len(rows)} samples of {len(prompts)} prompts to {args.out}", file=sys.stderr
    )
    return 1 if failed else 0
