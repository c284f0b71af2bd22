"""Weight-sync latency: time from the trainer's optimizer step to the engine running the new version.

    python bench/weight_sync.py                                        # CPU, the default run's model
    python bench/weight_sync.py --device cuda --spec reference         # one GPU, the 6.9 B reference model

The trainer is this process (its weights on ``--device``); the engine is another process (``spawn``, no
Ray) with its own copy of the model in a ``moerl.rollout.Engine``, on the same GPU with ``--device cuda``.
One round: every weight changes in place (the optimizer step), the clock starts, the path runs, and the
clock stops when the engine has copied the whole new version into its parameters
(``Engine.update_weights``, the worker's switch between decode steps) and said so. Paths:

- ``store`` (today's serialize-and-load path): ``WeightStore.publish`` (safetensors, sha256, fsspec write
  to a local folder, manifest last), then the engine ``load``s the version (sha256 verified) and copies it
  in. ``--store-rounds`` rounds (one is enough at 13.8 GB).
- ``cuda_ipc`` (``runtime.weight_sync=cuda_ipc``, ``moerl.weights.ipc``): the trainer packs each bucket
  of ``--bucket-mb`` into a ring of 2 device buffers whose CUDA IPC handles the engine mapped once; the
  engine copies each out (device to device), checks its on-device checksum, acknowledges it, and applies
  the version once whole. On CPU the ring is shared memory (the same code).
- ``pinned_host`` (CUDA only): the same protocol through a ring of shared, page-locked host buffers
  (device to host in the trainer, host to device in the engine).
- ``collective`` (``runtime.weight_sync=collective``, ``moerl.weights.collective``): the trainer packs
  each bucket of ``--bucket-mb`` (xxh3) and broadcasts it over the engine's own gloo group (sender +
  engine, rendezvous through a TCPStore); the engine receives on a thread, verifies each bucket and
  applies the version once whole.
- ``packed``, ``buckets`` (where Ray is installed: CPU here; the GPU machine has no Ray): today's whole-model
  ``pack_weights`` + ``ray.put`` offer, and ``runtime.weight_sync=object_store``'s ``BucketPublisher``
  through the object store, to a Ray actor engine.

Floors and checksum costs, measured in this process: one copy of every weight into host memory (pinned
on CUDA), on CUDA one device-to-device copy, xxh3-64 of every weight's bytes on the host (what the
object-store path's checksum costs), and the on-device int64 word sum (``cuda_ipc``'s). The engine's
weights are compared with the trainer's after each path (exact int64 word sums per tensor). Writes
``<out-dir>/weight_sync[_<spec>_<device>].json`` and prints a table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SPECS, device_info, print_table, write_json  # noqa: E402
from bench.weight_sync_engine import RayEngineActor, engine_main, fingerprint, make_model  # noqa: E402
from moerl.config import ModelConfig  # noqa: E402
from moerl.tasks import load_tokenizer  # noqa: E402
from moerl.weights.buckets import BucketPublisher, bucket_bytes_of, iter_packed  # noqa: E402
from moerl.weights.collective import CollectiveAddress, CollectiveSender, CollectiveSpec  # noqa: E402
from moerl.weights.ipc import IpcPublisher, tensors_checksum_no_sync  # noqa: E402
from moerl.weights.store import WeightStore, pack_weights  # noqa: E402

PATHS = ("store", "cuda_ipc", "pinned_host", "collective", "packed", "buckets")
RAY_PATHS = ("packed", "buckets")


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def floors(weights: dict[str, torch.Tensor], device: torch.device, rounds: int) -> dict[str, float]:
    """Median seconds of: one host copy of every weight (pinned on CUDA), one D2D copy (CUDA), xxh3-64
    of every weight's bytes on the host (one thread), the on-device int64 word sum of every weight."""
    on_cuda = device.type == "cuda"
    host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=on_cuda) for n, t in weights.items()}

    def copy_into(dst):
        for n, t in weights.items():
            dst[n].copy_(t, non_blocking=on_cuda)

    out = {("pinned_host_copy" if on_cuda else "host_copy"): _timed(lambda: copy_into(host), device, rounds)}
    raw = [t.reshape(-1).view(torch.uint8).numpy() for t in host.values()]
    out["xxh3_host"] = _timed(lambda: [xxhash.xxh3_64_hexdigest(r) for r in raw], torch.device("cpu"), 1)
    host = raw = None  # freed before the device copy below
    out["int64_sum_on_device"] = _timed(
        lambda: int(tensors_checksum_no_sync(list(weights.values()))), device, rounds
    )
    if on_cuda:
        dev = {n: torch.empty_like(t) for n, t in weights.items()}
        out["device_copy (CUDA IPC floor)"] = _timed(lambda: copy_into(dev), device, rounds)
    return out


