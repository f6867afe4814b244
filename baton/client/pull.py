"""A committed checkpoint out of the store, as a user loads it (`baton pull`).

A sharded checkpoint (FSDP2: `shared.checkpoint.shards`) leaves every rank's shard file of an
object under its checkpoint name, and `arrange` puts them together in one directory per
object, `<dest>/<name>/rank<k>.safetensors`: that directory is a plain DCP checkpoint, which
torch loads at any group size (`baton.cli.pull` says how). `gather` assembles a sharded object
into one ordinary safetensors file, holding the whole object in memory once, on the machine
that asked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baton.client.errors import CliError
from shared.checkpoint import commit
from shared.checkpoint import files as checkpoint_files
from shared.checkpoint.store import open_store
from shared.contracts import encode
from shared.errors import IntegrityError

if TYPE_CHECKING:  # `baton --help` imports neither msgspec nor torch
    from shared.contracts import Manifest


def _local_name(name: str) -> str:
    """Where a checkpoint file goes in `pull`'s directory: a framework's own file of rank 0
    under the name the framework gave it (the directory is then one it can load), every
    other file under its checkpoint name."""
    foreign = checkpoint_files.foreign_name(name)
    return foreign if foreign is not None and checkpoint_files.rank_of(name) == 0 else name


async def pull(
    url: str,
    run_id: str,
    dest: Path,
    step: int | None = None,
    token: int | None = None,
    whole: bool = False,
) -> dict[str, Any]:
    """Download the newest committed checkpoint that verifies (or the one at `step`, on the
    chain or abandoned by a rollback — written under `token`, if given: a step may have been
    committed again after a rollback — `shared.checkpoint.lineage`), check every file again
    after the download, and recompute the weights digest from the downloaded model file. A
    sharded checkpoint's shards are arranged as plain DCP checkpoints, and with `whole`
    gathered into one file each (`arrange`, `gather`)."""
    from safetensors.torch import load_file  # torch only here: every other command starts fast

    from shared.checkpoint import lineage
    from shared.checkpoint.digest import weights_digest
    from shared.checkpoint.store.base import sha256_file

    async with open_store(url) as store:
        status = lineage.CHAIN
        if step is None:
            manifest, _damaged = await commit.restorable(store, run_id)
        else:
            try:
                found = await lineage.find(store, run_id, step, anywhere=True, token=token)
            except IntegrityError as exc:
                raise CliError(str(exc), 3) from None
            manifest, status = found.manifest, found.status
        if manifest is None:
            raise CliError(f"run {run_id} has no committed checkpoint", 3)
        dest.mkdir(parents=True, exist_ok=True)
        for ref in manifest.files:
            path = dest / _local_name(ref.name)
            await store.download(ref.key, path)
            if sha256_file(path) != (ref.size, ref.sha256):
                raise IntegrityError(f"{ref.name}: downloaded bytes do not match the manifest")
    (dest / "manifest.json").write_bytes(encode(manifest))
    extra: list[str] = []
    if manifest.sharded:
        extra = arrange(dest, manifest)
        if whole:
            extra += [gather(dest, manifest, name) for name in manifest.sharded]
    if any(checkpoint_files.foreign_name(r.name) for r in manifest.files) or manifest.sharded:
        # A framework's checkpoint (`baton.runtime.external`): its digest is of the live
        # model's tensors, which its own files may hold differently (tied weights saved
        # once), and a sharded one's is of its shard files (`baton.runtime.checkpoints`):
        # every file's sha256 is checked, the digest is the manifest's.
        digest = manifest.digest
    else:
        model_file = next(r.name for r in manifest.files if r.name.endswith(".safetensors"))
        digest = weights_digest(load_file(str(dest / model_file)))
        if manifest.digest and digest != manifest.digest:
            raise IntegrityError(f"digest {digest} of {model_file} differs from the manifest's")
    return {
        "run_id": run_id,
        "step": manifest.step,
        "token": manifest.token,
        "final": manifest.final,
        "status": status,
        "digest": digest,
        "files": [r.name for r in manifest.files] + extra,
        "dir": str(dest),
        "metrics": manifest.metrics,
    }


def arrange(dest: Path, manifest: Manifest) -> list[str]:
    """Link every rank's shard file of each sharded object into `<dest>/<name>/`; the
    directories made."""
    from shared.checkpoint import files as checkpoint_files

    made = []
    for name in manifest.sharded:
        folder = dest / name
        folder.mkdir(exist_ok=True)
        for ref in manifest.files:
            if checkpoint_files.group_of(ref.name) != name:
                continue
            link = folder / f"rank{checkpoint_files.rank_of(ref.name)}.safetensors"
            link.unlink(missing_ok=True)
            os.link(dest / ref.name, link)
        made.append(f"{name}/")
    return made


def gather(dest: Path, manifest: Manifest, name: str) -> str:
    """Assemble the sharded object `name` of a pulled checkpoint into one safetensors file,
    after checking that its chunks tile every tensor; the file's name."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shared.checkpoint import files as checkpoint_files
    from shared.checkpoint import shards
    from shared.checkpoint.tensors import DTYPES

    paths = [
        dest / ref.name for ref in manifest.files if checkpoint_files.group_of(ref.name) == name
    ]
    found = {p: shards.chunks_of(checkpoint_files.header_of(p), p.name) for p in paths}
    whole = {
        k: torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
        for k, spec in shards.tile([c for cs in found.values() for c in cs], name).items()
    }
    for path, chunks in found.items():
        with safe_open(str(path), framework="pt") as f:
            for c in chunks:
                region = whole[c.name]
                for dim, (at, n) in enumerate(zip(c.offsets, c.spec.shape, strict=True)):
                    region = region.narrow(dim, at, n)
                region.copy_(f.get_tensor(c.name))
    out = f"{name}.whole.safetensors"
    save_file(whole, str(dest / out))
    return out
