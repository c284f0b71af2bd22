"""``moerl plan``: a preset or YAML plan, ``--set`` overrides, ``--sweep`` grids, table / JSON / CSV / plot.

    moerl plan --preset mission
    moerl plan --preset mission --sweep top_k=1,2,4 --sweep placement=grouped,round_robin
    moerl plan --file plan.yaml --sweep total_nodes=13,63,125 --plot out.png --json out.json --csv out.csv
    moerl plan --validate            # predictions against bench/results (fitted and held-out points)
    moerl plan --config configs/cluster_qwen3_30b_1node.yaml   # a run config's model, nodes and batch

Output fits ``COLUMNS`` (100) columns: the main table leaves out EP ms/step and inter-node MB/layer, which
``--wide`` adds (up to ``WIDE_COLUMNS``); long lines wrap.

Bad input (unknown preset or parameter, a value outside its range (``moerl.plan.inputs``), invalid YAML, a
parameter swept twice, --validate with plan flags or without bench results) raises ConfigError, an unusable
--json/--csv/--plot path an OSError naming it: one line, exit 2, before any prediction runs. --preset and
--file exclude each other (argparse: a plan file starts from the mission preset).
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import yaml
from rich import box
from rich.console import Console
from rich.table import Table

from moerl.atomic import atomic_path, atomic_write_text
from moerl.configlib import ConfigError
from moerl.plan.args import COLUMNS, PRESETS, RESULTS, WIDE_COLUMNS
from moerl.plan.inputs import Plan, with_params
from moerl.plan.matrix import ratio_sensitivity, schedule_matrix
from moerl.plan.models import MODELS, ModelShape
from moerl.plan.predict import as_rows, best_split, plan_hardware, plan_model, run
from moerl.plan.published import BOUND, published_rows
from moerl.plan.sensitivity import tornado
from moerl.plan.validate_report import validation_lines, validation_rows, validation_table


def register_model(shape: ModelShape) -> None:
    """Make ``shape`` a model plans can name (``moerl plan --config`` with a model of its own). Here, not in
    ``moerl.plan.models``: that module is part of the frozen planner model (``moerl.plan.freeze``).

    Raises:
        ConfigError: another shape already has that name.
    """
    if MODELS.get(shape.name, shape) != shape:
        raise ConfigError(f"model {shape.name!r} is already a planner model of other shapes")
    MODELS[shape.name] = shape


def _split(item: str, flag: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"{flag} {item!r}: expected PARAM=VALUE")
    k, v = item.split("=", 1)
    return k.strip(), v.strip()


def _read_plan_file(file: str) -> dict:
    try:
        loaded = yaml.safe_load(Path(file).read_text()) or {}  # FileNotFoundError -> exit 2 in moerl.cli
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"{file}: not valid YAML{where}: {problem}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: a plan file is a mapping of parameters")
    return loaded


def check_preset(preset: str | None) -> None:
    """Raise ConfigError for a preset name that is not one of ``PRESETS`` (None: the default, mission)."""
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")


def build_plan(
    preset: str | None, file: str | None, overrides: list[str], config_values: dict | None = None
) -> Plan:
    """The base plan: preset (or YAML file, or a run config's ``config_values``:
    ``moerl.cluster.plan_inputs.plan_values``), then ``--set`` overrides. Raises ConfigError on bad input."""
    check_preset(preset)
    values = dict(PRESETS[preset or "mission"])
    if file is not None:
        values.update(_read_plan_file(file))
    values.update(config_values or {})
    values.update(_split(item, "--set") for item in overrides)
    return with_params(Plan(), values)


def check_output_paths(args: argparse.Namespace) -> None:
    """Check ``--json``, ``--csv`` and ``--plot`` before any prediction runs: each names a file whose folder
    exists and is writable, and is not itself a folder.

    Raises:
        IsADirectoryError: the path is a folder.
        FileNotFoundError / NotADirectoryError: its parent folder is missing, or is a file.
        PermissionError: its parent folder is not writable.
    """
    for flag in ("json", "csv", "plot"):
        given = getattr(args, flag, None)
        if not given:
            continue
        path = Path(given)
        parent = path.parent
        if path.is_dir():
            raise IsADirectoryError(f"--{flag} {given}: is a folder; give the path of a file to write")
        if not parent.exists():
            raise FileNotFoundError(f"--{flag} {given}: the folder {parent} does not exist")
        if not parent.is_dir():
            raise NotADirectoryError(f"--{flag} {given}: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(f"--{flag} {given}: the folder {parent} is not writable")


def sweep_points(base: Plan, sweeps: list[str]) -> list[tuple[dict, Plan]]:
    """Every point of the grid of ``--sweep`` items, each validated (ranges included) before any prediction
    runs. Raises ConfigError for an item without values, a parameter swept twice, or an invalid point
    (the message starts with the point)."""
    axes, given = [], {}
    for item in sweeps:
        k, v = _split(item, "--sweep")
        values = [x for x in v.split(",") if x]
        if not values:
            raise ConfigError(f"--sweep {item!r}: no values")
        if k in given:
            raise ConfigError(
                f"--sweep {k} given twice ({given[k]!r}, {item!r}); list its values once: {k}=a,b,..."
            )
        given[k] = item
        axes.append([(k, x) for x in values])
    return [(dict(combo), _sweep_point(base, dict(combo))) for combo in itertools.product(*axes)]


def _sweep_point(base: Plan, values: dict[str, str]) -> Plan:
    try:
        return with_params(base, values)
    except ConfigError as e:
        point = ", ".join(f"{k}={v}" for k, v in values.items())
        raise ConfigError(f"--sweep point {point}: {e}") from None


WIDE_ONLY = ("EP ms/step", "inter MB/layer")
"""Columns of the main table shown with ``--wide`` only."""


def _table(points: list[dict], swept: list[str], *, wide: bool = False) -> Table:
    t = Table(title="moerl plan (per dispatcher; hier/flat = rollout tok/s ratio)", box=box.SIMPLE_HEAD,
              pad_edge=False, title_justify="left")  # fmt: skip
    cols = [*swept, "dispatcher", "nodes t/r", "rollout tok/s", "decode ms", "EP ms/step", "inter MB/layer", "train s",
            "useful ep/s", "balance", "$/1000 ep", "hier/flat"]  # fmt: skip
    keep = [wide or c not in WIDE_ONLY for c in cols]
    for c, shown in zip(cols, keep, strict=True):
        if shown:  # two-line headers: the figures set the widths; a figure is folded, never cut
            t.add_column(c if c in swept else c.replace(" ", "\n", 1), justify="right", overflow="fold")
    for pt in points:
        for pr in pt["predictions"]:
            row = [*[str(pt["swept"][s]) for s in swept], pr["dispatcher"],
                   f"{pr['train_nodes']}/{pt['plan']['total_nodes'] - pr['train_nodes']}", f"{pr['rollout_tok_s']:,.0f}",
                   f"{pr['decode_step_ms']:.1f}", f"{pr['ep_ms_per_step']:.1f}", f"{pr['inter_node_mb_per_layer']:.2f}",
                   f"{pr['train_step_s']:.1f}", f"{pr['useful_episodes_s']:.2f}", f"{pr['balance']:.2f}", f"{pr['usd_per_1000_episodes']:.2f}",
                   f"{pt['ratio_rollout_hier_over_flat']:.3f}"]  # fmt: skip
            t.add_row(*[v for v, shown in zip(row, keep, strict=True) if shown])
    return t


def _write_csv(path: str, points: list[dict]) -> None:
    rows = [
        {**pt["plan"], **pr, "ratio": pt["ratio_rollout_hier_over_flat"]}
        for pt in points
        for pr in pt["predictions"]
    ]
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, text.getvalue())


def plot(points: list[dict], axis: str, path: str) -> None:
    """Rollout tok/s (left) and $ per 1000 useful episodes (right) of both dispatchers against ``axis``."""
    import matplotlib  # lazy: heavy, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [pt["plan"][axis] for pt in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (name, style) in enumerate((("flat all-to-all", "o-"), ("hierarchical", "s-"))):
        a.plot(xs, [pt["predictions"][i]["rollout_tok_s"] / 1e3 for pt in points], style, label=name)
        b.plot(xs, [pt["predictions"][i]["usd_per_1000_episodes"] for pt in points], style, label=name)
    label = f"{axis} (8 GPUs each)" if axis == "total_nodes" else axis
    a.set(xlabel=label, ylabel="rollout k tok/s (all rollout GPUs)", title="Rollout throughput")
    b.set(xlabel=label, ylabel="$ per 1000 useful episodes", title="Cost")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def effective_values(plan: Plan) -> dict[str, str]:
    """The value ``predict`` uses for each Plan field whose default means "take it from elsewhere" (0 or
    -1), with where it came from: {field: "value (source)"}."""
    hw, m = plan_hardware(plan), plan_model(plan)  # the figures predict() uses
    rate = plan.interruptions_per_hour
    return {
        "top_k": f"{m.top_k} ({'plan' if plan.top_k else f'the model {m.name}'})",
        "train_share": f"{plan.train_nodes / plan.total_nodes:.3f} (train_nodes / total_nodes = "
        f"{plan.train_nodes} / {plan.total_nodes}{'' if plan.train_share else '; train_nodes given'})",
        "flat_net_fraction": f"{plan.flat_net_fraction or plan.net_fraction} "
        f"({'plan' if plan.flat_net_fraction else 'net_fraction'})",
        "price_on_demand": f"{hw.price_on_demand} $/node-hour "
        f"({'plan' if plan.price_on_demand else f'{hw.name} catalog'})",
        "schedule": f"{plan.schedule_used} ({'plan' if plan.schedule != 'auto' else 'auto: from mode and max_staleness'})",
        "interruptions_per_hour": f"{hw.interruptions_per_hour} per node-hour "
        f"({'plan' if rate >= 0 else f'{hw.name} catalog'}; applied only with spot_rollout)",
    }


def assumptions(plan: Plan, cal: dict) -> list[str]:
    """Every input of a prediction, one line each, with its source."""
    hw = plan_hardware(plan)  # with the plan's price and interruption rate: the figures predict() uses
    used = effective_values(plan)
    overridden = {"price_on_demand"} if plan.price_on_demand else set()
    overridden |= {"interruptions_per_hour"} if plan.interruptions_per_hour >= 0 else set()
    lines = [
        f"plan.{f.name} = {used[f.name]}" if f.name in used else f"plan.{f.name} = {getattr(plan, f.name)}"
        for f in fields(Plan)
    ]
    lines += [
        f"hardware.{k} = {v} ({'plan' if k in overridden else hw.sources.get(k, 'catalog')})"
        for k, v in asdict(hw).items()
        if k != "sources"
    ]
    lines += [
        f"calibrated.{k} = {v:.4g} ({cal['sources'].get(k, cal['sources']['ep'])})"
        for k, v in cal["constants"].items()
    ]
    sync = cal.get("weight_sync", {})
    lines += [
        f"measured.weight_sync.{k} = {v:.4g} ({sync['source']})" for k, v in sync.get("constants", {}).items()
    ]
    return lines


def _summary(plan: Plan, point: dict, cal: dict) -> str:
    flat, hier = point["predictions"]
    train, useful = best_split(plan, cal)
    return "\n".join([
        f"hierarchical / flat rollout tok/s: {point['ratio_rollout_hier_over_flat']:.3f}",
        f"schedule {hier['schedule']}, weight transport {hier['weight_transport']}: weight sync "
        f"{hier['weight_sync_s']:.2f} s, step {flat['step_s']:.1f} s flat / {hier['step_s']:.1f} s hierarchical, "
        f"{hier['tokens_per_s_per_gpu']:,.0f} training tok/s per GPU (hierarchical)",
        f"async iteration {hier['async_iter_s']:.1f} s vs sync {hier['sync_iter_s']:.1f} s (hierarchical); "
        f"rollout supply / training demand = {hier['balance']:.2f}",
        f"best split of {plan.total_nodes} nodes: {train} training + {plan.total_nodes - train} rollout "
        f"({useful:.2f} useful episodes/s, hierarchical)",
        f"$ per useful episode: flat {flat['usd_per_episode']:.4f}, hierarchical {hier['usd_per_episode']:.4f}; "
        f"per 1000: {flat['usd_per_1000_episodes']:.2f} / {hier['usd_per_1000_episodes']:.2f}",
        *_hard_loss_line(plan, hier),
    ])  # fmt: skip


def _hard_loss_line(plan: Plan, hier: dict) -> list[str]:
    """The Spot hard-loss line (``hard_loss_fraction`` > 0): $ per useful episode with and without
    progress snapshots, and the replica-seconds lost per interruption."""
    if not (plan.spot_rollout and plan.hard_loss_fraction > 0):
        return []
    return [
        f"Spot hard losses ({plan.hard_loss_fraction:.0%} of interruptions): {hier['spot_lost_s']:.0f} replica-s "
        f"lost per interruption; $ per useful episode {hier['usd_per_episode']:.4f} with "
        f"snapshot_tokens={plan.snapshot_tokens:g}, {hier['usd_per_episode_no_snapshots']:.4f} without "
        "(hierarchical)"
    ]


def _tornado_table(rows: list[dict]) -> Table:
    t = Table(title=f"sensitivity of hier/flat rollout tok/s (base {rows[0]['base']:.3f})")
    for c in ("assumption", "low", "high", "ratio at low", "ratio at high", "meaning"):
        t.add_column(c, justify="left" if c in ("assumption", "meaning") else "right", overflow="fold")
    fmt = lambda r: "invalid" if r is None else f"{r:.3f}"  # noqa: E731
    for r in rows:
        t.add_row(r["param"], r["low"], r["high"], fmt(r["ratio_low"]), fmt(r["ratio_high"]), r["what"])
    return t


def published_table(rows: list[dict]) -> Table:
    """The ``--published`` table: figure, quantity, published value, prediction, ratio, within the bound."""
    t = Table(title=f"moerl plan --published (hit: within +-{BOUND:.0%} of the value or the range's nearest end)",
              box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")  # fmt: skip
    for c in ("#", "figure", "quantity", "published", "predicted", "ratio", "error", "hit"):
        t.add_column(c, justify="left" if c in ("figure", "quantity") else "right", overflow="fold")
    for i, r in enumerate(rows, 1):
        t.add_row(str(i), r["key"], r["quantity"].replace("tokens_per_s_per_gpu", "tok/s/GPU"), r["published"],
                  f"{r['predicted']:.3g}", f"{r['ratio']:.2f}", f"{r['error']:+.0%}", "yes" if r["hit"] else "MISS")  # fmt: skip
    return t


def published_lines(rows: list[dict]) -> list[str]:
    """Per figure: the parameters used, where they come from, what was assumed, the figure's source."""
    lines = [f"{sum(r['hit'] for r in rows)} of {len(rows)} figures within +-{BOUND:.0%}; misses are not refitted "
             "(the constants come from moerl's measurements and datasheets only)."]  # fmt: skip
    for i, r in enumerate(rows, 1):
        params = ", ".join(f"{k}={v}" for k, v in r["setup"].items())
        sync = f"; sync of {r['sync_gb']:g} GB as published" if r["sync_gb"] else ""
        sync += (
            "; {} trainer and {} rollout GPUs as published".format(*r["sync_gpus"])
            if any(r["sync_gpus"])
            else ""
        )
        parts = ", ".join(f"{k} {v:.3g} s" for k, v in r["parts"].items())
        lines += [f"[{i}] {r['key']}: {params}{sync}", f"    predicted parts: {parts}", f"    figure: {r['source']}",
                  f"    setup: {r['setup_source']}"]  # fmt: skip
        if r["assumed"]:
            lines.append(f"    assumed: {r['assumed']}")
    return lines


