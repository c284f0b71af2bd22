"""An EP rollout worker group on Ray (``rollout.ep_size > 1``): the worker actor is EP rank 0 and starts
its ``ep_size - 1`` follower ranks as actors in a placement group.

    RolloutWorkerActor (EP rank 0: leases, delivers, heartbeats -- one worker to the fleet)
      EPRolloutGroup: placement group (the leader's node, or one bundle per node), EPFollowerActor x (ep_size - 1)
      engine = EPGroupEngine over the group (moerl.rollout.ep_group)
      receive_weights(offer) --forwarded--> each follower's BucketAssembler (the same object refs)
    EPFollowerActor (EP rank r): own model copy, experts sharded on joining; EPFollower loop

Placement (``follower_placement``): each follower asks for what the worker actor asks for (1 CPU, 1 GPU
on CUDA, the ``rollout`` custom resource when the cluster defines it). With G = ``rollout.ep_ranks_per_node``
= ``ep_size`` (the default whenever the group fits a node), or on a one-node Ray cluster (a local run: the
group's nodes are simulated there), the bundles carry a sliver of Ray's ``node:<ip>`` resource of the
leader's node, STRICT_PACK: the whole group runs on the node where the fleet placed the leader. With
G < ``ep_size`` on a multi-node cluster the group spans N = ep_size / G nodes: one bundle per node holding
that node's ranks (packed), STRICT_SPREAD over N distinct nodes, the leader node's bundle pinned to it.
Either way rank r is on node r // G of the ``Topology`` its dispatcher uses (``hierarchical`` crosses the
node boundary once per node a token needs). The process group (gloo on
CPU, NCCL on CUDA for the EP exchange, plus a gloo group for the commands) meets at a ``tcp://``
address of the leader's node.

Failures: the followers are owned by the leader actor, so Ray ends them with it (a SIGKILLed or
replaced leader); a follower whose leader or peer is gone fails its collective and ends its own actor.
A follower lost under a running leader fails the leader's next step with ``EPGroupError``: the worker
loop ends as ``crashed`` (its leases released to the queue) and the fleet replaces the whole group.

Weights: a follower receives every bucket its leader is offered (forwarded refs, no copy through the
leader) or, with ``runtime.weight_sync=collective``, is a rank of its worker's weight group itself;
told to switch to version v, it takes v from its receiver, else from the weight store (at start, or
with ``runtime.weight_sync=store``), waiting up to ``weight_wait_s`` for late buckets.
From buckets it reads only its experts' rows (the bucket tensors are zero-copy views of the object
store); a store load reads the whole version once. Either way ``EPEngine.update_weights`` copies only
the local experts into the rank's parameters, so no rank holds the other ranks' experts.

Ray is imported lazily (only async runs use this module).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from moerl.allocator import keep_freed_memory
from moerl.config import RunConfig, rollout_ep_ranks_per_node
from moerl.rollout.ep_engine import EPEngine
from moerl.rollout.ep_group import EPFollower, EPGroupEngine, EPGroupError
from moerl.rundir.storage import is_remote, local_model_folder
from moerl.runtime.build import load_policy, make_engine
from moerl.tasks.tokenizer import load_run_tokenizer
from moerl.weights.buckets import BucketAssembler
from moerl.weights.offer import WeightOffer
from moerl.weights.store import WeightStore

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 600.0
"""Seconds a follower waits for its leader's next command (the leader sends one at least every second
while idle; only a leader blocked elsewhere, e.g. loading a large version from the store, waits long)."""


def _ray():
    import ray  # lazy: Ray is an optional dependency, needed only in async mode

    return ray


def interface_of(ip: str) -> str | None:
    """The name of this host's (this network namespace's) interface holding IPv4 address ``ip``, or None.

    Linux: each interface's address is read with the ``SIOCGIFADDR`` ioctl; elsewhere None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def _gloo_on_node_interface() -> None:
    """Make gloo use the interface of this Ray node's address (``GLOO_SOCKET_IFNAME``, unless set): by
    default gloo takes the address the hostname resolves to, which on a multi-homed host (or a node that
    is a network namespace) need not be the one the other nodes reach."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = interface_of(_ray().util.get_node_ip_address())
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name


def init_group(cfg: RunConfig, rank: int, init_method: str) -> dist.ProcessGroup:
    """Join the group's default process group (EP exchange; timeout ``fleet.heartbeat_timeout_s``) and
    return a gloo group over the same ranks for the commands (timeout ``IDLE_TIMEOUT_S``). Gloo listens on
    the interface of this Ray node's address (``_gloo_on_node_interface``): the group may span nodes."""
    _gloo_on_node_interface()
    is_cuda = cfg.model.device.startswith("cuda")
    dist.init_process_group(
        # on CUDA: NCCL for the expert exchange, gloo for EPEngine's host-side work flags
        "cpu:gloo,cuda:nccl" if is_cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=cfg.rollout.ep_size,
        timeout=datetime.timedelta(seconds=cfg.fleet.heartbeat_timeout_s),
    )
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))


