"""The ``moerl`` command: parses arguments and hands off. No logic lives here."""

from __future__ import annotations

import argparse
import errno
import json
import sys

from moerl.config import ConfigError, load_config, with_import_dirs
from moerl.errors import (
    EXIT_CONFIG,
    EXIT_REWARD_FAILED,
    DiskFullError,
    ExchangeLostError,
    RayStartError,
    RewardFunctionError,
    RunFolderInUseError,
    StorageError,
    WeightVersionRefused,
)

DEFAULT_CONFIG = "configs/default.yaml"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        default=None,
        help=f"YAML run config (default: {DEFAULT_CONFIG} if present, else built-in defaults)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set trainer.lr=1e-5 (repeatable)",
    )


def _config(args: argparse.Namespace, *, import_dirs: bool = True):
    """The run config of ``--config`` (or the default) and ``--set``; ``import_dirs``: add the config's
    folder and this folder to ``task.import_dirs`` (a run here; not a cluster render, whose pods add theirs)."""
    import os

    if args.config is not None and not args.config.strip():  # "$CONFIG" unset: not the default config
        raise ConfigError("--config is empty: name a YAML file, or leave --config out for the default")
    path = args.config or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    cfg = load_config(path, args.overrides)
    if not import_dirs:
        return cfg
    # a run's first line, which config it runs; on stdout: stderr is the run's errors and progress (one
    # line per failure, which scripts and tests read whole)
    print(config_line(path), flush=True)
    return with_import_dirs(cfg, path)


def config_line(path: str | None) -> str:
    """The first line of a run: the config file it runs, or that it runs the built-in defaults."""
    import os

    if path is not None:
        return f"config: {os.path.abspath(path)}"
    return (
        f"config: none (no --config, and no {DEFAULT_CONFIG} in {os.getcwd()}): running the built-in defaults"
    )


def _local_url(path: str) -> str:
    """A ``file://`` URL as the local path it names (a run stored with ``storage.url=file://...`` is a
    local folder; resume and report read it there); anything else as it is."""
    return path[len("file://") :] if path.startswith("file://") else path


def _cmd_train(args: argparse.Namespace) -> int:
    if args.resume is not None and not args.resume.strip():  # "$RUN" unset: not a fresh run
        raise ConfigError("--resume is empty: name a run folder or its storage URL")
    if args.resume and args.config:  # a resumed run keeps its own config; silently ignoring it would mislead
        from moerl.run.resume import RESUME_FIELDS  # here: loads torch, like moerl.train

        raise ConfigError(
            f"--config {args.config} with --resume: a resumed run keeps its own config "
            f"({args.resume}/config.yaml); change fields with --set, a resume accepts only "
            + ", ".join(RESUME_FIELDS)
        )
    if args.ray_address:  # as an override: validated with the rest, and honoured by --resume too
        args.overrides.append(f"runtime.ray_address={json.dumps(args.ray_address)}")
    if args.metrics_port is not None:
        args.overrides.append(f"telemetry.metrics_port={args.metrics_port}")
    if args.metrics_address is not None:
        args.overrides.append(f"telemetry.metrics_address={json.dumps(args.metrics_address)}")
    cfg = None if args.resume else _config(args)  # a config's errors in one line, before torch loads
    if args.resume:
        from moerl.rundir.storage import is_remote

        if not is_remote(args.resume):  # a wrong local folder in one line, before torch loads too
            from moerl.rundir.folder import check_resumable

            check_resumable(_local_url(args.resume))
    import moerl.train as run  # here, not at the top: torch and the runtime load only for this command
    from moerl.run.interrupt import ignore_further_interrupts  # (with moerl.train: it loads torch)

    try:
        summary = (
            run.resume(_local_url(args.resume), overrides=args.overrides) if args.resume else run.train(cfg)
        )
    except run.RunInterrupted as e:
        ignore_further_interrupts()  # another Ctrl-C during Ray's shutdown at exit: one line, no traceback
        if e.resumable:
            hint = f"; continue with: moerl train --resume {e.folder}"
        elif e.folder is not None:
            hint = f" before the first checkpoint: {e.folder} holds the metrics so far but cannot be resumed"
        else:  # stopped before its first step (e.g. in the warm start): its folder was removed
            hint = " before the first training step: nothing to resume (the run folder was removed)"
        print(f"moerl: interrupted{hint}", file=sys.stderr)
        return 130
    if summary is None or summary.get("status") != "completed":
        reason = (summary or {}).get("stop_reason") or "no summary"
        print(f"moerl: run did not complete: {reason}", file=sys.stderr)
        return 1
    return 0


