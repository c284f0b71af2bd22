"""What the rendered job reads: the run's layout, its config on every pod, GPU instances, a real policy.

- the trainer's and the rollout's layout (``trainer.num_ranks``, ``trainer.ep_size``, ``trainer.gpus_per_node``,
  ``rollout.num_workers``, ``rollout.ep_size``, ``rollout.ep_ranks_per_node``) reach the ConfigMap the job reads, and contradictions are
  one-line errors naming both fields;
- the ConfigMap is mounted on every Ray pod (the driver runs on a train pod);
- GPU groups take only GPU instance types, and ``gpus_per_node`` matches the instance;
- the recipes start from a pretrained model in S3 that the train pods copy (``moerl.cluster.fetch``,
  against a moto S3 server) to the run's ``init_from``.
"""

import base64
import json
import shlex
from pathlib import Path

import pytest
import yaml

from moerl.cluster.fetch import FetchError, fetch_model
from moerl.cluster.fetch import main as fetch_main
from moerl.cluster.kuberay import CONFIG_DIR, MODEL_DIR
from moerl.cluster.render import cluster_run_config, manifests
from moerl.config import ConfigError, load_config
from moerl.instances import GPUS_PER_INSTANCE, is_gpu_instance

IMAGE = "cluster.image=registry.example/moerl:0.1.0"
"""The image a user built and pushed (``moerl cluster render`` refuses without one)."""

ROOT = Path(__file__).resolve().parents[2]
MISSION = ROOT / "configs" / "cluster_mission.yaml"
QWEN = ROOT / "configs" / "cluster_qwen3_30b_1node.yaml"


def _job_config(docs: dict) -> dict:
    return yaml.safe_load(docs["k8s/20-run-config.yaml"]["data"]["run.yaml"])


def _load_job_config(docs: dict, tmp_path: Path):
    """``load_config`` of the ConfigMap's run.yaml, as ``moerl train --config`` loads it on the pod."""
    path = tmp_path / "run.yaml"
    path.write_text(docs["k8s/20-run-config.yaml"]["data"]["run.yaml"])
    return load_config(path)


def _pods(docs: dict):
    spec = docs["k8s/30-rayjob.yaml"]["spec"]["rayClusterSpec"]
    yield "head", spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        yield group["groupName"], group["template"]["spec"]