def group_engine(cfg: RunConfig, model: torch.nn.Module) -> EPEngine:
    """This rank's ``EPEngine`` over ``model`` (experts sharded here), at version -1 (no weights yet), on
    the group's node layout (``rollout_ep_ranks_per_node``)."""
    return EPEngine(
        make_engine(model, cfg, version=-1),
        dispatcher=cfg.rollout.ep_dispatcher,
        ranks_per_node=rollout_ep_ranks_per_node(cfg),
    )


class FollowerWeights:
    """A follower's source of policy versions: the buckets its leader forwards, else the store.

    Args:
        assembler: this rank's receiver of the run's weight transport (a ``BucketAssembler`` fed by
            ``receive_weights``, or its own ``CollectiveReceiver``); complete versions are kept until asked for.
        store: the run's weight store.
        weight_wait_s: how long ``load`` waits for a version's last buckets.
    """

    def __init__(self, assembler, store: WeightStore, *, weight_wait_s: float = 60.0) -> None:
        self.assembler = assembler
        self.store = store
        self.weight_wait_s = weight_wait_s
        self._ready: dict[int, Mapping[str, torch.Tensor]] = {}

    def _take_complete(self) -> None:
        found = self.assembler.poll(max(self._ready, default=-1))
        if found is not None:
            self._ready[found[0]] = found[1]
            for old in [v for v in self._ready if v < found[0] - 1]:
                del self._ready[old]  # keep the two newest: the leader may still ask for the older

    def load(self, version: int) -> Mapping[str, torch.Tensor]:
        """The full-model tensors of ``version`` (views of the buckets, or loaded from the store).

        Raises:
            RuntimeError: ``version`` neither arrived in buckets within ``weight_wait_s`` nor is stored.
        """
        deadline = time.monotonic() + self.weight_wait_s
        next_store_check = 0.0
        while True:
            self._take_complete()
            if version in self._ready:
                tensors = self._ready.pop(version)
                for old in [v for v in self._ready if v < version]:
                    del self._ready[old]
                return tensors
            now = time.monotonic()
            if now >= next_store_check:  # a listing: at most once a second
                next_store_check = now + 1.0
                if version in self.store.versions():
                    return self.store.load(version)
            if now > deadline:
                raise RuntimeError(
                    f"EP follower: policy version {version} did not arrive within {self.weight_wait_s:.0f} s "
                    "and is not in the weight store"
                )
            time.sleep(0.01)


