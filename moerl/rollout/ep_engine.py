"""An expert-parallel rollout engine: ``rollout.ep_size`` ranks, experts sharded with ``moerl.ep``.

    rank r:  Engine (own slots, own KV cache, own requests)  --  model with ExpertParallelExperts
             step: [admit] -> any rank admitting? -> prefill (or an empty forward) -> sync
                   -> any rank running? -> decode (or an empty forward) -> sync

Attention, the KV cache and sampling are data-parallel: each rank runs its own slots and requests.
The MoE layers exchange tokens with the other ranks (dispatch/combine), so every rank must run the
same number of model forwards in the same order. Each phase of a step therefore starts with one
small ``all_reduce`` of "do I have work in this phase?"; a rank without work joins the phase with a
forward of zero sequences (the zero-token case; ``moerl.models`` runs it, its MoE layers take part
in the exchange with N = 0). The flags are the phase's only extra collective.

Equivalence: a rank's tokens and log-probs are those of a one-rank engine running the same requests
(the expert MLP sees the same rows; only float32 summation order can differ), which
``tests/distributed/test_ep_engine.py`` checks against ``ep_size=1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from moerl.ep.parallelize import ExpertParallelExperts, parallelize
from moerl.ep.topology import Topology
from moerl.ep.traffic import DirectionTraffic, dispatcher_traffic, model_dispatchers
from moerl.rollout.engine import Engine
from moerl.rollout.params import Completion, Request
from moerl.rollout.weight_update import recompute_chunks, reprefill


class EPEngine:
    """``Engine`` over an EP group; the same ``add_request`` / ``step`` / ``update_weights`` seam.

    Args:
        engine: this rank's engine, built on a model with the full (replicated) weights; its experts are
            sharded here by ``moerl.ep.parallelize`` (every rank must pass the same weights).
        group: the EP process group (None: the default group).
        dispatcher: a backend name of ``moerl.ep.DISPATCHERS`` (``alltoall``, ``hierarchical``;
            ``rollout.ep_dispatcher``).
        ranks_per_node: G, EP ranks per node (``rollout.ep_ranks_per_node``): rank r on node r // G
            (simulated nodes when the ranks share a host); None: one node.

    ``step`` and ``generate`` are collective: every rank of the group calls them the same number of
    times (``generate`` runs until no rank has work).
    """

    def __init__(
        self,
        engine: Engine,
        group: dist.ProcessGroup | None = None,
        *,
        dispatcher: str = "alltoall",
        ranks_per_node: int | None = None,
    ) -> None:
        size = dist.get_world_size(group)
        topology = Topology(size, ranks_per_node or size)
        parallelize(engine.model, group, dispatcher=dispatcher, topology=topology)
        self.engine = engine
        self.group = group
        self.rank = dist.get_rank(group)
        self.ep_size = size
        self.dispatchers = model_dispatchers(engine.model)
        # full-model tensor name -> this rank's global expert ids, for update_weights
        self._local_experts = {
            f"{name}.{p}": mod.local_expert_ids
            for name, mod in engine.model.named_modules()
            if isinstance(mod, ExpertParallelExperts)
            for p in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
        }

    @property
    def version(self) -> int:
        """Policy version of the weights (the same on every rank)."""
        return self.engine.version

    @property
    def ep_traffic(self) -> DirectionTraffic | None:
        """Bytes this rank's dispatcher sent since the engine was built, by direction (``moerl.ep.traffic``;
        cumulative; None in a group of one rank)."""
        return dispatcher_traffic(self.dispatchers) if self.ep_size > 1 else None

    @property
    def num_unfinished(self) -> int:
        """This rank's samples waiting or running."""
        return self.engine.num_unfinished

    def add_request(self, request: Request) -> None:
        """Queue a request on this rank (``Engine.add_request``; not collective)."""
        self.engine.add_request(request)

    def running_by_request(self):
        """This rank's running samples by request id."""
        return self.engine.running_by_request()

    def _any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # collective: the phase's work flag
        return bool(t.item())

    def _max(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(
            t, op=dist.ReduceOp.MAX, group=self.group
        )  # collective: the most forwards any rank needs
        return int(t.item())

    def _empty_forward(self) -> None:
        """Join a phase without work: a forward of zero sequences (its MoE layers dispatch N = 0 rows)."""
        e = self.engine
        ids = torch.zeros(0, 1, dtype=torch.int64, device=e.device)
        e.model(ids, None, ids, cache=None)

    @torch.no_grad()
    def step(self) -> list[Completion]:
        """One lockstep engine step over the group (collective); this rank's finished completions."""
        e = self.engine
        done: list[Completion] = []
        admissions = e._admit()
        if self._any(bool(admissions)):
            if admissions:
                e._prefill(admissions)
                e.host.steps += 1
            else:
                self._empty_forward()
        if e._sync_due():
            done += e._sync()
        done += e._reserve_decode()  # paged: blocks for the next tokens (may preempt); no collective
        if self._any(bool(e.scheduler.running)):
            if e.scheduler.running:
                e._decode()
                e.host.steps += 1
                if e._sync_due():
                    done += e._sync()
            else:
                self._empty_forward()
        return done

    @torch.no_grad()
    def recompute_running(self) -> list[Completion]:
        """``rollout.on_weight_update=recompute`` over the group (collective; between steps, after
        ``update_weights``): this rank's running prefixes are prefilled again under the current weights
        (``moerl.rollout.weight_update``) in as many forwards as the rank with the most re-prefill
        chunks needs; a rank with fewer joins the rest with empty forwards.

        Returns:
            This rank's completions finished by the host sync that comes first.
        """
        e = self.engine
        done = e._sync() if e.host else []
        chunks = recompute_chunks(e)
        for i in range(self._max(len(chunks))):
            if i < len(chunks):
                reprefill(e, chunks[i])
            else:
                self._empty_forward()
        return done

    def has_work_anywhere(self) -> bool:
        """True while some rank of the group has unfinished samples (collective)."""
        return self._any(self.engine.num_unfinished > 0)

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Run this rank's ``requests`` (possibly none) to completion with the group (collective);
        completions in request order, then sample index."""
        requests = list(requests)
        for r in requests:
            self.add_request(r)
        by_key = {}
        while self.has_work_anywhere():
            for c in self.step():
                by_key[(c.request_id, c.sample_index)] = c
        return [by_key[(r.request_id, j)] for r in requests for j in range(r.params.n)]

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """``Engine.update_weights`` from full-model tensors: expert tensors [E, ...] are cut to this
        rank's local experts [L, ...] first (each rank receives the full version; not collective)."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        local = [
            (n, t[self._local_experts[n].to(t.device)] if n in self._local_experts else t) for n, t in items
        ]
        self.engine.update_weights(local, version)
