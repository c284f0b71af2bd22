"""EP bytes and messages per link class: exact for a given routing, expected for a routing distribution.

Shape legend: R EP ranks, N nodes, G ranks per node, T tokens per rank, k top-k, E routed experts,
Gr router groups (group-limited routing), M groups kept per token.

``exact_traffic`` lays out every rank's routing with ``moerl.ep.layout.compute_layout`` (the code the
dispatchers run) and counts what each dispatcher sends with ``send_traffic``, so its Traffic equals the
dispatchers' own counters (``tests/distributed/test_plan_traffic.py`` runs them and compares). Rows as the
dispatchers pack them: flat dispatch H_b + w_b (hidden bytes, one float32 weight), hierarchical dispatch
H_b + 4 k + w_b k (hidden, int32 ids, float32 weights), combine H_b (outputs in their dtype).

``expected_traffic`` is the closed form for large R under group-limited routing (DeepSeek-V3,
arXiv:2412.19437 sec. 2.1.2: a token keeps the M best of Gr expert groups, then its top-k among them),
modelled as M groups uniformly at random and k distinct experts uniformly inside them. For a set S of
experts (a rank's or a node's), P(token misses S) = sum_c P(c of S in the kept groups)
C(M g - c, k) / C(M g, k), g = E / Gr; the distribution of c is counted exactly by a dynamic program over
the groups. Rows a rank sends to rank d: T k / R (flat; every expert has marginal k / E);
stage 1 to node n: T P(needs n); stage 2 from forwarder (n, g) to rank d of its node: N T P(needs d)
(its rail's N sources); a message is sent when at least one row is: 1 - P(miss)^T.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import torch

from moerl.ep.layout import Traffic, compute_layout, copies_per_rank, rows_in_ranks, send_traffic
from moerl.ep.placement import ExpertPlacement
from moerl.ep.topology import Topology

PHASES = ("flat_dispatch", "flat_combine", "hier_dispatch", "hier_combine")


@dataclass(frozen=True, slots=True)
class RowBytes:
    """Bytes per row the dispatchers pack (module docstring)."""

    hidden: int
    """H_b = H * bytes per element of x (and of the combine input y)."""
    top_k: int
    weight: int = 4
    """Router weight bytes on the wire (float32 for bf16/fp32 weights: ``accumulation_dtype``)."""

    @property
    def flat_dispatch(self) -> int:
        """Flat all-to-all dispatch row: hidden + one weight."""
        return self.hidden + self.weight

    @property
    def hier_dispatch(self) -> int:
        """Hierarchical dispatch row (both stages): hidden + k int32 ids + k weights."""
        return self.hidden + 4 * self.top_k + self.weight * self.top_k

    @property
    def combine(self) -> int:
        """Combine row (both dispatchers): the expert output or partial sum, hidden bytes."""
        return self.hidden


def exact_traffic(
    topk_per_rank: list[torch.Tensor], placement: ExpertPlacement, rows: RowBytes
) -> dict[str, list[Traffic]]:
    """Traffic each EP rank sends in one dispatch and one combine of each dispatcher (forward only).

    Args:
        topk_per_rank: R tensors [T_r, k] int64 expert ids (-1 = empty slot), rank r's routing.
        placement: the expert placement (its topology gives R, N, G).
        rows: row sizes.
    Returns:
        ``{phase: [Traffic of rank 0 .. R-1]}`` for the four ``PHASES``.
    """
    topo = placement.topology
    r, g = topo.world_size, topo.ranks_per_node
    layouts = [compute_layout(idx, placement) for idx in topk_per_rank]
    copies = torch.stack([copies_per_rank(lay, r) for lay in layouts])  # [src, dst]
    per_node = torch.stack([lay.tokens_per_node for lay in layouts])  # [src, node]
    fwd = _forwarded_rows(layouts, topo)
    out: dict[str, list[Traffic]] = {p: [] for p in PHASES}
    for me in range(r):
        node, li = topo.node_of(me), topo.local_index(me)
        rail, local = topo.rail_ranks(li), topo.node_ranks(node)
        out["flat_dispatch"].append(
            send_traffic(topo, me, list(range(r)), copies[me].tolist(), rows.flat_dispatch)
        )
        out["flat_combine"].append(
            send_traffic(topo, me, list(range(r)), copies[:, me].tolist(), rows.combine)
        )
        stage1 = send_traffic(topo, me, rail, per_node[me].tolist(), rows.hier_dispatch)
        stage2 = send_traffic(topo, me, local, fwd[li][node], rows.hier_dispatch)
        out["hier_dispatch"].append(stage1 + stage2)
        back2 = send_traffic(topo, me, local, [fwd[gf][node][li] for gf in range(g)], rows.combine)
        back1 = send_traffic(topo, me, rail, per_node[rail, node].tolist(), rows.combine)
        out["hier_combine"].append(back1 + back2)
    return out


def _forwarded_rows(layouts: list, topo: Topology) -> list[list[list[int]]]:
    """fwd[li][n][g]: rows forwarder (n, li) sends in stage 2 to the rank with local index g of node n
    (the rows its rail's sources sent it that need that rank; self included)."""
    g = topo.ranks_per_node
    out = []
    for li in range(g):
        per_node = []
        for n in range(topo.num_nodes):
            ranks = [layouts[s].topk_rank[layouts[s].is_token_in_node[:, n]] for s in topo.rail_ranks(li)]
            per_node.append(rows_in_ranks(torch.cat(ranks), g, first_rank=n * g).sum(0).tolist())
        out.append(per_node)
    return out


def sample_group_limited_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """[T, k] int64 expert ids: M = ``topk_groups`` of the Gr contiguous id groups uniformly at random, then k
    distinct experts uniformly among their experts. Gr = M = 1 gives uniform top-k over all E.

    Raises:
        ValueError: E not a multiple of Gr, M not in [1, Gr], or k > M E / Gr.
    """
    if num_experts % num_groups or not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"need E % Gr == 0 and 1 <= M <= Gr; got E={num_experts}, Gr={num_groups}, M={topk_groups}"
        )
    per = num_experts // num_groups
    if not 1 <= top_k <= topk_groups * per:
        raise ValueError(f"top_k={top_k} must be in [1, {topk_groups * per}]")
    pick = torch.rand(num_tokens, num_groups, generator=generator).topk(topk_groups, dim=-1).indices
    keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool).scatter_(1, pick, True)
    group_of = torch.arange(num_experts) // per
    scores = torch.rand(num_tokens, num_experts, generator=generator).masked_fill(~keep[:, group_of], -1.0)
    return scores.topk(top_k, dim=-1).indices


