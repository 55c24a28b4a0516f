"""The datasets a run read or wrote, as MLflow's run inputs list them: a prepared dataset, a shard
set or raw logs, each by a digest of what identifies it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping



DIGEST_CHARS = 32  # of a sha256; MLflow keeps at most 36 characters of a dataset digest


@dataclass(frozen=True)
class DataRef:
    """A dataset a run read or wrote, as MLflow's run inputs list it: name, content digest (the first
    DIGEST_CHARS of a sha256), source URI, and a profile of its counts."""

    name: str
    digest: str
    source: str
    profile: dict[str, Any]

    @classmethod
    def prepared(cls, uri: str, metadata_text: str) -> DataRef:
        """A `freescale prepare` output, by its prepare.json (which the job writes last)."""
        import hashlib
        import json

        meta = json.loads(metadata_text)
        keys = ("users", "num_items", "interactions", "max_seq_len")
        return cls(f"prepared:{Path(uri.rstrip('/')).name}",
                   hashlib.sha256(metadata_text.encode()).hexdigest()[:DIGEST_CHARS], uri,
                   {k: meta[k] for k in keys if k in meta})

    @classmethod
    def recommendations(cls, uri: str, made_of: dict[str, Any], profile: dict[str, Any]) -> DataRef:
        """A `freescale recommend` output, by what made it (the model, its input's prepare.json digest, the
        options)."""
        import hashlib
        import json

        text = json.dumps(made_of, sort_keys=True)
        return cls(f"recommendations:{Path(uri.rstrip('/')).name}",
                   hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS], uri, profile)

    @classmethod
    def shards(cls, uri: str, manifest_text: str) -> DataRef:
        """A shard set, by its manifest.json (whose sha256 is freescale.shards.manifest.Manifest.sha256)."""
        import hashlib
        import json

        raw = json.loads(manifest_text)
        keys = ("world_size", "local_batch_size", "num_steps", "strategy", "control")
        return cls(f"shards:{Path(uri.rstrip('/')).name}",
                   hashlib.sha256(manifest_text.encode()).hexdigest()[:DIGEST_CHARS], uri,
                   {k: raw.get(k) or "none" for k in keys})

    @classmethod
    def logs(cls, source: dict[str, Any]) -> DataRef:
        """prepare's input: a file by its URI and (local) size and modification time, or the generator's settings."""
        import hashlib
        import json

        from freescale.runtime.paths import local_path

        uri = source.get("uri")
        local = local_path(uri) if uri else None
        identity = dict(source)
        if local and Path(local).exists():
            stat = Path(local).stat()
            identity.update(bytes=stat.st_size, mtime_ns=stat.st_mtime_ns)
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:DIGEST_CHARS]
        name = f"logs:{Path(uri.rstrip('/')).name}" if uri else f"synthetic:{source.get('users')}u"
        return cls(name, digest, uri or "synthetic", {k: v for k, v in source.items() if k != "uri"})


def log_datasets(client, run_id: str, refs: Mapping[str, DataRef]) -> None:
    """``refs`` as the run's dataset inputs, each with its context tag (MLflow's mlflow.data.context)."""
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    client.log_inputs(run_id, datasets=[
        DatasetInput(Dataset(ref.name, ref.digest, "path", json.dumps({"uri": ref.source}),
                             profile=json.dumps(ref.profile)), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])
        for context, ref in refs.items()])
