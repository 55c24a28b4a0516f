"""The encoder's math kernels, each beside its PyTorch reference and tested against it.

``attention``: ``hstu_attention(..., kernel="triton"|"reference")``, HSTU attention's one entry, and
its ``BiasSpec``. ``hstu_attention``: that attention as one Triton launch per layer and direction
(imports triton when imported; the entry imports it on first use). ``hstu_attention_reference``: the
same in PyTorch per group of equal-length samples, the model's ``grouped`` kernel and the Triton
kernel's reference.
``relative_buckets``: the log-bucketing of relative positions and time gaps (torch only).
``kernel_limits``: the Triton kernel's limits on its bucket tables, importable without triton or
torch (the launcher's config check reads them before any rank starts).
"""
