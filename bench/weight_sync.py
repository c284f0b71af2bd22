"""Weight-sync latency: time from the trainer's optimizer step to every engine running the new version.

    python bench/weight_sync.py                                        # CPU, the default run's model
    python bench/weight_sync.py --device cuda --spec reference         # one GPU, the 6.9 B reference model

The trainer is this process (its weights on ``--device``); each engine (``--engines``, default 1) is a Ray
actor process with its own copy of the model in a ``moerl.rollout.Engine`` (on the same GPU with
``--device cuda``). One round: the weights change in place (the optimizer step), the clock starts, the
path runs, and the clock stops when every engine has copied the whole new version into its parameters
(``Engine.update_weights``, the worker's switch between decode steps). Paths, each ``--rounds`` times:

- ``store`` (today's serialize-and-load path): ``WeightStore.publish`` (safetensors, sha256, fsspec
  write to a local folder, manifest last), then each engine ``load``s the version (sha256 verified).
- ``packed`` (today's object-store offer): ``pack_weights`` of the whole model, ``ray.put``, each engine
  ``ray.get`` + ``unpack_weights``.
- ``buckets`` (``runtime.weight_sync=object_store``): ``BucketPublisher`` streams buckets of
  ``--bucket-mb`` (xxh3 per bucket) through the object store; each engine's ``BucketAssembler`` fetches
  them on its thread and the version is applied once whole.

Floors, measured in this process: one copy of every weight into host memory (pinned on CUDA: the
pinned-host path), and on CUDA one device-to-device copy (what CUDA IPC between two processes on one
GPU would cost). Writes ``<out-dir>/weight_sync[_<spec>_<device>].json`` and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SPECS, device_info, print_table, write_json  # noqa: E402
from moerl.config import ModelConfig  # noqa: E402
from moerl.models import build_model  # noqa: E402
from moerl.rollout import Engine  # noqa: E402
from moerl.runtime.weight_sync import BucketAssembler, BucketPublisher, bucket_bytes_of  # noqa: E402
from moerl.runtime.weights import WeightStore, pack_weights, unpack_weights  # noqa: E402
from moerl.tasks import load_tokenizer  # noqa: E402

PATHS = ("store", "packed", "buckets")


def model_config(spec: str, device: str) -> tuple[ModelConfig, int]:
    """The run's default ``ModelConfig`` (float32, the built-in tokenizer) or a ``SPECS`` shape in bf16."""
    if spec == "default":
        return ModelConfig(device=device), load_tokenizer(None).vocab_size
    s = SPECS[spec]
    cfg = ModelConfig(
        hidden_size=s.hidden_size,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
        num_kv_heads=s.num_heads,
        head_dim=s.head_dim,
        num_experts=s.num_experts,
        top_k=s.top_k,
        moe_intermediate_size=s.moe_intermediate_size,
        max_position_embeddings=s.max_position_embeddings,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        device=device,
    )
    return cfg, s.vocab_size


