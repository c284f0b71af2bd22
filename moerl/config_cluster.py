"""Config of a cluster deployment (``cluster:`` in a run config) and of the run's storage (``storage:``);
re-exported by ``moerl.config``, which composes them into ``RunConfig``.

``moerl cluster render`` turns a run config with a ``cluster:`` section into Kubernetes manifests
(``moerl.cluster.render``): an eksctl ``ClusterConfig`` with one managed node group per worker group,
a KubeRay ``RayJob``, the EFA device plugin, and alert rules. A run without a cluster ignores the section.

Four worker groups, each a managed node group and a KubeRay worker group that advertises one Ray custom
resource (``moerl.cluster.resources``), so an actor that requests it lands only there:

- ``train``: on-demand GPU nodes with EFA for the trainer ranks (FSDP x EP), all in one Availability Zone;
- ``rollout``: GPU nodes on Spot capacity for the rollout workers, scaled between min and max nodes;
- ``cpu``: CPU nodes for environments and preprocessing;
- ``memory``: memory-optimized nodes for the exchange (task queue + experience buffer) and the Ray head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moerl.configlib import ConfigError, check_range
from moerl.instances import GPU_FAMILIES, gpus_of, is_gpu_instance

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a Kubernetes DNS-1123 label


_IMAGE_REFERENCE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?"  # registry host[:port]/ (optional)
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"  # repository path
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"  # :tag, @digest
)
"""A container image reference: the grammar of the OCI distribution spec's ``reference`` (registry,
lowercase path components, tag of up to 128 characters, sha256 digest)."""


def check_image_reference(name: str, value: str) -> None:
    """Raise ``ConfigError`` naming ``name`` unless ``value`` is a container image reference
    (``_IMAGE_REFERENCE``; e.g. ``123456789012.dkr.ecr.us-east-1.amazonaws.com/moerl:0.1.0``): a pod with a malformed image never starts
    (``InvalidImageName``), after the nodes are up."""
    if not value or len(value) > 255 or not _IMAGE_REFERENCE.match(value):
        raise ConfigError(
            f"{name}={value!r} is not a container image reference (registry/path:tag, lowercase path, "
            "no spaces), e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/moerl:0.1.0"
        )


def check_dns_label(name: str, value: str, max_len: int = 63) -> None:
    """Raise ``ConfigError`` unless ``value`` is a DNS-1123 label (lower-case letters, digits, '-')."""
    if not _NAME.match(value) or len(value) > max_len:
        raise ConfigError(
            f"{name}={value!r} must be lower-case letters, digits and '-' (not at either end), "
            f"at most {max_len} characters"
        )


@dataclass(kw_only=True, slots=True)
class NodeGroupConfig:
    """One worker group: an EKS managed node group and the KubeRay worker group on it (one Ray pod per node).

    The per-group classes below only change the defaults; every group has all fields.
    """

    instance_types: tuple[str, ...] = ("m7i.8xlarge",)
    """EC2 instance types of the node group (several diversify Spot capacity)."""
    min_nodes: int = 0
    """Fewest nodes (and Ray worker pods); the Ray autoscaler never goes below."""
    max_nodes: int = 1
    """Most nodes (and Ray worker pods); the Ray autoscaler never goes above."""
    spot: bool = False
    """Spot (preemptible) capacity instead of on-demand."""
    gpus_per_node: int | None = 0
    """GPUs of one node, all requested by its Ray pod (``nvidia.com/gpu``); 0: a CPU group; None: the
    instance type's GPUs (``moerl.instances``; resolved when the config is built)."""
    cpus_per_node: int = 30
    """vCPUs the Ray pod requests (the instance's vCPUs less a few for the kubelet and daemons)."""
    memory_gib: int = 120
    """Memory the Ray pod requests, in GiB (the instance's memory less the system reserve)."""
    efa_interfaces: int = 0
    """EFA network interfaces the Ray pod requests (``vpc.amazonaws.com/efa``); 0: no EFA in this group.
    p5.48xlarge has 32, p5en.48xlarge 16, p6-b200.48xlarge 8."""
    volume_gib: int = 200
    """Root volume of each node, in GiB (image layers, model files, Ray spill)."""
    shm_gib: int = 0
    """Size of the in-memory ``/dev/shm`` volume of the Ray pod, in GiB (NCCL and the object store need
    more than the container default of 64 MiB); 0: none."""

    def check(self, group: str) -> None:
        """Validate the fields; ``group`` names the group in the message.

        Raises:
            ConfigError: an empty instance type list, a bound out of range, min_nodes > max_nodes.
        """
        prefix = f"cluster.{group}"
        if not self.instance_types or not all(self.instance_types):
            raise ConfigError(f"{prefix}.instance_types must name at least one EC2 instance type")
        if self.gpus_per_node is None:
            raise ConfigError(f"{prefix}.gpus_per_node must be set (0 for a CPU group)")
        check_range(f"{prefix}.gpus_per_node", self.gpus_per_node, 0)
        for name in ("min_nodes", "efa_interfaces", "shm_gib"):
            check_range(f"{prefix}.{name}", getattr(self, name), 0)
        for name in ("max_nodes", "cpus_per_node", "memory_gib", "volume_gib"):
            check_range(f"{prefix}.{name}", getattr(self, name), 1)
        if self.min_nodes > self.max_nodes:
            raise ConfigError(
                f"{prefix}.min_nodes={self.min_nodes} is larger than {prefix}.max_nodes={self.max_nodes}"
            )

    def resolve_gpus(self, group: str) -> None:
        """Check a GPU group's instance types against the known GPU families and set ``gpus_per_node``
        to their GPUs when it is None (``moerl.instances``).

        Raises:
            ConfigError: an instance type outside the GPU families, types with different GPU counts,
                ``gpus_per_node`` unlike the instances' GPUs, or None for sizes of unknown GPU count.
        """
        prefix = f"cluster.{group}"
        for itype in self.instance_types:
            if not is_gpu_instance(itype):
                raise ConfigError(
                    f"{prefix}.instance_types: {itype!r} is not a GPU instance type; the {group} group needs "
                    f"GPU nodes (families {', '.join(GPU_FAMILIES)})"
                )
        known = {t: gpus_of(t) for t in self.instance_types if gpus_of(t) is not None}
        if len(set(known.values())) > 1:
            counts = ", ".join(f"{t} has {n}" for t, n in known.items())
            raise ConfigError(
                f"{prefix}.instance_types={list(self.instance_types)}: {counts} GPUs; the nodes of one "
                "group must have the same GPUs"
            )
        if known and self.gpus_per_node is not None and self.gpus_per_node not in known.values():
            itype, count = next(iter(known.items()))
            raise ConfigError(
                f"{prefix}.gpus_per_node={self.gpus_per_node} but {itype} has {count} GPUs; "
                f"set {prefix}.gpus_per_node={count} or leave it unset"
            )
        if self.gpus_per_node is None:
            if not known:
                raise ConfigError(
                    f"{prefix}.gpus_per_node: the GPUs of {list(self.instance_types)} are not known "
                    "(moerl.instances); set it"
                )
            self.gpus_per_node = next(iter(known.values()))