class EPFollowerActor:
    """EP rank ``rank`` >= 1 of a rollout group, in its own process (module docstring).

    Args:
        cfg: the run config.
        worker_id: the group's worker id (its leader's).
        rank: this EP rank.
        init_path: HF folder the model is built from, or None.
        store_url: the weight store.
        weights: the worker's ``ReceiverSpec`` (``moerl.weights.transport``), opened here as EP rank
            ``rank``; None: buckets forwarded by the leader only.
    """

    def __init__(
        self, cfg: RunConfig, worker_id: str, rank: int, init_path: str | None, store_url: str, weights=None
    ):
        torch.set_num_threads(int(os.environ.get("MOERL_ACTOR_THREADS", "1")))
        keep_freed_memory()
        torch.manual_seed(cfg.seed)
        init_path = local_model_folder(init_path, cfg.storage.options)
        self.cfg, self.worker_id, self.rank = cfg, worker_id, rank
        self._model = load_policy(cfg, init_path, load_run_tokenizer(cfg, init_path).vocab_size)
        options = cfg.storage.options if is_remote(store_url) else None
        store = WeightStore(store_url, keep=cfg.runtime.keep_versions, storage_options=options)
        device = next(self._model.parameters()).device
        source = (
            BucketAssembler(_ray().get)
            if weights is None
            else weights.open(fallback=None, device=device, rank=rank)
        )
        self.weights = FollowerWeights(source, store)
        self.ep: EPEngine | None = None

    def pid(self) -> int:
        """This rank's process id."""
        return os.getpid()

    def receive_weights(self, offer: WeightOffer) -> None:
        """A bucket forwarded by the leader (``RolloutWorkerActor.receive_weights``)."""
        self.weights.assembler.receive(offer)

    def ep_state(self) -> dict:
        """This rank's engine: ``version``, ``steps`` run, ``expert_bytes`` (its expert parameters) and
        ``param_bytes`` (all its parameters); empty before it joined the group."""
        if self.ep is None:
            return {}
        params = dict(self.ep.engine.model.named_parameters())
        return {
            "version": self.ep.version,
            "expert_bytes": sum(p.numel() * p.element_size() for n, p in params.items() if ".experts." in n),
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        }

    def run(self, init_method: str) -> int:
        """Join the group, shard the experts and follow the leader until it stops the group; returns the
        steps run. On any failure (the leader or a peer gone) this actor ends itself."""
        try:
            ctrl = init_group(self.cfg, self.rank, init_method)
            self.ep = group_engine(self.cfg, self._model)
            self._model = None  # the engine holds the model now, with only the local experts
            return EPFollower(self.ep, ctrl, self.weights.load, idle_timeout_s=IDLE_TIMEOUT_S).run()
        except Exception:  # the leader or a peer is gone, or this rank failed: the group is lost
            log.exception("EP rank %d of %s leaves its group", self.rank, self.worker_id)
            _ray().actor.exit_actor()  # closes this rank's sockets: the leader's step fails at once
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _follower_bundle(cfg: RunConfig) -> dict[str, float]:
    """What each follower asks for: the worker actor's resources (module docstring)."""
    bundle = {"CPU": 1.0}
    if cfg.model.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    if "rollout" in _ray().cluster_resources():
        bundle["rollout"] = 0.001
    return bundle