class SpawnedEngine:
    """The engine process and the trainer's ends of its connections."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab: int,
        store_dir: str,
        publishers: dict,
        timeout_s: float,
        collective=None,
    ):
        ctx = mp.get_context("spawn")
        self.ctrl, child = ctx.Pipe()
        ends = {}
        for name, pub in publishers.items():
            mine, ends[name] = ctx.Pipe()
            pub.connect(mine)  # the slot handles; the engine maps them on its first poll
        self.proc = ctx.Process(
            target=engine_main, args=(cfg, vocab, store_dir, child, ends, timeout_s, collective), daemon=True
        )
        self.proc.start()
        self.timeout_s = timeout_s
        assert self.ask(None, 900.0) == ("ready",)

    def ask(self, command, timeout_s: float | None = None):
        """Send ``command`` (None: send nothing) and wait for the engine's reply."""
        if command is not None:
            self.ctrl.send(command)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while not self.ctrl.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process died (exit code {self.proc.exitcode}) on {command}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not answer {command}")
        return self.ctrl.recv()

    def close(self) -> None:
        try:
            self.ctrl.send(("close",))
        except OSError:
            pass  # it died
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _ray_engines(cfg: ModelConfig, vocab: int, device: torch.device):
    """A Ray actor engine, or None where Ray is not installed."""
    try:
        import ray  # lazy: optional here (the GPU machine has none)
    except ImportError:
        return None
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    gpus = 0.5 if device.type == "cuda" else 0
    actor = ray.remote(num_cpus=0, num_gpus=gpus, max_concurrency=4)(RayEngineActor).remote(cfg, vocab)
    ray.get(actor.fingerprint.remote())
    return actor


