"""``moerl cluster render``: a run config with a ``cluster:`` section -> the manifests that deploy it.

    OUT/eksctl-cluster.yaml              eksctl create cluster -f ...   (node groups, IRSA for S3)
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

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from moerl.atomic import atomic_write_text
from moerl.cluster.eks import efa_device_plugin, eksctl_cluster_config
from moerl.cluster.kuberay import NOTICE_FILE, config_map_name, ray_job
from moerl.config import ConfigError, RunConfig, from_dict, to_dict

RUN_CONFIG_KEY = "run.yaml"
IMDS_URL = "http://169.254.169.254"
"""The EC2 instance metadata service (IMDSv2), polled by the rollout workers for Spot notices."""


@dataclass(frozen=True, slots=True)
class Rendered:
    """What ``render`` wrote."""

    files: tuple[Path, ...]
    """Every file written, in apply order (the eksctl config first)."""
    skipped: tuple[str, ...]
    """One line per manifest not written and why (e.g. no alert rule file)."""


def num_trainer_ranks(cfg: RunConfig) -> int:
    """Trainer ranks: ``cluster.num_trainer_ranks``, else every GPU of the train group's ``max_nodes``."""
    c = cfg.cluster
    return (
        c.num_trainer_ranks if c.num_trainer_ranks is not None else c.train.max_nodes * c.train.gpus_per_node
    )


def _check(cfg: RunConfig) -> None:
    """Cross-checks between the run and its cluster (the sections validate themselves).

    Raises:
        ConfigError: storage not in S3, more ranks than training GPUs, an EP size that does not divide
            the ranks or the experts, more rollout workers than the rollout group can hold.
    """
    c = cfg.cluster
    if not (cfg.storage.url or "").startswith("s3://"):
        raise ConfigError(
            f"storage.url={cfg.storage.url!r}: a cluster run has no shared filesystem, its checkpoints and "
            "weight versions go to S3; set storage.url=s3://bucket/prefix"
        )
    if cfg.runtime.store_url is not None and not cfg.runtime.store_url.startswith("s3://"):
        raise ConfigError(f"runtime.store_url={cfg.runtime.store_url!r} must be in S3 on a cluster (or None)")
    ranks, gpus = num_trainer_ranks(cfg), c.train.max_nodes * c.train.gpus_per_node
    if ranks > gpus:
        raise ConfigError(
            f"cluster.num_trainer_ranks={ranks} is more than the train group's {gpus} GPUs "
            f"(cluster.train.max_nodes={c.train.max_nodes} x gpus_per_node={c.train.gpus_per_node})"
        )
    if ranks % c.trainer_ep_size:
        raise ConfigError(
            f"cluster.trainer_ep_size={c.trainer_ep_size} must divide the {ranks} trainer ranks"
        )
    if cfg.model.path is None and cfg.model.num_experts % c.trainer_ep_size:
        raise ConfigError(
            f"cluster.trainer_ep_size={c.trainer_ep_size} must divide model.num_experts={cfg.model.num_experts}"
        )
    per_node = c.rollout.gpus_per_node // c.rollout_ep_size
    wanted = cfg.fleet.max_workers or cfg.rollout.num_workers
    if wanted > per_node * c.rollout.max_nodes:
        raise ConfigError(
            f"{wanted} rollout workers (fleet.max_workers or rollout.num_workers) need "
            f"{math.ceil(wanted / per_node)} rollout nodes of {per_node} workers; "
            f"cluster.rollout.max_nodes={c.rollout.max_nodes}"
        )


def cluster_run_config(cfg: RunConfig) -> RunConfig:
    """The run config as the cluster runs it: async on the job's Ray cluster (``ray_address: auto``),
    the model on CUDA, the rollout pods' notice file and the instance metadata service (IMDSv2) as
    notice sources, everything else as given.

    Raises:
        ConfigError: see ``_check``.
    """
    _check(cfg)
    data = to_dict(cfg)
    data["runtime"].update(mode="async", ray_address="auto")
    data["model"]["device"] = "cuda"
    data["fleet"]["notice_file"] = NOTICE_FILE
    data["fleet"]["imds_url"] = data["fleet"]["imds_url"] or IMDS_URL
    return from_dict(RunConfig, data)


def namespace(cfg: RunConfig) -> dict:
    """The ``Namespace`` of the run."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cfg.cluster.namespace}}


def run_config_map(cfg: RunConfig) -> dict:
    """The ``ConfigMap`` with the run config (key ``run.yaml``), mounted into the Ray head."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(cfg), "namespace": cfg.cluster.namespace},
        "data": {RUN_CONFIG_KEY: yaml.safe_dump(to_dict(cfg), sort_keys=False)},
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
        atomic_write_text(path, yaml.safe_dump(doc, sort_keys=False, width=110))
        files.append(path)
    return Rendered(tuple(files), tuple(skipped))


def render_main(cfg: RunConfig, out_dir: str) -> int:
    """``moerl cluster render``: render, then print each file written and each manifest skipped."""
    result = render(cfg, out_dir)
    for path in result.files:
        print(path)
    for line in result.skipped:
        print(f"skipped {line}")
    return 0