def make_model(cfg: ModelConfig, vocab: int) -> torch.nn.Module:
    """The model with N(0, 0.02) weights drawn on its device (no host-side init for the large specs)."""
    meta = ModelConfig(**{**_fields(cfg), "device": "meta"})
    with torch.device("meta"):
        model = build_model(meta, vocab)
    model = model.to_empty(device=cfg.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for b in model.buffers():
            b.zero_()
    return model


def _fields(cfg: ModelConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


class EngineActor:
    """One rollout engine in its own process; receives versions by each of the three paths."""

    def __init__(self, cfg: ModelConfig, vocab: int, store_url: str):
        import ray  # lazy: only the bench's actor processes need it here

        torch.manual_seed(1)
        self.engine = Engine(make_model(cfg, vocab), max_slots=1, kv_token_budget=64, cuda_graphs=False)
        self.store = WeightStore(store_url, keep=1)
        self.buckets = BucketAssembler(ray.get, None)

    def apply_store(self, version: int) -> float:
        """Load ``version`` from the store (checksums verified) into the engine; returns the copy seconds."""
        tensors = self.store.load(version)
        return self._apply(version, tensors)

    def apply_packed(self, version: int, refs: list) -> float:
        """Fetch and unpack a whole ``PackedWeights`` object; apply it."""
        import ray  # lazy, as above

        return self._apply(version, unpack_weights(ray.get(refs[0])))

    def offer_bucket(self, version: int, index: int, num_buckets: int, refs: list) -> None:
        """A bucket of ``version`` (fetched on the assembler's thread)."""
        self.buckets.offer(version, index, num_buckets, refs[0])

    def wait_buckets(self, version: int, timeout_s: float = 600.0) -> float:
        """Poll like a worker between decode steps until ``version`` is whole; apply it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.buckets.poll(self.engine.version)
            if found is not None and found[0] == version:
                return self._apply(found[0], found[1])
            time.sleep(0.0005)
        raise TimeoutError(f"version {version} did not arrive in {timeout_s} s")

    def _apply(self, version: int, tensors) -> float:
        t0 = time.perf_counter()
        self.engine.update_weights(tensors, version)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def checksum(self) -> float:
        """Sum of every floating tensor of the state dict (the bench checks that each path delivered the
        trainer's weights)."""
        return _checksum(self.engine.model.state_dict())


def _checksum(tensors) -> float:
    return float(sum(t.detach().double().sum() for t in tensors.values() if t.is_floating_point()))


def floors(weights: dict[str, torch.Tensor], device: torch.device, rounds: int) -> dict[str, float]:
    """Median seconds of one host copy of every weight (pinned on CUDA) and, on CUDA, one D2D copy."""
    on_cuda = device.type == "cuda"
    host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=on_cuda) for n, t in weights.items()}
    out = {}

    def timed(dst) -> float:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for n, t in weights.items():
                dst[n].copy_(t, non_blocking=on_cuda)
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out["pinned_host_copy" if on_cuda else "host_copy"] = timed(host)
    del host
    if on_cuda:
        dev = {n: torch.empty_like(t) for n, t in weights.items()}
        out["device_copy (CUDA IPC floor)"] = timed(dev)
    return out


def run(
    spec: str = "default",
    device: str = "cpu",
    *,
    engines: int = 1,
    rounds: int = 3,
    bucket_mb: float = 256.0,
    paths: tuple[str, ...] = PATHS,
    out_dir: str | None = None,
) -> dict:
    """Time each path ``rounds`` times (module docstring); returns and writes the result record."""
    import ray  # lazy: Ray is started only when the bench runs

    cfg, vocab = model_config(spec, device)
    dev = torch.device(device)
    torch.manual_seed(0)
    model = make_model(cfg, vocab)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    store_dir = tempfile.mkdtemp(prefix="moerl-weight-sync-")
    store = WeightStore(store_dir, keep=1)
    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=max(2, engines + 1), include_dashboard=False, configure_logging=False
        )
    gpus = 1 / (engines + 1) if dev.type == "cuda" else 0
    actor_cls = ray.remote(num_cpus=0, num_gpus=gpus, max_concurrency=4)(EngineActor)
    actors = [actor_cls.remote(cfg, vocab, store_dir) for _ in range(engines)]
    ray.get([a.checksum.remote() for a in actors])  # started and built
    publisher = BucketPublisher(bucket_bytes_of(bucket_mb), ray.put, ray.get)

    def sync(path: str, version: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        if path == "store":
            store.publish(version, weights)
            load_s = ray.get([a.apply_store.remote(version) for a in actors])
        elif path == "packed":
            ref = ray.put(pack_weights(weights))
            load_s = ray.get([a.apply_packed.remote(version, [ref]) for a in actors])
            del ref
        else:
            waits = [a.wait_buckets.remote(version) for a in actors]
            offers = [lambda v, i, n, r, a=a: a.offer_bucket.remote(v, i, n, [r]) for a in actors]
            publisher.publish(version, weights, offers)
            load_s = ray.get(waits)
        return time.perf_counter() - t0, max(load_s)

    results: dict[str, dict] = {}
    version = 0
    for path in paths:
        times, loads = [], []
        for _ in range(rounds):
            with torch.no_grad():  # the optimizer step: every weight changes in place
                for t in weights.values():
                    if t.is_floating_point():
                        t.add_(1e-3)
            version += 1
            total, load = sync(path, version)
            times.append(total)
            loads.append(load)
        want = _checksum(weights)
        got = ray.get([a.checksum.remote() for a in actors])
        results[path] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "engine_copy_s": statistics.median(loads),
            "rounds_s": times,
            "weights_match": all(abs(g - want) <= 1e-6 * max(1.0, abs(want)) for g in got),
        }
    payload = {
        "benchmark": "weight_sync",
        "spec": spec,
        "device": device_info(dev),
        "engines": engines,
        "rounds": rounds,
        "bucket_mb": bucket_mb,
        "weight_bytes": nbytes,
        "num_tensors": len(weights),
        "results": results,
        "floors_s": floors(weights, dev, rounds),
    }
    for a in actors:
        ray.kill(a)
    name = "weight_sync" if spec == "default" and device == "cpu" else f"weight_sync_{spec}_{dev.type}"
    write_json(name, payload, out_dir)
    _print(payload)
    return payload


def _print(p: dict) -> None:
    gb = p["weight_bytes"] / 1e9
    rows = [
        [path, r["median_s"], r["min_s"], r["engine_copy_s"], gb / r["median_s"], r["weights_match"]]
        for path, r in p["results"].items()
    ]
    rows += [[f"floor: {name}", s, None, None, gb / s, None] for name, s in p["floors_s"].items()]
    title = (
        f"weight sync, {p['spec']} ({gb:.3g} GB, {p['num_tensors']} tensors), {p['engines']} engine(s), "
        f"{p['device'].get('name', 'cpu')}, median of {p['rounds']}: optimizer step -> every engine on the "
        "new version"
    )
    print_table(title, ["path", "median s", "min s", "engine copy s", "GB/s", "weights ok"], rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="default", choices=["default", *SPECS])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    paths = tuple(a.paths.split(","))
    if bad := [x for x in paths if x not in PATHS]:
        ap.error(f"--paths: unknown {bad}; choose from {PATHS}")
    if a.engines < 1 or a.rounds < 1 or a.bucket_mb <= 0:
        ap.error("--engines and --rounds must be >= 1 and --bucket-mb > 0")
    return run(
        a.spec,
        a.device,
        engines=a.engines,
        rounds=a.rounds,
        bucket_mb=a.bucket_mb,
        paths=paths,
        out_dir=a.out_dir,
    )


if __name__ == "__main__":
    main()