@pytest.mark.parametrize(
    "recipe, layout",
    [(MISSION, (128, 64, 8, 32, 8)), (QWEN, (8, 8, 8, 4, 2))],
    ids=["mission", "qwen3"],
)
def test_the_job_reads_the_runs_layout(recipe, layout, tmp_path):
    docs, _ = manifests(load_config(recipe, [IMAGE, IMAGE]))
    run = _job_config(docs)
    got = (
        run["trainer"]["num_ranks"],
        run["trainer"]["ep_size"],
        run["trainer"]["gpus_per_node"],
        run["rollout"]["num_workers"],
        run["rollout"]["ep_size"],
    )
    assert got == layout
    # what moerl train reads is a valid run config as it is, rollout EP included
    loaded = _load_job_config(docs, tmp_path)
    assert (loaded.trainer.num_ranks, loaded.rollout.ep_size) == (layout[0], layout[4])
    assert loaded.cluster.rollout.gpus_per_node % loaded.rollout.ep_size == 0
    train = {
        g["groupName"]: g for g in docs["k8s/30-rayjob.yaml"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    }
    assert train["train"]["maxReplicas"] * int(train["train"]["resources"]["train"]) >= layout[0]


@pytest.mark.parametrize(
    "override, match",
    [
        (
            "trainer.gpus_per_node=4",
            r"trainer.gpus_per_node=4 but cluster.train.gpus_per_node=8 \(p5.48xlarge\)",
        ),
        ("trainer.num_ranks=256", r"trainer.num_ranks=256 is more than the train group's 128 GPUs"),
        (
            "trainer.num_ranks=64",
            r"trainer.num_ranks=64 fills 8 of the train group's cluster.train.min_nodes=16",
        ),
        ("init_from=/somewhere/else", r"init_from='/somewhere/else' contradicts cluster.model_url="),
        (
            "rollout.ep_size=16 rollout.ep_ranks_per_node=16",
            r"rollout.ep_ranks_per_node=16 \(rollout.ep_size=16\) must divide cluster.rollout.gpus_per_node=8",
        ),
        (
            "rollout.ep_size=16",  # 32 workers of 2 nodes each on 32 rollout nodes
            r"32 rollout workers .* of 2 node\(s\) each need 64 rollout nodes .* cluster.rollout.max_nodes=32",
        ),
    ],
)
def test_contradicting_layouts_are_one_line_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        cluster_run_config(load_config(MISSION, [IMAGE, *override.split()]))


def test_rollout_ep_groups_span_nodes():
    """Issue 34: rollout.ep_ranks_per_node defaults to the rollout nodes' GPUs, a bigger group spans whole
    nodes, and the job reads the resolved layout."""
    sixteen = [IMAGE, "rollout.ep_size=16", "rollout.num_workers=16", "fleet.max_workers=16"]
    docs, _ = manifests(load_config(MISSION, sixteen))
    run = _job_config(docs)["rollout"]
    assert (run["ep_size"], run["ep_ranks_per_node"]) == (16, 8)  # 2 nodes of 8 ranks
    assert (
        _job_config(manifests(load_config(MISSION, [IMAGE]))[0])["rollout"]["ep_ranks_per_node"] == 8
    )  # one node
    cfg = cluster_run_config(load_config(MISSION, [*sixteen, "rollout.ep_ranks_per_node=4"]))
    assert cfg.rollout.ep_ranks_per_node == 4  # 16 workers of 4 nodes, 2 slices of 4 per node: 32 nodes
    with pytest.raises(ConfigError, match=r"rollout.ep_ranks_per_node=3 does not divide rollout.ep_size=8"):
        load_config(MISSION, ["rollout.ep_ranks_per_node=3"])
    with pytest.raises(
        ConfigError, match=r"rollout.ep_size=12 is not a multiple of cluster.rollout.gpus_per_node=8"
    ):
        load_config(
            QWEN,
            ["rollout.ep_size=12", "model.num_experts=48", "cluster.rollout.instance_types=[p4d.24xlarge]"],
        )


def test_rollout_ep_size_is_the_runs_own():
    cfg = load_config(QWEN, [IMAGE, IMAGE])
    assert cfg.rollout.ep_size == 2 and cluster_run_config(cfg).rollout.ep_size == 2
    # one worker per g6e.12xlarge: the 2 rollout nodes hold 2 workers
    cfg = load_config(QWEN, [IMAGE, "rollout.ep_size=4", "rollout.num_workers=2", "fleet.max_workers=2"])
    docs, _ = manifests(cfg)
    assert _job_config(docs)["rollout"]["ep_size"] == 4
    (rollout,) = [
        g
        for g in docs["k8s/30-rayjob.yaml"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        if g["groupName"] == "rollout"
    ]
    assert rollout["resources"] == {"rollout": "1"}  # 4 GPUs / 4: one worker per node
    with pytest.raises(ConfigError, match=r"rollout.ep_ranks_per_node=8 \(rollout.ep_size=8\) must divide"):
        cluster_run_config(load_config(QWEN, [IMAGE, "rollout.ep_size=8", "rollout.ep_ranks_per_node=8"]))
    # the stand-in is gone: the standard unknown-key error
    with pytest.raises(ConfigError, match="unknown config key .cluster.rollout_ep_size."):
        load_config(QWEN, [IMAGE, "cluster.rollout_ep_size=2"])


@pytest.mark.parametrize("recipe", [MISSION, QWEN], ids=["mission", "qwen3"])
def test_every_pod_mounts_the_run_config(recipe):
    docs, _ = manifests(load_config(recipe, [IMAGE, IMAGE]))
    rayjob = docs["k8s/30-rayjob.yaml"]
    config_path = rayjob["spec"]["entrypoint"].split("--config ")[1].split()[0]
    assert Path(config_path).parent == Path(CONFIG_DIR)
    name = docs["k8s/20-run-config.yaml"]["metadata"]["name"]
    driver_group = next(iter(json.loads(rayjob["spec"]["entrypointResources"])))
    pods = dict(_pods(docs))
    assert driver_group in pods and set(pods) == {"head", "train", "rollout", "cpu", "memory"}
    for group, pod in pods.items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == CONFIG_DIR]
        assert volumes[mount["name"]]["configMap"]["name"] == name, group


@pytest.mark.parametrize(
    "override, match",
    [
        (
            "cluster.train.instance_types=[m7i.8xlarge]",
            r"cluster.train.instance_types: 'm7i.8xlarge' is not a GPU",
        ),
        (
            "cluster.rollout.instance_types=[c7i.48xlarge]",
            r"cluster.rollout.instance_types: 'c7i.48xlarge' is not",
        ),
        ("cluster.rollout.gpus_per_node=8", r"cluster.rollout.gpus_per_node=8 but g6e.12xlarge has 4 GPUs"),
        (
            "cluster.rollout.instance_types=[g6e.12xlarge,g6e.48xlarge]",
            r"g6e.12xlarge has 4, g6e.48xlarge has 8 GPUs; the nodes of one group",
        ),
    ],
)
def test_gpu_groups_take_gpu_instances(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(QWEN, [IMAGE, override])


def test_gpus_per_node_comes_from_the_instance_type():
    cfg = load_config(QWEN, [IMAGE, "cluster.rollout.gpus_per_node=null", "cluster.train.gpus_per_node=null"])
    assert (cfg.cluster.train.gpus_per_node, cfg.cluster.rollout.gpus_per_node) == (8, 4)
    # a size the table does not list: accepted when the group says its GPUs
    cfg = load_config(
        QWEN, [IMAGE, "cluster.rollout.instance_types=[g6e.96xlarge]", "cluster.rollout.gpus_per_node=4"]
    )
    assert cfg.cluster.rollout.gpus_per_node == 4
    with pytest.raises(ConfigError, match=r"GPUs of \['g6e.96xlarge'\] are not known"):
        load_config(
            QWEN,
            [IMAGE, "cluster.rollout.instance_types=[g6e.96xlarge]", "cluster.rollout.gpus_per_node=null"],
        )
    assert all(is_gpu_instance(t) for t in GPUS_PER_INSTANCE) and not is_gpu_instance("r7i.8xlarge")
    assert load_config(QWEN, [IMAGE, IMAGE]).cluster.memory.gpus_per_node == 0  # CPU groups stay CPU groups


@pytest.mark.parametrize("recipe", [MISSION, QWEN], ids=["mission", "qwen3"])
def test_recipes_start_from_a_pretrained_policy(recipe):
    cfg = load_config(recipe, [IMAGE, IMAGE])
    url = cfg.cluster.model_url
    assert url.startswith("s3://") and cfg.init_from is None
    docs, _ = manifests(cfg)
    run = _job_config(docs)
    folder = f"{MODEL_DIR}/{url.rstrip('/').rsplit('/', 1)[-1]}"
    assert run["init_from"] == folder  # RL starts there: no SFT warm start of a random model
    pods = dict(_pods(docs))
    (init,) = pods["train"]["initContainers"]
    assert init["command"][:5] == ["python3", "-m", "moerl.cluster.fetch", url, folder]
    (mount,) = [m for m in pods["train"]["containers"][0]["volumeMounts"] if m["mountPath"] == MODEL_DIR]
    assert {v["name"] for v in pods["train"]["volumes"]} >= {mount["name"]}
    with pytest.raises(ConfigError, match="would train a fresh random model"):
        cluster_run_config(load_config(recipe, [IMAGE, "cluster.model_url=null"]))
    # a model baked into the image: init_from alone is fine, and nothing is copied
    docs, _ = manifests(load_config(recipe, [IMAGE, "cluster.model_url=null", "init_from=/opt/model"]))
    assert _job_config(docs)["init_from"] == "/opt/model"
    assert "initContainers" not in dict(_pods(docs))["train"]


def test_torchx_train_pods_fetch_the_policy_first():
    import torchx  # noqa: F401 - the test extra installs it: missing fails, not skips

    from moerl.cluster.torchx_component import moerl as torchx_app

    app = torchx_app(
        config=str(MISSION), num_rollout_workers=32, checkpoint_dir="s3://b/ckpt", image="r.example/moerl:1"
    )
    (train,) = [r for r in app.roles if r.name == "train"]
    assert train.num_replicas == 16  # trainer.num_ranks 128 / 8 GPUs per node
    script = train.args[-1]
    assert script.startswith("python3 -m moerl.cluster.fetch s3://my-moerl-bucket/models/DeepSeek-V3-bf16 ")
    assert shlex.split(script.split(" && ")[0])[4] == "/models/DeepSeek-V3-bf16"
    run = yaml.safe_load(base64.b64decode(train.env["MOERL_RUN_CONFIG"]))  # what moerl train reads
    assert (run["trainer"]["num_ranks"], run["trainer"]["ep_size"], run["rollout"]["ep_size"]) == (128, 64, 8)
    assert run["init_from"] == "/models/DeepSeek-V3-bf16" and run["rollout"]["num_workers"] == 32


def _folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (root / "model.safetensors").write_bytes(b"\0" * 1000)
    (root / "sub" / "tokenizer.json").write_text("{}")
    return root


def test_fetch_copies_a_whole_folder_or_nothing(tmp_path, monkeypatch):
    src = _folder(tmp_path / "src")
    dest = tmp_path / "models" / "m"
    assert fetch_model(f"file://{src}", dest) == dest
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "config.json",
        "model.safetensors",
        "sub/tokenizer.json",
    ]
    assert (dest / "model.safetensors").read_bytes() == b"\0" * 1000
    (src / "config.json").write_text("changed")
    fetch_model(f"file://{src}", dest)  # a complete copy is kept (a restarted pod)
    assert (dest / "config.json").read_text() == '{"model_type": "qwen3_moe"}'
    with pytest.raises(FetchError, match="no config.json there"):
        fetch_model(f"file://{tmp_path / 'models'}", tmp_path / "x")
    # a download that fails half-way leaves neither the target nor the partial copy
    import fsspec.implementations.local as local

    calls = []

    def failing_get(self, rpath, lpath, **kw):
        calls.append(rpath)
        if len(calls) == 2:
            raise OSError("connection reset")
        return original(self, rpath, lpath, **kw)

    original = local.LocalFileSystem.get_file
    monkeypatch.setattr(local.LocalFileSystem, "get_file", failing_get)
    with pytest.raises(FetchError, match="download failed .*connection reset"):
        fetch_model(f"file://{src}", tmp_path / "models" / "n")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]


