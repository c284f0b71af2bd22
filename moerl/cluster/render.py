"""``moerl cluster render``: a run config with a ``cluster:`` section -> the manifests that deploy it.

    OUT/eksctl-cluster.yaml              eksctl create cluster -f ...   (node groups, IRSA for S3)
    OUT/iam-s3-policy.json               the service account's S3 policy alone (``moerl.cluster.iam``), for
                                         a role made by other means
    OUT/k8s/00-namespace.yaml            kubectl apply -f OUT/k8s/
    OUT/k8s/10-efa-device-plugin.yaml    the EFA device plugin on the EFA groups
    OUT/k8s/20-run-config.yaml           ConfigMap: the run config as the cluster runs it
    OUT/k8s/30-rayjob.yaml               KubeRay RayJob (its RayCluster spec: head + 4 worker groups)
    OUT/k8s/40-prometheus-rule.yaml      PrometheusRule from ``cluster.alert_rules`` (when the file exists)

Manifests are built as Python dicts (``moerl.cluster.kuberay``, ``moerl.cluster.eks``), dumped with
PyYAML and written atomically (temp file, then rename). The run config is checked against the cluster
before anything is written: every ``ConfigError`` names the field.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from moerl.atomic import atomic_write_text
from moerl.cluster.eks import efa_device_plugin, eksctl_cluster_config
from moerl.cluster.iam import s3_policy
from moerl.cluster.kuberay import NOTICE_FILE, config_map_name, model_folder, ray_job
from moerl.cluster.memory import memory_warnings
from moerl.config import ConfigError, RunConfig, from_dict, rollout_ep_ranks_per_node, to_dict
from moerl.placement import Placement

RUN_CONFIG_KEY = "run.yaml"
NO_IMAGE = (
    "cluster.image is unset: moerl publishes no image; build deploy/docker/Dockerfile, push it to a "
    "registry your nodes can pull from and set cluster.image=<registry>/moerl:<tag>"
)
"""The render's refusal without ``cluster.image`` (why: ``ClusterConfig.image``)."""
IMDS_URL = "http://169.254.169.254"
"""The EC2 instance metadata service (IMDSv2), polled by the rollout workers for Spot notices."""


@dataclass(frozen=True, slots=True)
class Rendered:
    """What ``render`` wrote."""

    files: tuple[Path, ...]
    """Every file written, in apply order (the eksctl config first)."""
    skipped: tuple[str, ...]
    """One line per manifest not written and why (e.g. no alert rule file)."""


def train_nodes(cfg: RunConfig) -> int:
    """Training nodes the trainer ranks fill: ``ceil(trainer.num_ranks / trainer.gpus_per_node)``."""
    return math.ceil(Placement.from_config(cfg).trainer.num_ranks / cfg.trainer.gpus_per_node)


def policy_folder(cfg: RunConfig) -> str | None:
    """The cluster run's ``init_from``: where the train pods copy ``cluster.model_url``, else the run's own.

    Raises:
        ConfigError: ``init_from`` contradicts ``cluster.model_url``, or the run has no policy to start
            from (no ``cluster.model_url``, ``init_from`` or ``model.path``: a fresh random model).
    """
    url = cfg.cluster.model_url
    if url is None:
        if cfg.init_from is None and cfg.model.path is None:
            raise ConfigError(
                "cluster.model_url, init_from and model.path are all unset: the cluster run would train a "
                "fresh random model; set cluster.model_url=s3://bucket/models/<HF model folder>"
            )
        return cfg.init_from
    folder = model_folder(url)
    if cfg.init_from is not None and cfg.init_from != folder:
        raise ConfigError(
            f"init_from={cfg.init_from!r} contradicts cluster.model_url={url!r}, which the train pods copy "
            f"to {folder!r}; leave init_from unset"
        )
    return folder