@dataclass(kw_only=True, slots=True)
class TrainGroupConfig(NodeGroupConfig):
    """The ``train`` group: on-demand GPU nodes with EFA (defaults: two p5.48xlarge)."""

    instance_types: tuple[str, ...] = ("p5.48xlarge",)
    min_nodes: int = 2
    max_nodes: int = 2
    gpus_per_node: int | None = None
    cpus_per_node: int = 180
    memory_gib: int = 1800
    efa_interfaces: int = 32
    volume_gib: int = 1000
    shm_gib: int = 256


@dataclass(kw_only=True, slots=True)
class RolloutGroupConfig(NodeGroupConfig):
    """The ``rollout`` group: Spot GPU nodes (defaults: 1 to 4 g6e.48xlarge or p4d.24xlarge, 8 GPUs each)."""

    instance_types: tuple[str, ...] = ("g6e.48xlarge", "p4d.24xlarge")
    min_nodes: int = 1
    max_nodes: int = 4
    spot: bool = True
    gpus_per_node: int | None = None
    cpus_per_node: int = 90
    memory_gib: int = 1000
    volume_gib: int = 500
    shm_gib: int = 64


@dataclass(kw_only=True, slots=True)
class CpuGroupConfig(NodeGroupConfig):
    """The ``cpu`` group: environments and preprocessing (defaults: 0 to 4 m7i.8xlarge)."""

    min_nodes: int = 0
    max_nodes: int = 4