def _check_out_folder(out: str) -> None:
    """Check, before training, that a checkpoint can be written as the folder ``out``.

    ``out`` may be missing (its parents are created), empty, or an earlier ``moerl sft`` output, which is
    replaced whole: a folder with its ``sft_summary.json`` and none but the files ``moerl sft`` writes
    (``moerl.tasks.sft.is_sft_file``). Anything else (a downloaded model, a folder with notes or
    sub-folders added) is left alone.

    Raises:
        FileExistsError: ``out`` is a file, or a folder with other contents (the message names the first
            foreign file).
        PermissionError: the parent folder is not writable.
        NotADirectoryError: a file stands where a parent folder is needed.
    """
    import errno
    import os
    from pathlib import Path

    from moerl.tasks.sft import SUMMARY_FILE, is_sft_file  # here: loads torch, like _cmd_sft

    path = Path(out).resolve()
    if path.is_file():
        raise FileExistsError(f"{path} exists and is not a model folder (a file); not replacing it")
    if path.is_dir():
        entries = sorted(path.iterdir())
        foreign = next((e for e in entries if not (e.is_file() and is_sft_file(e.name))), None)
        if foreign is not None or (entries and not (path / SUMMARY_FILE).is_file()):
            why = f"{foreign.name} is not one of its files" if foreign is not None else f"no {SUMMARY_FILE}"
            raise FileExistsError(
                f"{path} exists and is not a model folder written by moerl sft ({why}); not replacing it"
            )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path.parent))


