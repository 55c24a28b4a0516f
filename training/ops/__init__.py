"""The encoder's math kernels, each beside its PyTorch reference and tested against it.

``relative_buckets``: the log-bucketing of relative positions and time gaps (torch only).
``hstu_attention``: jagged HSTU attention as one Triton launch per layer and direction
(imports triton lazily; the grouped PyTorch path in ``training.hstu`` is its reference).
``kernel_limits``: that kernel's limits on its bucket tables, importable without triton or
torch (the launcher's config check reads them before any rank starts).
"""
