"""The shard format shared by the balance job (writer) and the trainer (reader): stdlib + pyarrow."""
