"""The benchmarks: each a module run from the repository root, ``python -m benchmarks.<name>``
(``--help`` says what it measures); what they share is ``benchmarks.common``. Not shipped in the
wheel; their results are in docs/results/."""
