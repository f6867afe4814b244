"""`baton pull`: a committed checkpoint out of the store, as a user loads it.

The download, its checks and the arranging are `baton.client.pull`. A sharded checkpoint (FSDP2:
`shared.checkpoint.shards`) leaves every rank's shard file of an object under its checkpoint
name, and they are put together in one directory per object,
`<dest>/<name>/rank<k>.safetensors`: that directory is a plain DCP checkpoint, which torch
loads at any group size with

    from torch.distributed.checkpoint import HuggingFaceStorageReader, load
    state = {"model": get_model_state_dict(model)}     # keys as Baton names them
    load(state, storage_reader=HuggingFaceStorageReader("<dest>/model"))
    set_model_state_dict(model, state["model"])

With `--gather`, each sharded object is also assembled into one ordinary safetensors file,
`<dest>/<name>.whole.safetensors` (tensor names as in the shards), for tools that know
nothing of shards (`gather`). That holds the whole object in memory once, on the machine
that asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from baton.cli.common import Json, Server, app, fail, out, print_json, run, store_of


@app.command()
def pull(
    run_id: str,
    dest: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    store: Annotated[str | None, typer.Option(envvar="BATON_STORE", help="Store URL.")] = None,
    server: Server = "nats://127.0.0.1:4222",
    step: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Another committed checkpoint still stored: on the chain, or abandoned by a "
            "rollback \\[default: the newest that verifies].",
        ),
    ] = None,
    token: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="With --step: the one written under this token (a step committed again "
            "after a rollback) \\[default: the one on the chain, else the newest].",
        ),
    ] = None,
    gather: Annotated[
        bool,
        typer.Option(
            "--gather",
            help="A sharded (FSDP2) checkpoint: also assemble each sharded object into one "
            "safetensors file, <name>.whole.safetensors.",
        ),
    ] = False,
    as_json: Json = False,
) -> None:
    """Download and verify the newest committed checkpoint, or the one at --step (safetensors
    + metadata; a framework's checkpoint as the files the framework loads; a sharded one's
    shards as a directory per object that plain DCP loads at any size)."""
    from baton.client import calls as client

    url = store_of(server, store)
    if token is not None and step is None:
        fail("--token needs --step", code=2)
    info = run(lambda: client.pull(url, run_id, dest, step, token, whole=gather))
    if as_json:
        print_json(info)
        return
    out.print(
        f"pulled step {info['step']} of {run_id} ({_STATUS[info['status']]}) into "
        f"{info['dir']}: {', '.join(info['files'])}"
    )
    out.print(f"weights digest {info['digest']}")


_STATUS = {
    "chain": "on the chain",
    "abandoned": "abandoned by a rollback",
    "off": "off the chain",
}