def follower_placement(
    size: int, per_node: int, bundle: Mapping[str, float], leader_node: str, *, simulated: bool = False
) -> tuple[list[dict[str, float]], str, list[int]]:
    """The placement group of a group's ``size - 1`` followers when G = ``per_node`` ranks share a node.

    One node (G = size, or ``simulated``: the Ray cluster is a single node, so the group's nodes are
    simulated on it): ``size - 1`` bundles of ``bundle`` pinned to ``leader_node`` (a sliver of that
    Ray ``node:<ip>`` resource), STRICT_PACK. Several nodes (N = size / G): one bundle per node,
    STRICT_SPREAD (N distinct nodes): bundle 0 holds the leader node's G - 1 followers (G - 1 times
    ``bundle``, pinned to ``leader_node``), bundle n >= 1 the G followers of node n (G times ``bundle``),
    so each node's ranks are packed in one bundle and the nodes are spread; rank r sits on node r // G.

    Args:
        size: EP ranks of the group (R >= 2).
        per_node: G, dividing ``size``.
        bundle: one rank's resources (``CPU``, ``GPU``, ``rollout``, ...).
        leader_node: the leader's ``node:<ip>`` resource name.
        simulated: place every rank on the leader's node whatever G (a one-node Ray cluster).
    Returns:
        ``(bundles, strategy, bundle index of follower rank 1 .. R-1)``.
    Raises:
        ValueError: ``per_node`` does not divide ``size`` or is not in [1, size].
    """
    if not 1 <= per_node <= size or size % per_node:
        raise ValueError(f"EP ranks per node {per_node} must divide the group's {size} ranks")
    pin = {leader_node: 0.001}
    if per_node == size or simulated:
        return [{**bundle, **pin}] * (size - 1), "STRICT_PACK", list(range(size - 1))
    scaled = [{k: v * n for k, v in bundle.items()} for n in (per_node - 1, per_node)]
    first = {k: v for k, v in scaled[0].items() if v > 0}
    bundles = [{**first, **pin}] + [scaled[1]] * (size // per_node - 1)
    return bundles, "STRICT_SPREAD", [r // per_node for r in range(1, size)]


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{_ray().util.get_node_ip_address()}:{port}"


class EPRolloutGroup:
    """The follower ranks of one EP rollout worker, started from inside its leader actor.

    Args:
        cfg: the run config (``rollout.ep_size``, ``rollout.ep_dispatcher``, ``fleet.heartbeat_timeout_s``).
        worker_id: the leader's worker id; followers are named ``<worker_id>-ep<r>-<leader pid>``.
        init_path, store_url: as ``RolloutWorkerActor``'s.
        weights: the worker's ``ReceiverSpec`` (its followers open it as their ranks), or None.
        place_timeout_s: most seconds to wait for the placement group and the followers' models.

    Raises:
        EPGroupError: the followers cannot be placed or started within ``place_timeout_s``.
    """

    def __init__(
        self,
        cfg: RunConfig,
        worker_id: str,
        init_path: str | None,
        store_url: str,
        *,
        weights=None,
        place_timeout_s: float = 120.0,
    ) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg = cfg
        self._remove_pg = remove_placement_group
        size, per_node = cfg.rollout.ep_size, rollout_ep_ranks_per_node(cfg)
        # Ray's built-in ``node:<ip>`` resource pins the leader node's followers to it; the other nodes'
        # ranks are packed by node and spread over distinct nodes (``follower_placement``); a one-node
        # Ray cluster (a local run) simulates the group's nodes on that node
        bundle = _follower_bundle(cfg)
        simulated = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
        bundles, strategy, self.bundle_of = follower_placement(
            size, per_node, bundle, f"node:{ray.util.get_node_ip_address()}", simulated=simulated
        )
        self.pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=place_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise EPGroupError(
                f"cannot place {size - 1} EP follower ranks of {bundle} each, {per_node} per node on "
                f"{size // per_node} nodes ({strategy}), within {place_timeout_s:.0f} s (cluster: "
                f"{ray.cluster_resources()}); lower rollout.ep_size or rollout.num_workers, or change "
                "rollout.ep_ranks_per_node"
            )
        actor_cls = ray.remote(max_concurrency=4)(EPFollowerActor)  # run + offers + pid at once
        self.actors = [
            actor_cls.options(
                name=f"{worker_id}-ep{r}-{os.getpid()}",
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=self.bundle_of[r - 1]
                ),
            ).remote(cfg, worker_id, r, init_path, store_url, weights)
            for r in range(1, size)
        ]
        self.engine: EPGroupEngine | None = None
        self._runs: list = []
        try:
            self.pids = (
                os.getpid(),
                *ray.get([a.pid.remote() for a in self.actors], timeout=place_timeout_s),
            )
        except Exception as e:
            self.close()
            raise EPGroupError(f"EP follower ranks of {worker_id} did not start: {e}") from e

    def start(self, model: torch.nn.Module) -> EPGroupEngine:
        """Join the group as EP rank 0 with ``model`` (its experts sharded here); the leader's engine."""
        url = _free_address()
        self._runs = [a.run.remote(url) for a in self.actors]
        ctrl = init_group(self.cfg, 0, url)
        self.engine = EPGroupEngine(
            group_engine(self.cfg, model), ctrl, timeout_s=self.cfg.fleet.heartbeat_timeout_s
        )
        return self.engine

    def forward(self, offer: WeightOffer) -> None:
        """Forward a weight offer (a bucket's ref) to every follower (not waited for)."""
        for a in self.actors:
            a.receive_weights.remote(offer)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the followers' loops, end their actors and the placement group, leave the process group."""
        ray = _ray()
        if self.engine is not None:
            self.engine.close(timeout_s)
            if self._runs:
                ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
        for a in self.actors:
            ray.kill(a)
        self._remove_pg(self.pg)
        if dist.is_initialized():
            dist.destroy_process_group()
