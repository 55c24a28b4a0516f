"""The recommender (`recommender`: item tables, encoder, loss head) and its parts: the encoder
contract (`encoders`), their `registry`, HSTU (`hstu`, its kernel choice in `attention_kernel`),
SASRec (`sasrec`), the loss heads (`losses`), CUDA graphs of the encoder (`encoder_graphs`) and
bf16 autocast (`precision`).
"""