def _cmd_sft(args: argparse.Namespace) -> int:
    from moerl.run.interrupt import sigterm_interrupts
    from moerl.run.preflight import check_run_inputs
    from moerl.tasks.sft import run_sft
    from moerl.telemetry.live import LiveView

    cfg = _config(args)
    if cfg.sft.steps == 0:
        raise ConfigError(
            "sft.steps=0: moerl sft would train nothing (0 skips the warm start of moerl train)"
        )
    _check_out_folder(args.out)  # before training, not after it
    check_run_inputs(cfg, rollouts=False)  # import paths, dataset, prompt lengths, memory, as moerl train
    view = LiveView(cfg.sft.steps)
    try:
        with sigterm_interrupts():  # SIGTERM as Ctrl-C: "moerl: interrupted", exit 130, --out left whole
            run_sft(cfg, out_dir=args.out, progress=view.warm_start_progress)
    finally:
        view.close()
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from moerl.generation import generate_main  # here: loads torch, only for this command

    return generate_main(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from moerl.telemetry.report import report_main

    return report_main(_local_url(args.run_dir))


_CLUSTER_RENDER_DESCRIPTION = """\
Write the Amazon EKS + KubeRay manifests of a run config with a cluster: section
(see moerl/config_cluster.py and docs/cluster.md):

  OUT/eksctl-cluster.yaml            eksctl create cluster -f OUT/eksctl-cluster.yaml
  OUT/iam-s3-policy.json             the pods' S3 access alone (the run's bucket and prefixes)
  OUT/k8s/00-namespace.yaml ...      kubectl apply -f OUT/k8s/   (EFA plugin, run config, RayJob, alerts)

The run needs storage.url=s3://..., a policy to start from (cluster.model_url=s3://... of a
Hugging Face model folder, or init_from) and cluster.image (the image you built from
deploy/docker/Dockerfile and pushed: moerl publishes none). The pods' service account may touch only
the run's S3 bucket and prefixes (OUT/iam-s3-policy.json, inlined in the eksctl config). The job's
layout is the run's own: trainer.num_ranks, trainer.ep_size, trainer.gpus_per_node,
rollout.num_workers, rollout.ep_size (which must divide cluster.rollout.gpus_per_node). Every check runs before anything is written; a bad value is a one-line
error.

example:
  moerl cluster render --config configs/cluster_qwen3_30b_1node.yaml --out deploy/k8s/qwen3-30b \\
      --set storage.url=s3://my-bucket/runs --set cluster.model_url=s3://my-bucket/models/Qwen3-30B-A3B \\
      --set cluster.image=$IMAGE
"""


def _cmd_cluster_render(args: argparse.Namespace) -> int:
    from moerl.cluster.render import render_main

    return render_main(_config(args, import_dirs=False), args.out)


def _cmd_plan(args: argparse.Namespace) -> int:
    from moerl.plan.cli import plan_main, register_model

    if args.config is not None and not args.validate:  # a run config's model and nodes as the plan
        from moerl.cluster.plan_inputs import plan_values

        args.config_values, shape, args.config_notes = plan_values(load_config(args.config))
        if shape is not None:
            register_model(shape)
    return plan_main(args)


def _add_plan_parser(sub) -> None:
    """``moerl plan``: predict an async MoE RL cluster run (options in ``moerl.plan.args``)."""
    from moerl.plan.args import add_arguments

    p = sub.add_parser("plan", help="predict throughput, balance and cost of a cluster run (no GPU needed)")
    add_arguments(p)
    p.set_defaults(func=_cmd_plan)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    """``moerl generate``'s flags: a flag left out (None) takes the ``--config``'s value, else the
    built-in default (``moerl.generation.generate_main``)."""
    p.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: the config's model.path)"
    )
    p.add_argument(
        "--prompts", required=True, help="JSONL with a 'prompt' string or 'messages' list per line"
    )
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument(
        "--config", "-c", default=None,
        help="YAML run config: its rollout.* build the engine and sample, its task.* (prompt_format, template, "
        "system_prompt, tokenizer) render prompts (default: built-in defaults, greedy sampling)",
    )  # fmt: skip
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config field, e.g. --set rollout.kv_block_size=32 (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--max-new-tokens", type=int, default=None,
        help="default: the config's rollout.max_new_tokens; without --config 64, fewer where a prompt leaves "
        "less of the model's context (a value given is not capped: a request it does not fit fails, reported)",
    )  # fmt: skip
    p.add_argument(
        "--temperature", type=float, default=None,
        help="sampling temperature, 0 is greedy (default: the config's rollout.temperature, else 0)",
    )  # fmt: skip
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus mass (default: the config's, else 1: off)"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="top-k sampling (default: the config's, else 0: off)"
    )
    p.add_argument(
        "-n", type=int, default=None, help="samples per prompt (default: rollout.group_size, else 1)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: the config's seed, else 0)"
    )
    p.add_argument("--dtype", default=None, help="weights and compute dtype (default: model.dtype, float32)")
    p.add_argument(
        "--device", default=None, help="torch device, e.g. cpu or cuda (default: model.device, cpu)"
    )
    p.add_argument(
        "--weight-dtype", default=None,
        help="the engine's weights (rollout.weight_dtype): auto = --dtype (an FP8 release dequantized to it), "
        "bf16, fp8 = 128x128 block-quantized FP8 (an FP8 release kept as is) (default: the config's, auto)",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or its folder (default: task.tokenizer, else the model's)",
    )
    p.add_argument(
        "--kv-cache", default=None,
        help="rollout.kv_cache: paged blocks or contiguous slots (default: the config's, paged)",
    )  # fmt: skip
    p.add_argument(
        "--max-slots", type=int, default=None,
        help="rollout.max_slots: most sequences decoding together (default: the config's, 64)",
    )  # fmt: skip
    p.add_argument(
        "--kv-token-budget", type=int, default=None,
        help="rollout.kv_token_budget: KV cache tokens in all (default: the config's, 16384)",
    )  # fmt: skip
    p.add_argument(
        "--kv-block-size", type=int, default=None, help="rollout.kv_block_size (default: the config's, 16)"
    )
    p.add_argument(
        "--mla-cache", default=None,
        help="rollout.mla_cache of an MLA model: latent or expanded (default: the config's, latent)",
    )  # fmt: skip
    p.add_argument(
        "--ep-size", type=int, default=None,
        help="rollout.ep_size: expert-parallel ranks (local processes; default: the config's, 1)",
    )  # fmt: skip
    p.add_argument(
        "--ep-dispatcher", default=None,
        help="rollout.ep_dispatcher: token dispatch/combine between EP ranks, by its moerl.ep name (default: "
        "alltoall; an unknown name is refused with the list)",
    )  # fmt: skip
    p.add_argument(
        "--ep-ranks-per-node", type=int, default=None,
        help="simulated node size of the hierarchical dispatcher; divides --ep-size (default: one node)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moerl", description="RL post-training (GRPO, PPO and variants) of Mixture-of-Experts LMs."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run RL training (the main job)")
    _add_config_args(p)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue a run from its last checkpoint (a run folder, or its storage URL s3://...)",
    )
    p.add_argument("--ray-address", default=None, help="connect to an existing Ray cluster")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus metrics on this port while training (default: telemetry.metrics_port, 0: off)",
    )
    p.add_argument(
        "--metrics-address",
        default=None,
        help="interface of the metrics endpoint (default: telemetry.metrics_address, 127.0.0.1)",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("sft", help="supervised warm start on task solutions")
    _add_config_args(p)
    p.add_argument("--out", required=True, help="output checkpoint folder (Hugging Face format)")
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser(
        "generate",
        help="offline batch generation from a JSONL file of prompts, on a run's rollout engine",
        description="Generate samples of each prompt ('prompt' text or chat 'messages') with the engine a "
        "run's rollout builds (rollout.*: paged KV cache, max_slots, kv_token_budget, weight_dtype, "
        "mla_cache); flags override the config's fields (moerl/rollout/README.md).",
    )
    _add_generate_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("report", help="plot a run's curves and print its summary")
    p.add_argument("run_dir")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("cluster", help="deploy on Kubernetes (EKS + KubeRay)")
    cluster_sub = p.add_subparsers(dest="cluster_command", required=True)
    p = cluster_sub.add_parser(
        "render",
        help="write the manifests of a run config's cluster: section",
        description=_CLUSTER_RENDER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(p)
    p.add_argument("--out", required=True, help="output folder (created; files of the same names replaced)")
    p.set_defaults(func=_cmd_cluster_render)
    _add_plan_parser(sub)
    return parser


def _disk_full_line(e: OSError) -> str:
    """The one line of a write that found no space left (or the quota spent): the file, and for a run
    (``DiskFullError``) whether and how it continues."""
    what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
    folder, hint = getattr(e, "folder", None), "; free space and try again"
    if isinstance(e, DiskFullError) and e.resumable:
        hint = f"; free space and continue with: moerl train --resume {folder}"
    elif isinstance(e, DiskFullError) and folder is not None:
        hint = f" before the first checkpoint: {folder} holds the metrics so far but cannot be resumed"
    elif isinstance(e, DiskFullError):
        hint = " before the first step (no run folder left); free space and start again"
    return f"moerl: {what} writing {e.filename or folder or 'a file'}{hint}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"moerl: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except RewardFunctionError as e:  # one line, no traceback; the folder only when it holds trained steps
        if e.folder is None:
            hint = "; nothing was written (the run folder was removed)"
        else:
            hint = f"; fix it and continue from the newest checkpoint with: moerl train --resume {e.folder}"
        print(f"moerl: stopped: {e}{hint}", file=sys.stderr)
        return EXIT_REWARD_FAILED
    except (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        # user mistakes (missing config, not a run folder, unwritable output): one line, no traceback
        message = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        print(f"moerl: {message}", file=sys.stderr)
        return 2
    except RunFolderInUseError as e:  # a second run or resume of a live run folder: nothing touched
        print(f"moerl: {e}", file=sys.stderr)
        return 2
    except RayStartError as e:  # a loaded host: Ray's raylet missed its wait in every attempt; one line
        print(f"moerl: {e}", file=sys.stderr)
        return 1
    except WeightVersionRefused as e:  # sync mode cannot generate past a refused version: one line
        print(f"moerl: {e}", file=sys.stderr)
        return 1
    except ExchangeLostError as e:  # the queue/buffer actor's node was lost: one line with the resume command
        print(e.line(), file=sys.stderr)
        return 1
    except StorageError as e:  # an upload that failed after its retries: one line, the local copy is whole
        print(f"moerl: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk is not a config error: what was committed is whole, it can go on
        if e.errno not in DiskFullError.ERRNOS:
            raise
        print(_disk_full_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside a run (a run's interrupt is handled by its command)
        print("moerl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