def run(
    spec: str = "default",
    device: str = "cpu",
    *,
    rounds: int = 3,
    store_rounds: int | None = None,
    bucket_mb: float = 256.0,
    paths: tuple[str, ...] = PATHS,
    out_dir: str | None = None,
    timeout_s: float = 600.0,
) -> dict:
    """Time each path (module docstring); returns and writes the result record."""
    cfg, vocab = model_config(spec, device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    paths = tuple(p for p in paths if p != "pinned_host" or dev.type == "cuda")
    torch.manual_seed(0)
    model = make_model(cfg, vocab)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    bucket_bytes = bucket_bytes_of(bucket_mb)
    store_dir = tempfile.mkdtemp(prefix="moerl-weight-sync-")
    store = WeightStore(store_dir, keep=1)
    publishers = {}
    if "cuda_ipc" in paths:
        publishers["cuda_ipc"] = IpcPublisher(weights, bucket_bytes, timeout_s=timeout_s)
    if "pinned_host" in paths:
        publishers["pinned_host"] = IpcPublisher(
            weights, bucket_bytes, timeout_s=timeout_s, slot_device="cpu"
        )
    collective = _collective(timeout_s) if "collective" in paths else None
    engine = SpawnedEngine(cfg, vocab, store_dir, publishers, timeout_s, collective and collective[1])
    if collective is not None:
        publishers_c = collective[0]
        deadline = time.monotonic() + timeout_s
        while not publishers_c.admit() and not publishers_c.groups:  # the engine's group is built
            if time.monotonic() > deadline:
                raise TimeoutError("collective: the engine's weight group was not built")
            time.sleep(0.01)
    actor = _ray_engines(cfg, vocab, dev) if any(p in RAY_PATHS for p in paths) else None
    paths = tuple(p for p in paths if p not in RAY_PATHS or actor is not None)
    results: dict[str, dict] = {}
    name = "weight_sync" if spec == "default" and device == "cpu" else f"weight_sync_{spec}_{dev.type}"
    head = {
        "benchmark": "weight_sync",
        "spec": spec,
        "device": device_info(dev),
        "engine": "separate process (spawn)" + (", Ray actor for packed/buckets" if actor else ""),
        "rounds": rounds,
        "store_rounds": store_rounds or rounds,
        "bucket_mb": bucket_mb,
        "weight_bytes": nbytes,
        "num_tensors": len(weights),
    }
    version = 0
    senders = {**publishers, "collective": collective[0]} if collective is not None else publishers
    sync_args = (store, senders, engine, actor, bucket_bytes)
    for path in paths:
        try:
            results[path] = _time_path(path, version, rounds, store_rounds, weights, dev, sync_args)
        except Exception as e:  # one broken path must not lose the others' numbers
            results[path] = {"error": f"{type(e).__name__}: {e}"}
        version += max(rounds, store_rounds or rounds)
        print(f"{path}: {results[path].get('median_s', results[path].get('error'))}", flush=True)
        write_json(name, {**head, "results": results, "partial": True}, out_dir)  # kept if a later path dies
    engine.close()
    for pub in publishers.values():
        pub.engines = []
    if collective is not None:
        collective[0].close()
    payload = {**head, "results": results, "floors_s": floors(weights, dev, rounds)}
    write_json(name, payload, out_dir)
    _print(payload)
    return payload


def _time_path(path, version, rounds, store_rounds, weights, dev, sync_args) -> dict:
    """``rounds`` (``store_rounds`` for the store) of: the optimizer step, then ``path`` to the engine."""
    times, receives, copies = [], [], []
    for _ in range((store_rounds or rounds) if path == "store" else rounds):
        with torch.no_grad():  # the optimizer step: every weight changes in place
            for t in weights.values():
                if t.is_floating_point():
                    t.add_(1e-3)
        version += 1
        _sync(dev)
        t0 = time.perf_counter()
        receive, copy = _sync_once(path, version, weights, *sync_args)
        times.append(time.perf_counter() - t0)
        receives.append(receive)
        copies.append(copy)
    store, publishers, engine, actor, _ = sync_args
    out = {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "engine_receive_s": statistics.median(r for r in receives if r is not None)
        if any(r is not None for r in receives)
        else None,
        "engine_copy_s": statistics.median(copies),
        "rounds_s": times,
        "weights_match": _engine_fingerprint(path, engine, actor) == fingerprint(weights),
    }
    if path in publishers and path != "collective":
        out["num_buckets"] = len(publishers[path].plan)
        out["slots_pinned"] = publishers[path].is_pinned
    return out


def _sync_once(path, version, weights, store, publishers, engine, actor, bucket_bytes):
    """Run ``path`` once for ``version``; (engine receive seconds or None, engine copy seconds)."""
    if path == "store":
        store.publish(version, weights)
        _, receive, copy = engine.ask(("store", version))
        return receive, copy
    if path == "collective":  # pack + xxh3 + broadcast each bucket; the engine verifies and applies
        engine.ctrl.send(("wait", path, version))
        for bucket in iter_packed(version, weights, bucket_bytes, reuse=True):
            publishers[path].send(bucket)
        _, receive, copy = engine.ask(None)
        return receive, copy
    if path in publishers:
        engine.ctrl.send(("wait", path, version))
        publishers[path].publish(version, weights)  # returns once the last bucket is sent
        _, receive, copy = engine.ask(None)
        return receive, copy
    import ray  # lazy: the Ray paths run only where Ray is installed

    if path == "packed":
        ref = ray.put(pack_weights(weights))
        return None, ray.get(actor.apply_packed.remote(version, [ref]))
    wait = actor.wait_buckets.remote(version)
    publisher = BucketPublisher(bucket_bytes, ray.put, ray.get)
    publisher.publish(version, weights, [lambda offer: actor.receive_weights.remote(offer)])
    return None, ray.get(wait)


def _collective(timeout_s: float) -> tuple[CollectiveSender, CollectiveSpec, object]:
    """A rendezvous store on loopback, the trainer's sender, and the engine's group spec."""
    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = CollectiveAddress("127.0.0.1", master.port, timeout_s)
    return CollectiveSender(address, admit_every_s=0), CollectiveSpec(address).for_worker(1), master


def _engine_fingerprint(path: str, engine: SpawnedEngine, actor) -> dict[str, int]:
    if path in RAY_PATHS:
        import ray  # lazy, as above

        return ray.get(actor.fingerprint.remote())
    return engine.ask(("fingerprint",))[1]


def _print(p: dict) -> None:
    gb = p["weight_bytes"] / 1e9
    rows = [
        [path, r["median_s"], r["min_s"], r["engine_copy_s"], gb / r["median_s"], r["weights_match"]]
        if "error" not in r
        else [path, r["error"][:60], None, None, None, None]
        for path, r in p["results"].items()
    ]
    rows += [[f"floor: {name}", s, None, None, gb / s, None] for name, s in p["floors_s"].items()]
    title = (
        f"weight sync, {p['spec']} ({gb:.3g} GB, {p['num_tensors']} tensors), {p['engine']}, "
        f"{p['device'].get('device', 'cpu')}, {p['bucket_mb']} MiB buckets: optimizer step -> the engine on "
        "the new version"
    )
    print_table(title, ["path", "median s", "min s", "engine copy s", "GB/s", "weights ok"], rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="default", choices=["default", *SPECS])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--store-rounds", type=int, default=None, help="rounds of the store path (default --rounds)"
    )
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    paths = tuple(a.paths.split(","))
    if bad := [x for x in paths if x not in PATHS]:
        ap.error(f"--paths: unknown {bad}; choose from {PATHS}")
    if a.rounds < 1 or a.bucket_mb <= 0 or (a.store_rounds is not None and a.store_rounds < 1):
        ap.error("--rounds and --store-rounds must be >= 1 and --bucket-mb > 0")
    return run(
        a.spec,
        a.device,
        rounds=a.rounds,
        store_rounds=a.store_rounds,
        bucket_mb=a.bucket_mb,
        paths=paths,
        out_dir=a.out_dir,
        timeout_s=a.timeout_s,
    )


if __name__ == "__main__":
    main()
