"""How many kernels one call of a step launches, counted on any device: the host's cost of a step
grows with its launches (a CUDA launch costs microseconds of host time whatever the kernel does),
which is what CUDA graphs of the encoder remove. The GPU bench and the graphs' tests count with it."""
from __future__ import annotations


def kernel_launches(step) -> int:
    """PyTorch ops one call of ``step`` dispatches that run a kernel: views, allocations and
    metadata ops launch nothing and are left out; the Triton kernels are not PyTorch ops."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    silent = {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh"}

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not (func.is_view or name in silent or func._schema.name.startswith("aten::sym_")):
                Count.count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return Count.count