def test_the_init_containers_command_copies_from_s3(tmp_path, monkeypatch):
    """The rendered init container's command, run against a moto S3 server on 127.0.0.1."""
    import boto3
    import s3fs  # noqa: F401 - the test extra installs it: missing fails, not skips
    from moto import server as moto_server

    for key, value in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="models")
        src = _folder(tmp_path / "src")
        for path in src.rglob("*"):
            if path.is_file():
                s3.upload_file(str(path), "models", f"qwen/Qwen3-30B-A3B/{path.relative_to(src)}")
        options = json.dumps({"endpoint_url": endpoint})
        cfg = load_config(
            QWEN, [IMAGE, "cluster.model_url=s3://models/qwen/Qwen3-30B-A3B", f"storage.options={options}"]
        )
        docs, _ = manifests(cfg)
        (init,) = dict(_pods(docs))["train"]["initContainers"]
        argv = init["command"][3:]
        argv[1] = str(tmp_path / argv[1].lstrip("/"))  # the pod's /models, here under tmp_path
        assert fetch_main(argv) == 0
        assert (tmp_path / "models" / "Qwen3-30B-A3B" / "sub" / "tokenizer.json").read_text() == "{}"
        assert fetch_main(["s3://models/nothing", str(tmp_path / "y"), "--options", options]) == 1
    finally:
        server.stop()


