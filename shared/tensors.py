"""Arbitrary training state <-> (flat tensors for safetensors, a JSON tree).

A state dict from torch (model, optimizer, scheduler) is a tree of dicts, lists, tuples,
scalars and tensors, sometimes with integer keys. Pickle would take it whole; we may not
use pickle. So tensors are lifted out under dotted names into a safetensors file and the
rest becomes JSON with small tagged nodes for what JSON cannot say (tuples, non-string
keys, non-finite floats). The round trip is exact, which exact resume depends on.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shared.errors import IntegrityError

Tree = Any


def flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> Tree:
    """Move every tensor in `obj` into `out` under a name below `prefix`; return the rest."""
    if isinstance(obj, torch.Tensor):
        if prefix in out:
            raise TypeError(f"two tensors would share the name {prefix!r}")
        out[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[_key(k), flatten(v, f"{prefix}.{k}", out)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, f"{prefix}.{i}", out) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, f"{prefix}.{i}", out) for i, v in enumerate(obj)]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"{prefix}: cannot checkpoint a {type(obj).__name__} without pickle")


def unflatten(tree: Tree, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            name = tree["__tensor__"]
            if name not in tensors:
                raise IntegrityError(f"checkpoint metadata names tensor {name!r}, not in the file")
            return tensors[name]
        if "__dict__" in tree:
            return {_unkey(k): unflatten(v, tensors) for k, v in tree["__dict__"]}
        if "__tuple__" in tree:
            return tuple(unflatten(v, tensors) for v in tree["__tuple__"])
        if "__float__" in tree:
            return float(tree["__float__"])
        raise IntegrityError(f"unknown node in checkpoint metadata: {sorted(tree)}")
    return tree


def _key(k: Any) -> Any:
    if isinstance(k, bool) or not isinstance(k, int | str):
        raise TypeError(f"cannot checkpoint a dict key of type {type(k).__name__}")
    return k


def _unkey(k: Any) -> Any:
    return k