def miss_probability(
    expert_ids: list[int], num_experts: int, top_k: int, num_groups: int, topk_groups: int
) -> float:
    """P(a token's k experts avoid every expert in ``expert_ids``) under group-limited routing (module docstring)."""
    per = num_experts // num_groups
    in_group = [0] * num_groups
    for e in expert_ids:
        in_group[e // per] += 1
    # dp[m][c]: number of ways to keep m groups holding c experts of the set
    cap = len(expert_ids)
    dp = [[0] * (cap + 1) for _ in range(topk_groups + 1)]
    dp[0][0] = 1
    for s in in_group:
        for m in range(topk_groups, 0, -1):
            for c in range(cap, s - 1, -1):
                dp[m][c] += dp[m - 1][c - s]
    pool, total = topk_groups * per, comb(num_groups, topk_groups)
    return (
        sum(
            ways * comb(max(pool - c, 0), top_k) / comb(pool, top_k) for c, ways in enumerate(dp[topk_groups])
        )
        / total
    )


def expected_traffic(
    placement: ExpertPlacement, tokens: float, rows: RowBytes, num_groups: int = 1, topk_groups: int = 1
) -> dict[str, Traffic]:
    """Mean per-rank Traffic (float fields) of the four phases under group-limited routing (module docstring).

    Args:
        placement: expert placement over the EP ranks.
        tokens: T tokens per rank.
        rows: row sizes (its top_k is k).
        num_groups, topk_groups: Gr and M (1, 1: unrestricted uniform top-k).
    """
    topo, e, k = placement.topology, placement.num_experts, rows.top_k
    r, n, g = topo.world_size, topo.num_nodes, topo.ranks_per_node
    ranks = placement.expert_rank.tolist()
    sets_r = [[x for x in range(e) if ranks[x] == d] for d in range(r)]
    p_rank = [1 - miss_probability(s, e, k, num_groups, topk_groups) for s in sets_r]
    p_node = [
        1 - miss_probability(sum(sets_r[m * g : (m + 1) * g], []), e, k, num_groups, topk_groups)
        for m in range(n)
    ]
    acc = {p: [0.0, 0.0, 0.0, 0.0] for p in PHASES}  # intra bytes, inter bytes, intra msgs, inter msgs

    def add(phase: str, same_node: bool, count: float, row: int, p_any: float) -> None:
        i = 0 if same_node else 1
        acc[phase][i] += count * row / r
        acc[phase][2 + i] += p_any / r

    for me in range(r):
        node = topo.node_of(me)
        for d in range(r):
            if d == me:
                continue
            same = topo.is_same_node(me, d)
            copies = tokens * k * len(sets_r[d]) / e
            add("flat_dispatch", same, copies, rows.flat_dispatch, 1 - (1 - p_rank[d]) ** tokens)
            back = tokens * k * len(sets_r[me]) / e  # copies source d sent me, returned in combine
            add("flat_combine", same, back, rows.combine, 1 - (1 - p_rank[me]) ** tokens)
            if same:  # stage 2 (forwarder me -> d) and its reverse (me -> forwarder d)
                add(
                    "hier_dispatch",
                    True,
                    n * tokens * p_rank[d],
                    rows.hier_dispatch,
                    1 - (1 - p_rank[d]) ** (n * tokens),
                )
                add(
                    "hier_combine",
                    True,
                    n * tokens * p_rank[me],
                    rows.combine,
                    1 - (1 - p_rank[me]) ** (n * tokens),
                )
        for m in range(n):
            if m == node:
                continue
            p1 = 1 - (1 - p_node[m]) ** tokens
            add("hier_dispatch", False, tokens * p_node[m], rows.hier_dispatch, p1)
            add("hier_combine", False, tokens * p_node[node], rows.combine, 1 - (1 - p_node[node]) ** tokens)
    return {p: Traffic(*v) for p, v in acc.items()}
