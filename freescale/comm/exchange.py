"""The embedding exchange, overlapped with compute and sent in priority order.

One step's exchange (:class:`StepExchange`) goes through four phases, each a call
the training step (freescale/training/loop/step.py) makes where the result is first needed:

1. ``StepExchange(exchange, ids)``: every feature's ids are routed to the ranks
   holding their rows; the per-(rank, feature) counts leave in one all-to-all.
   Issued a step ahead, during the previous step's compute.
2. ``send_ids()``: the ids follow in one all-to-all (also a step ahead). Only ids
   move early: rows are looked up after the previous step's optimizer ran, so a
   lookup always sees this step's rows.
3. ``look_up()``: each rank runs its TorchRec kernels on the ids it received
   (one lookup per sharded module) and sends the rows back in priority groups,
   highest priority first, one all-to-all per group. ``feature(name)`` waits for
   that feature's group only: the encoder starts when the history items and user
   features are in, while the negatives (needed only by the loss) still travel.
4. Backward: when a group's gradient is complete (a hook on its received rows) its
   all-to-all back to the owners is issued at once, while the dense backward goes
   on. ``finish_backward()`` waits, assembles each module's gradient from all groups
   and runs the kernels' backward once -- one fused optimizer update per table per
   step, from the summed gradient, as without groups.

Collectives of one process group must be issued in the same order on every rank:
forward groups go in priority order, gradients in reverse priority order (the
order the backward produces them), each held until the one before it is out; a
rank whose batch was empty issues the same sequence with zeros.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torchrec import KeyedJaggedTensor

from freescale.comm.base import CollectiveBackend
from freescale.comm.clock import CommClock, Tracked
from freescale.comm.routes import LocalLookup, TableRoute


@dataclass(frozen=True)
class ExchangedFeature:
    """A feature the exchange carries: the table route of its ids and the module that looks them up."""

    name: str
    route: TableRoute
    module: int
    """Index into the exchange's ``lookups``."""


class EmbeddingExchange:
    """The exchange's fixed parts: features, their priority groups, local kernels, transport."""

    def __init__(self, features: list[ExchangedFeature], lookups: list[LocalLookup], groups: list[list[str]],
                 backend: CollectiveBackend, group, clock: CommClock, rank: int, world_size: int, dim: int,
                 device: torch.device = torch.device("cpu"), gradient_divisor: int = 1,
                 on_gradients_issued: Callable[[], None] | None = None):
        self.features = features
        self.index = {f.name: i for i, f in enumerate(features)}
        self.lookups = lookups
        # Groups as feature indices in exchange order; priority order is the list order.
        self.groups = [sorted(self.index[name] for name in g) for g in groups]
        self.group_of = {i: g for g, members in enumerate(self.groups) for i in members}
        if sorted(self.group_of) != list(range(len(features))):
            raise ValueError(f"priority groups {groups} must place every feature "
                             f"{[f.name for f in features]} exactly once")
        self.group_names = [",".join(features[i].name for i in g) for g in self.groups]
        self.backend, self.group, self.clock = backend, group, clock
        self.rank, self.world_size, self.dim, self.device = rank, world_size, dim, device
        # TorchRec divides embedding gradients by the world size on their way back (its
        # "gradient division", on by default); the same here keeps the fused updates equal.
        self.gradient_divisor = gradient_divisor
        self.on_gradients_issued = on_gradients_issued

    def start(self, ids: dict[str, torch.Tensor]) -> "StepExchange":
        """Phase 1 for one step's ids (``ids[name]``: 1-D int64 table row ids per feature)."""
        return StepExchange(self, ids)


