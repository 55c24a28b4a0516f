"""The shard sets a comparison trains on: contiguous, balanced and (optionally) the mirror control,
named on `freescale compare --shards` or built by balance, and checked as comparable from their
manifests alone."""
from __future__ import annotations

from pathlib import Path

from freescale.runtime.errors import InputError

VARIANTS = ("contiguous", "balanced", "control")


def parse_shard_sets(text: str, control: bool) -> dict[str, Path]:
    """``contiguous=DIR,balanced=DIR[,control=DIR]`` -> {variant: DIR}, each holding a manifest."""
    sets: dict[str, Path] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, folder = item.partition("=")
        if not sep or name not in VARIANTS or not folder:
            raise InputError(f"--shards: {item!r} is not VARIANT=DIR with VARIANT one of {', '.join(VARIANTS)}")
        if name in sets:
            raise InputError(f"--shards names {name} twice")
        sets[name] = Path(folder)
    missing = [v for v in VARIANTS[:2] if v not in sets]
    if missing:
        raise InputError(f"--shards lacks {' and '.join(missing)} (contiguous=DIR,balanced=DIR[,control=DIR])")
    if control and "control" not in sets:
        raise InputError("--control with --shards needs control=DIR in --shards")
    return sets  # their manifests are loaded (and checked) once the arguments are known to be sane


def planned_as(variant: str, manifest) -> bool:
    """Whether a shard set was planned as ``variant``: the contiguous baseline, a balanced plan
    (any other strategy) or the mirror control, as its manifest says."""
    if variant == "control":
        return manifest.control == "mirror"
    return manifest.control is None and (manifest.strategy == "contiguous") == (variant == "contiguous")


def check_shard_sets(sets: dict[str, Path], world_size: int | None, local_batch_size: int | None) -> dict:
    """The manifests of ``--shards``' sets ({variant: Manifest}), refused unless they can be
    compared: one shape (world size, local batch size), no set given twice (the same folder, or a
    copy: the same manifest bytes), and each set planned as its label says."""
    from freescale.shards.manifest import load_manifest

    manifests = {v: load_manifest(d) for v, d in sets.items()}
    shapes = {(m.world_size, m.local_batch_size) for m in manifests.values()}
    if len(shapes) != 1:
        raise InputError(f"--shards: the shard sets differ in (world size, local batch size): {sorted(shapes)}")
    k, b = next(iter(shapes))
    if world_size not in (None, k) or local_batch_size not in (None, b):
        raise InputError(f"--shards were balanced for --world-size {k} --local-batch-size {b}")
    seen: dict[tuple[str, str], str] = {}
    for variant, manifest in manifests.items():
        for key in (("folder", str(sets[variant].resolve())), ("content", manifest.sha256)):
            if key in seen:
                how = "the same folder" if key[0] == "folder" else "copies of one shard set (the same manifest.json)"
                raise InputError(f"--shards: {seen[key]}={sets[seen[key]]} and {variant}={sets[variant]} are {how}: "
                                 "a comparison needs different shard sets")
            seen[key] = variant
    for variant, manifest in manifests.items():
        if not planned_as(variant, manifest):
            planned = f"the {manifest.control} control" if manifest.control else f"strategy {manifest.strategy}"
            raise InputError(f"--shards: {variant}={sets[variant]} was planned with {planned} (its manifest.json), "
                             f"not as the {variant} set")
    return manifests


def prepared_of(manifest) -> Path | None:
    """The prepared folder a shard set was balanced from (its manifest's input), when local."""
    from freescale.runtime.paths import local_path

    uri = manifest.input.get("uri")
    local = local_path(uri) if uri else None
    return Path(local) if local else None
