"""TorchX component: submit a moerl run with ``torchx run`` (Kubernetes through Volcano, or any scheduler).

    torchx run -s kubernetes -cfg queue=default moerl/cluster/torchx_component.py:moerl \\
        --config configs/cluster_mission.yaml --num_rollout_workers 32 --checkpoint_dir s3://bucket/checkpoints

The component reads the run config (with its ``cluster:`` section) on the submitting machine and builds
a Ray cluster out of TorchX roles, one per worker group (``moerl.config_cluster``):

- ``train`` (role 0): replica 0 starts the Ray head and runs ``moerl train``, the other replicas join;
  each pod takes a training node's GPUs and EFA interfaces and advertises the ``train`` resource;
- ``train`` has ``ceil(trainer.num_ranks / trainer.gpus_per_node)`` pods; with ``cluster.model_url`` each
  first copies the policy's model folder to ``init_from`` (``moerl.cluster.fetch``);
- ``rollout``: enough pods for ``num_rollout_workers`` (``rollout.ep_size`` GPUs each), ``rollout``;
- ``memory``: one pod for the exchange actor (``exchange``); ``cpu``: ``cpu.min_nodes`` pods (``env``).

Every non-head pod joins the head at ``$VC_TRAIN_0_HOSTS`` (the Volcano host variable of the first role,
TorchX's ``rank0_env`` macro) and blocks; it exits when the head goes away. The run config travels in
the job (``MOERL_RUN_CONFIG``, base64 YAML), so the image needs moerl but not the config file. TorchX's
Kubernetes scheduler sets no tolerations: render the node groups with ``cluster.taint_gpu_nodes: false``
when submitting this way.
"""

import base64
import json
import math
import shlex

import torchx.specs as specs
import yaml

from moerl.cluster.kuberay import fetch_command
from moerl.cluster.render import cluster_run_config, job_run_config, train_nodes
from moerl.cluster.resources import node_resources, run_groups
from moerl.config import RunConfig, load_config
from moerl.config_cluster import NodeGroupConfig

RAY_PORT = 6379
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def _run_overrides(config: str, num_rollout_workers: int, checkpoint_dir: str) -> list[str]:
    """``num_rollout_workers`` workers (the fleet's most, its fewest lowered to it if larger)."""
    fewest = min(load_config(config).fleet.min_workers, num_rollout_workers)
    return [
        f"rollout.num_workers={num_rollout_workers}",
        f"fleet.max_workers={num_rollout_workers}",
        f"fleet.min_workers={fewest}",
        f"storage.url={json.dumps(checkpoint_dir)}",
    ]


def _resource(spec: NodeGroupConfig) -> specs.Resource:
    devices = {"vpc.amazonaws.com/efa": spec.efa_interfaces} if spec.efa_interfaces else {}
    return specs.Resource(
        cpu=spec.cpus_per_node,
        gpu=spec.gpus_per_node,
        memMB=spec.memory_gib * 1024,
        capabilities={INSTANCE_TYPE_LABEL: spec.instance_types[0]},
        devices=devices,
    )


def _ray_start(cfg: RunConfig, group: str, *, head: bool) -> str:
    resources = json.dumps(node_resources(cfg, group))
    if head:
        return f"ray start --head --port={RAY_PORT} --dashboard-host=0.0.0.0 --resources='{resources}'"
    # TorchX replaces ${rank0_env} by the name of the variable that holds the head's host
    return f"ray start --address=$(printenv ${{rank0_env}}):{RAY_PORT} --resources='{resources}' --block"


def _train_script(cfg: RunConfig) -> str:
    fetch = f"{shlex.join(fetch_command(cfg))} && " if cfg.cluster.model_url is not None else ""
    head = (
        f"{_ray_start(cfg, 'train', head=True)} && echo $MOERL_RUN_CONFIG | base64 -d > /tmp/run.yaml && "
        "moerl train --config /tmp/run.yaml"
    )
    join = _ray_start(cfg, "train", head=False)
    return f'{fetch}if [ "${{replica_id}}" = "0" ]; then {head}; else {join}; fi'


def replicas_per_group(cfg: RunConfig) -> dict[str, int]:
    """Pods of each group: the training nodes the trainer ranks fill, the rollout nodes that hold
    ``rollout.num_workers`` workers, one memory pod, ``cpu.min_nodes`` CPU pods, and with
    ``reward.model_path`` the reward nodes that hold ``reward.num_workers`` reward workers.

    Args:
        cfg: the run config as the cluster runs it (``cluster_run_config``).
    """
    c = cfg.cluster
    per_node = c.rollout.gpus_per_node // cfg.rollout.ep_size
    return {
        "train": train_nodes(cfg),
        "rollout": math.ceil(cfg.rollout.num_workers / per_node),
        "cpu": c.cpu.min_nodes,
        "memory": 1,
        "reward": (
            math.ceil(cfg.reward.num_workers / max(1, node_resources(cfg, "reward")["reward"]))
            if cfg.reward.is_enabled
            else 0
        ),
    }


def moerl(
    config: str = "configs/cluster_mission.yaml",
    num_rollout_workers: int = 32,
    checkpoint_dir: str = "s3://my-moerl-bucket/runs",
    image: str = "",
    max_retries: int = 0,
) -> specs.AppDef:
    """A moerl RL run as a TorchX app (see the module docstring).

    Args:
        config: run config YAML with a ``cluster:`` section, read where ``torchx run`` runs.
        num_rollout_workers: rollout workers (``rollout.num_workers`` and ``fleet.max_workers``).
        checkpoint_dir: where the run's checkpoints, weight versions and metrics go (``storage.url``),
            e.g. ``s3://bucket/checkpoints``.
        image: container image with moerl and Ray (it becomes ``cluster.image``); empty: the config's
            ``cluster.image`` (refused when that is unset too: ``moerl.cluster.render.NO_IMAGE``).
        max_retries: TorchX retries of each role.
    """
    # the same checks and cluster settings as ``moerl cluster render`` (async on the job's Ray, CUDA,
    # IMDSv2 notices, S3 storage)
    overrides = _run_overrides(config, num_rollout_workers, checkpoint_dir)
    cfg = cluster_run_config(
        load_config(config, [*overrides, *([f"cluster.image={json.dumps(image)}"] if image else [])])
    )
    run_yaml = yaml.safe_dump(job_run_config(cfg), sort_keys=False)
    env = {"MOERL_RUN_CONFIG": base64.b64encode(run_yaml.encode()).decode(), "AWS_REGION": cfg.cluster.region}
    image = cfg.cluster.image
    roles = []
    counts = replicas_per_group(cfg)
    for group in run_groups(cfg):  # "train" first: its replica 0 is the Ray head (rank0_env)
        if counts[group] == 0:
            continue
        script = _train_script(cfg) if group == "train" else _ray_start(cfg, group, head=False)
        roles.append(
            specs.Role(
                name=group,
                image=image,
                entrypoint="/bin/sh",
                args=["-c", script],
                env=dict(env),
                num_replicas=counts[group],
                resource=_resource(getattr(cfg.cluster, group)),
                max_retries=max_retries,
                port_map={"ray": RAY_PORT} if group == "train" else {},
            )
        )
    return specs.AppDef(name=f"moerl-{cfg.name}", roles=roles)