def _check_trainer(cfg: RunConfig) -> None:
    """The trainer group's layout (``trainer.num_ranks``, ``trainer.gpus_per_node``) against the train
    group's nodes; ``trainer.ep_size`` is checked by the run config itself (divides ranks and experts)."""
    c, t = cfg.cluster, cfg.trainer
    num_ranks = Placement.from_config(cfg).trainer.num_ranks
    gpus_per_node = c.train.gpus_per_node
    if t.gpus_per_node != gpus_per_node:
        raise ConfigError(
            f"trainer.gpus_per_node={t.gpus_per_node} but cluster.train.gpus_per_node={gpus_per_node} "
            f"({c.train.instance_types[0]}): the trainer's node topology is the train nodes'; "
            f"set trainer.gpus_per_node={gpus_per_node}"
        )
    gpus = c.train.max_nodes * gpus_per_node
    if num_ranks > gpus:
        raise ConfigError(
            f"trainer.num_ranks={num_ranks} is more than the train group's {gpus} GPUs "
            f"(cluster.train.max_nodes={c.train.max_nodes} x gpus_per_node={gpus_per_node})"
        )
    if train_nodes(cfg) < c.train.min_nodes:
        raise ConfigError(
            f"trainer.num_ranks={num_ranks} fills {train_nodes(cfg)} of the train group's "
            f"cluster.train.min_nodes={c.train.min_nodes} on-demand nodes ({gpus_per_node} GPUs each); "
            f"set trainer.num_ranks={c.train.min_nodes * gpus_per_node} or lower cluster.train.min_nodes"
        )


def _check(cfg: RunConfig) -> None:
    """Cross-checks between the run and its cluster (the sections validate themselves).

    Raises:
        ConfigError: no ``cluster.image``, storage not in S3, a trainer layout that does not fit the train
            group, a rollout EP node slice (``rollout.ep_ranks_per_node``) that does not divide a rollout
            node's GPUs, more rollout workers (of ``ep_size / ep_ranks_per_node`` nodes each) than the
            rollout group can hold.
    """
    c = cfg.cluster
    if c.image is None:
        raise ConfigError(NO_IMAGE)
    if not (cfg.storage.url or "").startswith("s3://"):
        raise ConfigError(
            f"storage.url={cfg.storage.url!r}: a cluster run has no shared filesystem, its checkpoints and "
            "weight versions go to S3; set storage.url=s3://bucket/prefix"
        )
    if cfg.runtime.store_url is not None and not cfg.runtime.store_url.startswith("s3://"):
        raise ConfigError(f"runtime.store_url={cfg.runtime.store_url!r} must be in S3 on a cluster (or None)")
    _check_trainer(cfg)
    # a rollout worker's EP group: G ranks (GPUs) on each of ep_size / G rollout nodes
    ep, g = cfg.rollout.ep_size, rollout_ep_ranks_per_node(cfg)
    if c.rollout.gpus_per_node % g:
        raise ConfigError(
            f"rollout.ep_ranks_per_node={g} (rollout.ep_size={ep}) must divide cluster.rollout.gpus_per_node="
            f"{c.rollout.gpus_per_node}: a rollout node holds whole slices of EP groups"
        )
    spans, per_node = ep // g, c.rollout.gpus_per_node // g  # nodes per worker, group slices per node
    wanted = cfg.fleet.max_workers or cfg.rollout.num_workers  # >= num_workers (config checks)
    if spans > c.rollout.max_nodes or wanted * spans > per_node * c.rollout.max_nodes:
        raise ConfigError(
            f"{wanted} rollout workers (fleet.max_workers or rollout.num_workers) of {spans} node(s) each "
            f"need {math.ceil(wanted * spans / per_node)} rollout nodes of {per_node} group slice(s) "
            f"({g} GPUs each); cluster.rollout.max_nodes={c.rollout.max_nodes}"
        )


def cluster_run_config(cfg: RunConfig) -> RunConfig:
    """The run config as the cluster runs it: async on the job's Ray cluster (``ray_address: auto``),
    the model on CUDA, the rollout pods' notice file and the instance metadata service (IMDSv2) as
    notice sources, ``init_from`` the train pods' copy of ``cluster.model_url``; everything else as given,
    the layout included. ``job_run_config`` is what the job reads.

    Raises:
        ConfigError: see ``_check`` and ``policy_folder``.
    """
    _check(cfg)
    data = to_dict(cfg)
    data["runtime"].update(mode="async", ray_address="auto")
    data["model"]["device"] = "cuda"
    data["fleet"]["notice_file"] = NOTICE_FILE
    data["fleet"]["imds_url"] = data["fleet"]["imds_url"] or IMDS_URL
    data["init_from"] = policy_folder(cfg)
    data["rollout"]["ep_ranks_per_node"] = rollout_ep_ranks_per_node(cfg)  # the layout, written out
    return from_dict(RunConfig, data)


def job_run_config(run: RunConfig) -> dict:
    """The run config the job's ``moerl train`` reads (the ConfigMap's ``run.yaml``, TorchX's
    ``MOERL_RUN_CONFIG``), as a dict: ``run`` (from ``cluster_run_config``) as it is. Every layout field
    is the run's own: ``trainer.num_ranks``, ``trainer.ep_size``, ``trainer.gpus_per_node``,
    ``rollout.num_workers``, ``rollout.ep_size``, ``rollout.ep_ranks_per_node`` (resolved)."""
    return to_dict(run)


