"""The trainer: TorchRec ranks that stream their shards, exchange embeddings while they compute, and
measure every step's bubble. One concern per sub-package (README's layout table).
"""
