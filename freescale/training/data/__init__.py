"""What a rank reads: its shard streamed row group by row group (`shard_reader`, torchdata.nodes)
into jagged step batches (`batch`).
"""
