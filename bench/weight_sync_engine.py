"""The engine side of ``bench/weight_sync.py``: a rollout engine in its own process (spawned, no Ray), and
the Ray actor of the object-store paths (CPU, or wherever Ray is installed)."""

from __future__ import annotations

import time

import torch

from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.rollout import Engine
from moerl.weights.buckets import BucketAssembler
from moerl.weights.ipc import IpcReceiver, tensors_checksum_no_sync
from moerl.weights.store import WeightStore, unpack_weights


def make_model(cfg: ModelConfig, vocab: int) -> torch.nn.Module:
    """The model with N(0, 0.02) weights drawn on its device (no host-side init for the large specs)."""
    meta = ModelConfig(**{**{n: getattr(cfg, n) for n in cfg.__dataclass_fields__}, "device": "meta"})
    with torch.device("meta"):
        model = build_model(meta, vocab)
    model = model.to_empty(device=cfg.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for b in model.buffers():
            b.zero_()
    return model


def fingerprint(tensors) -> dict[str, int]:
    """name -> wrapping int64 word sum of the tensor's bytes (exact: equal bytes give equal sums)."""
    return {n: int(tensors_checksum_no_sync([t])) for n, t in tensors.items()}


def _engine(cfg: ModelConfig, vocab: int) -> Engine:
    torch.manual_seed(1)  # other weights than the trainer's: a path that delivers nothing is seen
    return Engine(make_model(cfg, vocab), max_slots=1, kv_token_budget=64, cuda_graphs=False)


def _apply(engine: Engine, version: int, tensors) -> float:
    """``Engine.update_weights`` (the worker's switch between decode steps); its seconds, synchronized."""
    t0 = time.perf_counter()
    engine.update_weights(tensors, version)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def engine_main(
    cfg: ModelConfig, vocab: int, store_url: str, ctrl, ipc: dict, timeout_s: float, collective=None
) -> None:
    """Entry of the engine process. ``ctrl`` answers the trainer's commands; ``ipc``: path name -> the
    engine's end of that path's ``IpcPublisher`` connection; ``collective``: the ``CollectiveSpec`` of
    this engine's weight group (``runtime.weight_sync=collective``), or None.

    Commands: ``("store", v)``: load version v from the store and apply it; ``("wait", path, v)``: poll
    that path like a worker between decode steps until v has arrived whole, then apply it;
    ``("fingerprint",)``; ``("close",)``. Replies ``("done", receive_s, copy_s)``.
    """
    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    if torch.device(cfg.device).index is not None:
        torch.cuda.set_device(torch.device(cfg.device))
    engine = _engine(cfg, vocab)
    store = WeightStore(store_url, keep=1)
    receivers = {name: IpcReceiver(conn, engine.device, timeout_s=timeout_s) for name, conn in ipc.items()}
    if collective is not None:  # receives on its own thread, like a rollout worker's
        receivers["collective"] = collective.open(fallback=None, device=engine.device)
    ctrl.send(("ready",))
    while True:
        command = ctrl.recv()
        if command[0] == "close":
            return
        if command[0] == "fingerprint":
            ctrl.send(("fingerprint", fingerprint(engine.model.state_dict())))
        elif command[0] == "store":
            t0 = time.perf_counter()
            tensors = store.load(command[1])
            ctrl.send(("done", time.perf_counter() - t0, _apply(engine, command[1], tensors)))
        else:
            _, path, version = command
            deadline = time.monotonic() + timeout_s
            while (got := receivers[path].poll(engine.version)) is None or got[0] != version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path}: version {version} did not arrive in {timeout_s} s")
                time.sleep(0.0002)
            ctrl.send(("done", receivers[path].stats.last_sync_s, _apply(engine, version, got[1])))


class RayEngineActor:
    """One engine as a Ray actor, for the object-store paths (``packed``, ``buckets``)."""

    def __init__(self, cfg: ModelConfig, vocab: int):
        import ray  # lazy: only the Ray paths need it

        self.engine = _engine(cfg, vocab)
        self.buckets = BucketAssembler(ray.get, None)

    def apply_packed(self, version: int, refs: list) -> float:
        """Fetch and unpack a whole ``PackedWeights`` object; apply it."""
        import ray  # lazy, as above

        return _apply(self.engine, version, unpack_weights(ray.get(refs[0])))

    def receive_weights(self, offer) -> None:
        """A bucket (``WeightOffer``) of a version, fetched on the assembler's thread, as a worker takes it."""
        self.buckets.receive(offer)

    def wait_buckets(self, version: int, timeout_s: float = 600.0) -> float:
        """Poll like a worker between decode steps until ``version`` is whole; apply it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.buckets.poll(self.engine.version)
            if found is not None and found[0] == version:
                return _apply(self.engine, found[0], found[1])
            time.sleep(0.0005)
        raise TimeoutError(f"version {version} did not arrive in {timeout_s} s")

    def fingerprint(self) -> dict[str, int]:
        """``fingerprint`` of the engine's state dict."""
        return fingerprint(self.engine.model.state_dict())
