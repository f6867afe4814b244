"""Arbitrary training state <-> (flat tensors for safetensors, a JSON tree).

A state dict from torch (model, optimizer, scheduler) is a tree of dicts, lists, tuples,
scalars and tensors, sometimes with integer keys. Pickle would take it whole; we may not
use pickle. So tensors are lifted out under dotted names into a safetensors file and the
rest becomes JSON with small tagged nodes for what JSON cannot say (tuples, non-string
keys, non-finite floats). The round trip is exact, which exact resume depends on.

Each tensor node also records the tensor's dtype (in safetensors' names) and shape, so that a
checkpoint can be checked against what it says it holds before anything is loaded from it
(`shared.checkpoint.files`). Trees written before that have bare nodes and still load.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shared.checkpoint.files import ITEMSIZE, TensorSpec
from shared.errors import IntegrityError

Tree = Any

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
    "C64": torch.complex64,
}
"""torch's dtype for each of `shared.checkpoint.files.ITEMSIZE`."""
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def spec_of(t: torch.Tensor) -> TensorSpec | None:
    """The tensor's dtype and shape, or None for a dtype a checkpoint cannot hold."""
    name = _DTYPE_NAMES.get(t.dtype)
    return TensorSpec(name, tuple(t.shape)) if name is not None else None


def specs_of(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: spec for name, t in tensors.items() if (spec := spec_of(t)) is not None}


def flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> Tree:
    """Move every tensor in `obj` into `out` under a name below `prefix`; return the rest."""
    if isinstance(obj, torch.Tensor):
        if prefix in out:
            raise TypeError(f"two tensors would share the name {prefix!r}")
        spec = spec_of(obj)
        if spec is None:
            raise TypeError(f"{prefix}: cannot checkpoint a tensor of dtype {obj.dtype}")
        out[prefix] = obj
        return {"__tensor__": prefix, "dtype": spec.dtype, "shape": list(spec.shape)}
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
    """The inverse of `flatten`. The tree comes from storage, so every node is checked:
    a malformed one is an `IntegrityError`, never a TypeError from deep inside."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if isinstance(tree, dict):
        return _unflatten_node(tree, tensors)
    return tree


def _unflatten_node(node: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    """A tagged node: a tensor, a dict, a tuple or a non-finite float."""
    if "__tensor__" in node:
        name = node["__tensor__"]
        if not isinstance(name, str) or name not in tensors:
            raise IntegrityError(f"checkpoint metadata names tensor {name!r}, not in the file")
        return tensors[name]
    if "__dict__" in node:
        items = node["__dict__"]
        if not isinstance(items, list) or not all(_is_item(i) for i in items):
            raise IntegrityError("checkpoint metadata has a malformed dict node")
        return {k: unflatten(v, tensors) for k, v in items}
    if "__tuple__" in node:
        if not isinstance(node["__tuple__"], list):
            raise IntegrityError("checkpoint metadata has a malformed tuple node")
        return tuple(unflatten(v, tensors) for v in node["__tuple__"])
    if "__float__" in node:
        text = node["__float__"]
        if text not in ("inf", "-inf", "nan"):
            raise IntegrityError(f"checkpoint metadata has a malformed float {text!r}")
        return float(text)
    raise IntegrityError(f"unknown node in checkpoint metadata: {sorted(node)[:5]}")


def declared(tree: Tree) -> dict[str, TensorSpec | None]:
    """The tensors a tree names, with the dtype and shape it records for each (None where
    an older tree recorded neither). Iterative, as the tree may be hostile and deep."""
    found: dict[str, TensorSpec | None] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict) and "__tensor__" in node:
            name = node["__tensor__"]
            if not isinstance(name, str):
                raise IntegrityError(f"checkpoint metadata names a tensor {name!r}")
            found[name] = _recorded(name, node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return found


def _recorded(name: str, node: dict[str, Any]) -> TensorSpec | None:
    if "dtype" not in node and "shape" not in node:
        return None
    dtype, shape = node.get("dtype"), node.get("shape")
    if (
        not isinstance(dtype, str)
        or dtype not in ITEMSIZE
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise IntegrityError(
            f"checkpoint metadata records tensor {name!r} as {dtype!r} of shape {shape!r}"
        )
    return TensorSpec(dtype, tuple(shape))


def _is_item(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2 and isinstance(item[0], int | str)


def _key(k: Any) -> Any:
    if isinstance(k, bool) or not isinstance(k, int | str):
        raise TypeError(f"cannot checkpoint a dict key of type {type(k).__name__}")
    return k