@dataclass(kw_only=True, slots=True)
class MemoryGroupConfig(NodeGroupConfig):
    """The ``memory`` group: the exchange (task queue, experience buffer) and the Ray head
    (defaults: one r7i.8xlarge, 256 GiB)."""

    instance_types: tuple[str, ...] = ("r7i.8xlarge",)
    min_nodes: int = 1
    max_nodes: int = 1
    memory_gib: int = 240


@dataclass(kw_only=True, slots=True)
class RewardGroupConfig(NodeGroupConfig):
    """The ``reward`` group: GPU nodes of the reward workers, rendered only when ``reward.model_path`` is
    set (defaults: 1 to 2 on-demand g6e.12xlarge, 4 L40S GPUs each)."""

    instance_types: tuple[str, ...] = ("g6e.12xlarge",)
    min_nodes: int = 1
    max_nodes: int = 2
    gpus_per_node: int | None = None
    cpus_per_node: int = 44
    memory_gib: int = 360
    volume_gib: int = 300
    shm_gib: int = 16


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Where and how a run is deployed on Amazon EKS through KubeRay (``moerl cluster render``).

    The section describes nodes only. The layout is the run's own (``trainer.num_ranks``,
    ``trainer.ep_size``, ``trainer.gpus_per_node``, ``rollout.num_workers``, ``rollout.ep_size``); the
    render checks that it fits the groups (``moerl.cluster.render``)."""

    name: str = "moerl"
    """EKS cluster name (also the prefix of the RayJob's name)."""
    region: str = "us-east-1"
    """AWS region."""
    availability_zones: tuple[str, ...] = ("us-east-1a", "us-east-1b")
    """Zones of the cluster's control plane (EKS needs two); every node group is in the first one, so
    the training nodes' EFA traffic and the rollout traffic never cross a zone."""
    kubernetes_version: str = "1.33"
    """EKS Kubernetes version."""
    namespace: str = "moerl"
    """Kubernetes namespace of the RayJob and its config."""
    image: str | None = None
    """Container image with moerl and Ray installed: build ``deploy/docker/Dockerfile`` and push it to a
    registry the nodes can pull from (docs/cluster.md, "Run on a cluster"). None: ``moerl cluster render``
    refuses. moerl publishes no image, and a default that names one would render pods that fail to pull
    it only once their GPU nodes are rented."""
    ray_version: str = "2.60.0"
    """Ray version inside ``image`` (KubeRay's ``rayVersion``)."""
    service_account: str = "moerl"
    """Kubernetes service account of the Ray pods; eksctl creates it with an IAM role (IRSA) that may
    read and write the run's S3 storage."""
    s3_policy_arn: str | None = None
    """An extra IAM managed policy ARN attached to ``service_account`` (e.g. KMS for an encrypted
    bucket). None: only the policy the render writes, least privilege: the run's S3 bucket and prefix
    (``moerl.cluster.iam``)."""
    efa_plugin_image: str = (
        "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:v0.5.8"
    )
    """Image of the EFA Kubernetes device plugin DaemonSet."""
    taint_gpu_nodes: bool = True
    """Taint the GPU node groups ``nvidia.com/gpu=true:NoSchedule`` (the RayJob's GPU pods tolerate it);
    False when submitting with TorchX, whose Kubernetes scheduler sets no tolerations."""
    alert_rules: str | None = "deploy/prometheus/rules.yaml"
    """Prometheus rule file (``groups:``) wrapped into a ``PrometheusRule``; skipped when the file is absent;
    None: no PrometheusRule."""
    resume_from: str | None = None
    """URL of a stored run (``s3://bucket/prefix/<name>-<timestamp>``) the RayJob continues with
    ``moerl train --resume``; None: a new run."""
    model_url: str | None = None
    """``s3://`` URL of the Hugging Face model folder (config.json, safetensors, tokenizer) the policy
    starts from. An init container of every train pod copies it to ``/models/<last part of the URL>``
    (``moerl.cluster.fetch``) and the render sets the run's ``init_from`` to that folder. None: the
    run's own ``init_from`` or ``model.path``, a folder inside the image."""
    train: TrainGroupConfig = field(default_factory=TrainGroupConfig)
    """The training node group."""
    rollout: RolloutGroupConfig = field(default_factory=RolloutGroupConfig)
    """The rollout node group (Spot)."""
    cpu: CpuGroupConfig = field(default_factory=CpuGroupConfig)
    """The CPU node group (environments, preprocessing)."""
    memory: MemoryGroupConfig = field(default_factory=MemoryGroupConfig)
    """The memory-optimized node group (exchange actor, Ray head)."""
    reward: RewardGroupConfig = field(default_factory=RewardGroupConfig)
    """The reward workers' GPU node group (only with ``reward.model_path``)."""

    def __post_init__(self) -> None:
        check_dns_label("cluster.name", self.name, 40)
        check_dns_label("cluster.namespace", self.namespace)
        check_dns_label("cluster.service_account", self.service_account)
        if len(self.availability_zones) < 2:
            raise ConfigError(
                f"cluster.availability_zones={list(self.availability_zones)}: EKS needs at least two zones "
                "for its control plane (node groups use the first)"
            )
        for zone in self.availability_zones:
            if not zone.startswith(self.region):
                raise ConfigError(
                    f"cluster.availability_zones: {zone!r} is not in cluster.region={self.region!r}"
                )
        if self.resume_from is not None and not self.resume_from.startswith("s3://"):
            raise ConfigError(f"cluster.resume_from={self.resume_from!r} must be a stored run's s3:// URL")
        for name in ("image", "efa_plugin_image"):
            if getattr(self, name) is not None:
                check_image_reference(f"cluster.{name}", getattr(self, name))
        if self.s3_policy_arn is not None and not self.s3_policy_arn.startswith("arn:aws"):
            raise ConfigError(
                f"cluster.s3_policy_arn={self.s3_policy_arn!r} must be an IAM policy ARN (arn:aws...)"
            )
        if self.s3_policy_arn is not None and self.s3_policy_arn.endswith(":policy/AmazonS3FullAccess"):
            raise ConfigError(
                "cluster.s3_policy_arn=AmazonS3FullAccess grants every bucket of the account; the render "
                "already grants the run's bucket and prefix (leave cluster.s3_policy_arn unset)"
            )
        if self.model_url is not None and not self.model_url.rstrip("/").startswith("s3://"):
            raise ConfigError(f"cluster.model_url={self.model_url!r} must be the s3:// URL of a model folder")
        for group in ("train", "rollout", "reward"):
            getattr(self, group).resolve_gpus(group)
        for group in ("train", "rollout", "cpu", "memory", "reward"):
            getattr(self, group).check(group)
        if self.train.gpus_per_node < 1 or self.rollout.gpus_per_node < 1:
            raise ConfigError("cluster.train.gpus_per_node and cluster.rollout.gpus_per_node must be >= 1")

    @property
    def zone(self) -> str:
        """The Availability Zone of every node group."""
        return self.availability_zones[0]


@dataclass(kw_only=True, slots=True)
class StorageConfig:
    """Where a run's files go: a local folder or an object store (``moerl.rundir.storage``)."""

    url: str | None = None
    """``s3://bucket/prefix`` or a local folder; runs go to ``<url>/<name>-<timestamp>`` (checkpoints,
    published weight versions, the exported policy, ``metrics.jsonl``, ``summary.json``). None:
    ``output_dir`` on the local disk."""
    options: dict | None = None
    """fsspec options of the URL's filesystem, e.g. ``{endpoint_url: http://127.0.0.1:9000,
    client_kwargs: {region_name: us-east-1}, profile: dev}`` for s3fs."""
    retries: int = 3
    """Attempts of each upload before the run stops with one line naming the file."""

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.strip():
            raise ConfigError("storage.url must not be empty (None: the local output_dir)")
        if self.options is not None and not isinstance(self.options, dict):
            raise ConfigError(f"storage.options={self.options!r} must be a mapping of fsspec options")
        check_range("storage.retries", self.retries, 1)