def _render_argv(text: str, env: dict[str, str]) -> list[str]:
    """The ``moerl cluster render ...`` command in ``text`` (joined over '\\' line ends), $VARs replaced."""
    lines = [ln.strip() for ln in text.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("moerl cluster render --config configs/"))
    command = ""
    for line in lines[start:]:
        command += " " + line.rstrip("\\")
        if not line.endswith("\\"):
            break
    for name, value in env.items():
        command = command.replace(f"${name}", value)
    return shlex.split(command)


@pytest.mark.parametrize("source", ["readme", "help"])
def test_the_documented_render_commands_run(source, tmp_path):
    from moerl.cli import _CLUSTER_RENDER_DESCRIPTION, main

    text = (ROOT / "docs" / "cluster.md").read_text() if source == "readme" else _CLUSTER_RENDER_DESCRIPTION
    argv = _render_argv(text, {"BUCKET": "bkt", "IMAGE": "registry.example/moerl:0.1.0"})  # S3: 3+ chars
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    assert main(argv[1:]) == 0
    docs = {p.name: yaml.safe_load(p.read_text()) for p in (tmp_path / "out").rglob("*.yaml")}
    run = yaml.safe_load(docs["20-run-config.yaml"]["data"]["run.yaml"])
    bucket, model = {"readme": ("bkt", "DeepSeek-V3-bf16"), "help": ("my-bucket", "Qwen3-30B-A3B")}[source]
    assert run["storage"]["url"] == f"s3://{bucket}/runs"
    assert run["cluster"]["model_url"] == f"s3://{bucket}/models/{model}"
    assert run["init_from"] == f"{MODEL_DIR}/{model}"