def namespace(cfg: RunConfig) -> dict:
    """The ``Namespace`` of the run."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cfg.cluster.namespace}}


def run_config_map(cfg: RunConfig) -> dict:
    """The ``ConfigMap`` with the run config (key ``run.yaml``: ``job_run_config``), mounted into every
    Ray pod at ``moerl.cluster.kuberay.CONFIG_DIR``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(cfg), "namespace": cfg.cluster.namespace},
        "data": {RUN_CONFIG_KEY: yaml.safe_dump(job_run_config(cfg), sort_keys=False)},
    }


def prometheus_rule(cfg: RunConfig, rules_path: Path) -> dict:
    """A ``PrometheusRule`` (Prometheus Operator, ``monitoring.coreos.com/v1``) with the groups of a
    Prometheus rule file.

    Raises:
        ConfigError: the file is not YAML with a ``groups`` list.
    """
    try:
        doc = yaml.safe_load(rules_path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"cluster.alert_rules={str(rules_path)!r}: not valid YAML ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        raise ConfigError(
            f"cluster.alert_rules={str(rules_path)!r}: expected a Prometheus rule file with 'groups:'"
        )
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": f"{cfg.cluster.name}-alerts",
            "namespace": cfg.cluster.namespace,
            "labels": {"app.kubernetes.io/name": "moerl", "release": "prometheus"},
        },
        "spec": {"groups": doc["groups"]},
    }


def manifests(cfg: RunConfig) -> tuple[dict[str, dict], list[str]]:
    """Every manifest by its file name under OUT (see the module docstring), and the skipped ones.

    Args:
        cfg: the user's run config; it is turned into the cluster's with ``cluster_run_config``.

    Raises:
        ConfigError: the run does not fit the cluster, or a bad alert rule file.
    """
    cfg = cluster_run_config(cfg)
    out = {
        "eksctl-cluster.yaml": eksctl_cluster_config(cfg),
        "iam-s3-policy.json": s3_policy(cfg),
        "k8s/00-namespace.yaml": namespace(cfg),
        "k8s/10-efa-device-plugin.yaml": efa_device_plugin(cfg),
        "k8s/20-run-config.yaml": run_config_map(cfg),
        "k8s/30-rayjob.yaml": ray_job(cfg, RUN_CONFIG_KEY),
    }
    skipped = []
    if not any(getattr(cfg.cluster, g).efa_interfaces for g in ("train", "rollout", "cpu", "memory")):
        del out["k8s/10-efa-device-plugin.yaml"]
        skipped.append("k8s/10-efa-device-plugin.yaml: no group has EFA interfaces")
    rules = cfg.cluster.alert_rules
    if rules is not None and Path(rules).is_file():
        out["k8s/40-prometheus-rule.yaml"] = prometheus_rule(cfg, Path(rules))
    elif rules is not None:
        skipped.append(f"k8s/40-prometheus-rule.yaml: cluster.alert_rules={rules!r} not found")
    return out, skipped


def render(cfg: RunConfig, out_dir: str | Path) -> Rendered:
    """Write the manifests of ``cfg`` under ``out_dir`` (created; files of the same names replaced).

    Raises:
        ConfigError: as ``manifests`` (nothing is written then).
        NotADirectoryError: ``out_dir`` is a file.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(20, "not a directory", str(out_dir))
    docs, skipped = manifests(cfg)  # every check runs before the first write
    files = []
    for name, doc in docs.items():
        path = out_dir / name
        text = (
            json.dumps(doc, indent=2) + "\n"
            if name.endswith(".json")
            else yaml.safe_dump(doc, sort_keys=False, width=110)
        )
        atomic_write_text(path, text)
        files.append(path)
    return Rendered(tuple(files), tuple(skipped))


def render_main(cfg: RunConfig, out_dir: str) -> int:
    """``moerl cluster render``: render, then print each file written and each manifest skipped, and
    warn (stderr) of GPUs the run would overfill (``moerl.cluster.memory``)."""
    result = render(cfg, out_dir)
    for path in result.files:
        print(path)
    for line in result.skipped:
        print(f"skipped {line}")
    for line in memory_warnings(cfg):  # told before any node is rented (moerl.cluster.memory)
        print(f"warning: {line}", file=sys.stderr)
    return 0
