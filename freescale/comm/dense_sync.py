"""Dense gradients all-reduced in buckets during the backward, as they become ready (as DDP does).

Parameters are grouped into buckets of about ``bucket_bytes`` in reverse
registration order, which is roughly the order the backward produces their
gradients. A bucket's all-reduce is issued once every gradient in it has been
accumulated *and* every earlier bucket has been issued: all ranks then issue the
same collectives in the same order whatever order their autograd engine ran in
(a rank with an empty batch issues them all in ``finish``). ``hold_last`` keeps the
last bucket back until ``release()`` -- the prioritized mode uses it so the
embedding-gradient exchange is issued ahead of the final dense all-reduce.

The arithmetic is the plain sync's: sum over ranks, then divide by the world size,
element by element, so the averaged gradients are the same numbers.
"""
from __future__ import annotations

import torch
from torch import nn

from freescale.comm.base import CollectiveBackend
from freescale.comm.clock import CommClock, Tracked


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.work: Tracked | None = None


class BucketedGradSync:
    def __init__(self, params: list[nn.Parameter], backend: CollectiveBackend, group, clock: CommClock,
                 world_size: int, bucket_bytes: int = 256 * 1024, hold_last: bool = False):
        self.backend, self.group, self.clock, self.world_size = backend, group, clock, world_size
        self.hold_last = hold_last
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(_Bucket(len(self.buckets), current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(len(self.buckets), current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self._released = not hold_last
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    def _grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        self._issue_ready()

    def _issue_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and len(bucket.ready) < len(bucket.params):
                return
            if bucket.index == len(self.buckets) - 1 and not self._released and not force:
                return
            self._issue(bucket)
            self._next += 1

    def _issue(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        bucket.work = self.clock.track(f"dense_allreduce[{bucket.index}]",
                                       self.backend.all_reduce(bucket.flat, self.group))

    def release(self) -> None:
        """Let the held-back last bucket go (it is issued now if its gradients are in)."""
        if not self._released:
            self._released = True
            self._issue_ready()

    def finish(self) -> None:
        """Issue what is left (zeros for gradients the backward did not produce), wait, average."""
        self._issue_ready(force=True)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.flat /= self.world_size
            offset = 0
            for p in bucket.params:
                n = p.numel()
                p.grad = bucket.flat[offset:offset + n].view_as(p)
                offset += n
            bucket.ready.clear()
            bucket.flat, bucket.work = None, None
        self._next = 0
        self._released = not self.hold_last

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