def _matrix_tables(plan: Plan, cal: dict) -> list[Table]:
    """``--schedules``: the (schedule, transport) matrix and the ratio's sensitivity (``moerl.plan.matrix``)."""
    m = Table(title="hier/flat useful episodes/s and $ per 1000 useful episodes by schedule and transport",
              box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")  # fmt: skip
    for c in (
        "schedule",
        "transport",
        "sync s",
        "step s flat",
        "step s hier",
        "$/1000 flat",
        "$/1000 hier",
        "hier/flat",
    ):
        named = c in ("schedule", "transport")
        m.add_column(
            c if named else c.replace(" ", "\n", 1), justify="left" if named else "right", no_wrap=named
        )
    for r in schedule_matrix(plan, cal):
        if "error" in r:
            m.add_row(r["schedule"], r["transport"], *(["-"] * 6))
            continue
        m.add_row(r["schedule"], r["transport"], f"{r['weight_sync_s']:.2f}", f"{r['step_flat_s']:.1f}",
                  f"{r['step_hier_s']:.1f}", f"{r['usd_flat']:.2f}", f"{r['usd_hier']:.2f}", f"{r['ratio']:.3f}")  # fmt: skip
    rows = ratio_sensitivity(plan, cal)
    s = Table(title="hier/flat useful episodes/s with one calibrated value at its low / high: fractions x0.5..x2, "
              "fixed costs x0.1..x2, rates x0.5..x4 (--sensitivity: the values); header: the plan's ratio",
              box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")  # fmt: skip
    s.add_column("calibrated value", no_wrap=True)
    schedules = list(rows[0]["base"])
    for sch in schedules:
        base = rows[0]["base"][sch]
        s.add_column(f"{sch}\n{base:.3f}" if base else sch, justify="right", no_wrap=True)
    fmt = lambda r: "-" if r is None else f"{r:.3f}"  # noqa: E731
    for r in rows:
        s.add_row(r["param"].replace("weight_sync.constants.", "weight_sync."),
                  *[f"{fmt(r['by_schedule'][sch][0])}/{fmt(r['by_schedule'][sch][1])}" for sch in schedules])  # fmt: skip
    return [m, s]


def results_folder(given: str | None) -> Path:
    """The bench results folder of ``--validate``: ``--results`` as given, else the repository's ``RESULTS``
    (so ``moerl plan --validate`` runs from any folder). Raises ConfigError naming where it looked."""
    folder = Path(given) if given else RESULTS
    if given and not folder.is_dir():
        raise ConfigError(
            f"--results {given}: not a folder (give the bench/results folder of a moerl checkout)"
        )
    if not folder.is_dir():
        raise ConfigError(
            f"--validate: no bench results at {RESULTS} (bench/results beside this moerl); give --results FOLDER"
        )
    return folder


def _published_main(args: argparse.Namespace, cal: dict, console: Console) -> int:
    """``moerl plan --published``: the table, each figure's parameters and sources, ``--json``. Raises
    ConfigError when a plan flag is given (the figures' own setups are the plans)."""
    ignored = [f for f, v in (("--preset", args.preset), ("--file", args.file), ("--config", getattr(args, "config", None)),
                              ("--set", args.overrides), ("--sweep", args.sweep), ("--csv", args.csv),
                              ("--plot", args.plot), ("--sensitivity", args.sensitivity),
                              ("--validate", args.validate), ("--schedules", getattr(args, "schedules", False)),
                              ("--assumptions", getattr(args, "assumptions", False)), ("--results", args.results)) if v]  # fmt: skip
    if ignored:
        raise ConfigError(f"--published predicts the published runs' own setups; drop {', '.join(ignored)}")
    check_output_paths(args)
    rows = published_rows(cal)
    console.print(published_table(rows))
    console.print("\n".join(published_lines(rows)), highlight=False)
    if args.json:
        atomic_write_text(args.json, json.dumps({"bound": BOUND, "figures": rows}, indent=2))
    return 0


def plan_main(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit code."""
    try:
        cal = json.loads(Path(args.calibration).read_text())  # a missing file: FileNotFoundError, exit 2
    except json.JSONDecodeError as e:
        raise ConfigError(f"--calibration {args.calibration}: not valid JSON ({e})") from None
    console = Console(width=WIDE_COLUMNS if getattr(args, "wide", False) else COLUMNS)
    check_preset(args.preset)
    config_values = getattr(args, "config_values", None)
    if getattr(args, "published", False):
        return _published_main(args, cal, console)
    if args.validate:
        ignored = [f for f, v in (("--preset", args.preset), ("--file", args.file),
                                  ("--config", getattr(args, "config", None)), ("--set", args.overrides),
                                  ("--sweep", args.sweep), ("--json", args.json), ("--csv", args.csv),
                                  ("--plot", args.plot), ("--sensitivity", args.sensitivity),
                                  ("--schedules", getattr(args, "schedules", False)),
                                  ("--assumptions", getattr(args, "assumptions", False))) if v]  # fmt: skip
        if ignored:
            raise ConfigError(
                f"--validate compares the calibration with bench results only; drop {', '.join(ignored)}"
            )
        rows = validation_rows(cal, results_folder(args.results))
        console.print(validation_table(rows))
        console.print("\n".join(validation_lines(rows, cal)), highlight=False)
        return 0
    if args.results is not None:
        raise ConfigError("--results is read by --validate only")
    if args.plot and not args.sweep:
        raise ConfigError("--plot needs a --sweep (its first parameter is the x axis)")
    check_output_paths(args)
    base = build_plan(args.preset, args.file, args.overrides, config_values)
    grid = sweep_points(base, args.sweep)  # every point validated before the first prediction
    swept = [_split(s, "--sweep")[0] for s in args.sweep]
    points = [{"swept": sw, **as_rows(p, run(p, cal))} for sw, p in grid]
    for note in getattr(args, "config_notes", ()):
        console.print(f"note: {note}", highlight=False)
    console.print(_table(points, swept, wide=getattr(args, "wide", False)))
    if not args.sweep:  # the answer first; the inputs behind it on request
        console.print(_summary(base, points[0], cal), highlight=False)
    if getattr(args, "assumptions", False):
        console.print("\n".join(["assumptions:", *assumptions(base, cal)]), highlight=False)
    if args.sensitivity:
        console.print(_tornado_table(tornado(base, cal)))
    if getattr(args, "schedules", False):
        for table in _matrix_tables(base, cal):
            console.print(table)
    if args.json:
        atomic_write_text(
            args.json, json.dumps({"calibration": cal["constants"], "points": points}, indent=2)
        )
    if args.csv:
        _write_csv(args.csv, points)
    if args.plot:
        plot(points, swept[0], args.plot)
    return 0
