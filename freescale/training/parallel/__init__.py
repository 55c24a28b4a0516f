"""Many ranks: torchrun and its statuses (`launcher`), the checks before it starts (`rank_checks`),
process groups (`distributed`), TorchRec sharding and the dense sync (`sharding`), and the
embedding exchange as the model's embedding source (`comm_layer`).
"""