class StepExchange:
    def __init__(self, exchange: EmbeddingExchange, ids: dict[str, torch.Tensor]):
        self.x = exchange
        world, features = exchange.world_size, exchange.features
        self.sent_ids: list[torch.Tensor] = []   # per feature: local row ids sorted by owner
        self.order: list[torch.Tensor] = []      # per feature: stable sort of positions by owner
        counts = torch.zeros(world, len(features), dtype=torch.int64)  # host: splits are host ints
        for f, feature in enumerate(features):
            owner, local = feature.route.owners(ids[feature.name].to("cpu", torch.int64).reshape(-1))
            order = torch.sort(owner, stable=True).indices
            self.order.append(order)
            self.sent_ids.append(local[order])
            counts[:, f] = torch.bincount(owner, minlength=world)
        self.send_counts = counts                 # [to rank, feature]
        self._recv_counts = torch.empty_like(counts, device=exchange.device)  # [from rank, feature]
        self._counts_work = exchange.clock.track(
            "ids_counts", exchange.backend.all_to_all(self._recv_counts, counts.to(exchange.device),
                                                      [1] * world, [1] * world, exchange.group))
        self._ids_work: Tracked | None = None
        self._group_works: list[Tracked | None] = [None] * len(exchange.groups)
        self._features: dict[str, torch.Tensor] = {}
        self._grads: list[torch.Tensor | None] = [None] * len(exchange.groups)
        self._grad_works: list[Tracked | None] = [None] * len(exchange.groups)
        self._grad_recv: list[torch.Tensor | None] = [None] * len(exchange.groups)
        self._rows: torch.Tensor | None = None

    # ------------------------------------------------------------------ ids

    def send_ids(self) -> None:
        """Phase 2: the ids themselves (waits for the counts, which left a phase earlier)."""
        if self._ids_work is not None:
            return
        self._counts_work.wait()
        x = self.x
        self.recv_counts = self._recv_counts.cpu()
        self.send_counts_list = self.send_counts.tolist()
        self.recv_counts_list = self.recv_counts.tolist()
        # Rank-major, then feature, then position: rank r's ids for feature f are one slice.
        starts = [torch.cumsum(self.send_counts[:, f], 0) - self.send_counts[:, f] for f in range(len(x.features))]
        pieces = [self.sent_ids[f][int(starts[f][r]):int(starts[f][r]) + self.send_counts_list[r][f]]
                  for r in range(x.world_size) for f in range(len(x.features))]
        send = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        self.recv_ids = torch.empty(int(self.recv_counts.sum()), dtype=torch.int64, device=x.device)
        self._ids_work = x.clock.track("ids", x.backend.all_to_all(
            self.recv_ids, send.to(x.device), [sum(row) for row in self.recv_counts_list],
            [sum(row) for row in self.send_counts_list], x.group))

    # --------------------------------------------------------------- lookup

    def look_up(self) -> None:
        """Phase 3: local lookups of the received ids, rows sent back group by group."""
        self.send_ids()
        self._ids_work.wait()
        x = self.x
        world, recv = x.world_size, self.recv_counts_list
        # Offset of (from rank r, feature f) in the received ids.
        offsets, at = {}, 0
        for r in range(world):
            for f in range(len(x.features)):
                offsets[r, f] = at
                at += recv[r][f]
        # The looked-up rows, module by module, key by key, then by sending rank: the
        # kernels' own input order. block[(f, r)] = where that slice's rows start.
        block, rows, at = {}, [], 0
        for m, lookup in enumerate(x.lookups):
            keys = [x.index[k] for k in lookup.keys if k in x.index]
            held = {f for f in range(len(x.features)) if x.features[f].module == m
                    and any(recv[r][f] for r in range(world))}
            if held - set(keys):
                raise RuntimeError(f"rank {x.rank} received ids of {[x.features[f].name for f in held - set(keys)]} "
                                   "but holds no table for them: the route and the sharding disagree")
            if lookup.kernel is None or not any(recv[r][f] for r in range(world) for f in keys):
                for f in keys:
                    for r in range(world):
                        block[f, r] = at
                continue
            index = torch.cat([torch.arange(offsets[r, f], offsets[r, f] + recv[r][f])
                               for f in keys for r in range(world)])
            values = self.recv_ids[index.to(x.device)]
            for f in keys:
                for r in range(world):
                    block[f, r] = at
                    at += recv[r][f]
            rows.append(self._run_kernel(lookup, [x.features[f].name for f in keys],
                                         [[recv[r][f] for r in range(world)] for f in keys], values))
        self._rows = torch.cat(rows) if rows else torch.zeros(0, x.dim, device=x.device)
        detached = self._rows.detach()
        self._send_index, self._in_splits, self._out_splits, self._recv = [], [], [], []
        for g, members in enumerate(x.groups):
            send_index = [torch.arange(block[f, r], block[f, r] + recv[r][f])
                          for r in range(world) for f in members if recv[r][f]]
            send_index = (torch.cat(send_index) if send_index else torch.zeros(0, dtype=torch.int64)).to(x.device)
            in_splits = [sum(recv[r][f] for f in members) for r in range(world)]
            out_splits = [sum(self.send_counts_list[r][f] for f in members) for r in range(world)]
            received = torch.empty(sum(out_splits), x.dim, device=x.device)
            self._send_index.append(send_index)
            self._in_splits.append(in_splits)
            self._out_splits.append(out_splits)
            self._recv.append(received)
            self._group_works[g] = x.clock.track(f"embeddings[{x.group_names[g]}]", x.backend.all_to_all(
                received, detached.index_select(0, send_index), out_splits, in_splits, x.group))

    def _run_kernel(self, lookup: LocalLookup, keys: list[str], lengths: list[list[int]],
                    values: torch.Tensor) -> torch.Tensor:
        """Rows of ``values`` (key-major) through one module's TorchRec kernel (fused optimizer on backward)."""
        dim = self.x.dim
        if not lookup.pooled:
            kjt = KeyedJaggedTensor(keys=keys, values=values,
                                    lengths=torch.tensor([n for per_key in lengths for n in per_key], device=values.device))
            return lookup.kernel(kjt).view(-1, dim)
        # A bag per id: every key needs the same number of bags (each sender sent one id per
        # sample for every user feature, so they agree).
        bags = {sum(per_key) for per_key in lengths}
        if len(bags) != 1:
            raise RuntimeError(f"pooled features {keys} received different id counts {sorted(bags)}")
        bag_count = bags.pop()
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=torch.ones(len(keys) * bag_count, dtype=torch.int64,
                                                                                   device=values.device))
        pooled = lookup.kernel(kjt)                       # [bags, keys * dim]
        return pooled.view(bag_count, len(keys), dim).transpose(0, 1).reshape(-1, dim)

    # -------------------------------------------------------------- results

    def feature(self, name: str) -> torch.Tensor:
        """``[n, dim]`` rows of ``name``'s ids, in the order given; waits for its group only."""
        if name in self._features:
            return self._features[name]
        x = self.x
        f = x.index[name]
        g = x.group_of[f]
        received = self._received(g)
        # Where each of this rank's ids landed: sender-major by owner, then the group's features.
        counts = self.send_counts[:, x.groups[g]]                       # [owner, member]
        member = x.groups[g].index(f)
        base = torch.cumsum(counts.sum(1), 0) - counts.sum(1)            # group rows from each owner
        within = counts[:, :member].sum(1)                               # earlier members' rows
        own = self.send_counts[:, f]
        first = torch.cumsum(own, 0) - own                               # first sorted position per owner
        n = int(own.sum())
        owner_sorted = torch.repeat_interleave(torch.arange(x.world_size), own)
        position = base[owner_sorted] + within[owner_sorted] + torch.arange(n) - first[owner_sorted]
        restore = torch.empty(n, dtype=torch.int64)
        restore[self.order[f]] = position
        rows = received.index_select(0, restore.to(received.device))
        self._features[name] = rows
        return rows

    def _received(self, g: int) -> torch.Tensor:
        work = self._group_works[g]
        work.wait()
        received = self._recv[g]
        if torch.is_grad_enabled() and not received.requires_grad:
            received.requires_grad_(True)
            # The hook reaches the exchange through a weak reference. Holding it would close a
            # cycle (exchange -> its collectives' work handles -> `received`, held in C++ ->
            # hook -> exchange) that Python's collector cannot see, and every step's exchange,
            # rows and graph would stay alive for the rest of the run (~4 MB a step).
            exchange = weakref.ref(self)
            received.register_hook(lambda grad, g=g: exchange()._grad_ready(g, grad))
        return received

    # ------------------------------------------------------------- backward

    def _grad_ready(self, g: int, grad: torch.Tensor) -> None:
        self._grads[g] = grad.contiguous()
        self._issue_grads()

    def _issue_grads(self, force: bool = False) -> None:
        """Gradients go back in reverse priority order, each once the one before it is out."""
        x = self.x
        for g in reversed(range(len(x.groups))):
            if self._grad_works[g] is not None:
                continue
            if self._grads[g] is None:
                if not force:
                    return
                self._grads[g] = torch.zeros_like(self._recv[g])
            self._grad_recv[g] = torch.empty(sum(self._in_splits[g]), x.dim, device=x.device)
            self._grad_works[g] = x.clock.track(f"embedding_grads[{x.group_names[g]}]", x.backend.all_to_all(
                self._grad_recv[g], self._grads[g], self._in_splits[g], self._out_splits[g], x.group))
            if g == 0 and x.on_gradients_issued is not None:
                x.on_gradients_issued()

    def finish_backward(self) -> None:
        """Wait for every group's gradient, then one backward through each module's kernel
        (its fused optimizer update). Also run by a rank whose batch was empty."""
        for work in self._group_works:
            work.wait()
        self._issue_grads(force=True)
        for work in self._grad_works:
            work.wait()
        if self._rows is not None and self._rows.requires_grad:
            grad = torch.zeros_like(self._rows)
            for g in range(len(self.x.groups)):
                grad.index_copy_(0, self._send_index[g], self._grad_recv[g])
            if self.x.gradient_divisor != 1:
                grad.div_(self.x.gradient_divisor)
            torch.autograd.backward(self._rows, grad)
        self._features.clear()
        self._recv = self._grads = self._grad_recv = []


def priority_groups(spec: str, features: list[str], aliases: dict[str, list[str]] | None = None) -> list[list[str]]:
    """Parse ``"a,b;c"`` (groups in priority order, ``;`` between groups, ``,`` between
    features) into groups of feature names. An alias stands for several features (an
    empty alias is allowed: data without user features); features not named join the
    last group; a name that is neither a feature nor an alias is an error naming it."""
    aliases = aliases or {}
    groups: list[list[str]] = []
    placed: set[str] = set()
    for part in spec.split(";"):
        group: list[str] = []
        for name in (n.strip() for n in part.split(",")):
            if not name:
                continue
            names = aliases[name] if name in aliases else [name]
            for feature in names:
                if feature not in features:
                    raise ValueError(f"comm.priority_groups {spec!r}: {feature!r} is not a feature "
                                     f"(features: {', '.join(features)}; aliases: {', '.join(aliases) or 'none'})")
                if feature in placed:
                    raise ValueError(f"comm.priority_groups {spec!r}: {feature!r} is in two groups")
                placed.add(feature)
                group.append(feature)
        if group:
            groups.append(group)
    rest = [f for f in features if f not in placed]
    if rest:
        if groups:
            groups[-1].extend(rest)
        else:
            groups.append(rest)
    return groups
