"""Nested training state (RNG states, optimizer state, counters) in one safetensors file, no pickle.

Checkpoints are files a user may download or receive, so reading one must not run code: pickle
(``torch.load(weights_only=False)``) runs whatever the file says. Here tensors go into a
safetensors file and everything around them (dicts, lists, tuples, numbers, strings, NumPy arrays)
into a JSON skeleton in the same file's metadata. Reading parses JSON and raw tensor bytes only.

Supported values: ``dict`` (any str/int/float/bool/None keys), ``list``, ``tuple``, ``int``,
``float`` (incl. inf/nan), ``str``, ``bool``, ``None``, ``torch.Tensor``, ``numpy.ndarray``.
Anything else is refused when saving, so a checkpoint never holds what it cannot give back.
"""

from __future__ import annotations

import json
import os
from typing import Any

SKELETON_KEY = "skyrl_state"
_TAG = "__skyrl__"  # marks an encoded non-JSON value in the skeleton


class StateFileError(ValueError):
    """A state file that is not one (tampered, truncated, or from another program)."""


def save_state(path: str, state: Any) -> None:
    """Write ``state`` to ``path`` (a safetensors file)."""
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, "state")
    save_file(tensors, path, metadata={SKELETON_KEY: json.dumps(skeleton)})


def load_state(path: str) -> Any:
    """What ``save_state`` wrote to ``path``; ``StateFileError`` if it is not such a file."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise StateFileError(f"{path}: missing")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise StateFileError(f"{path}: not a safetensors state file ({exc})") from None
    if SKELETON_KEY not in metadata:
        raise StateFileError(f"{path}: a safetensors file without skyrl state (no {SKELETON_KEY!r} metadata)")
    try:
        return _decode(json.loads(metadata[SKELETON_KEY]), tensors)
    except (ValueError, KeyError, TypeError) as exc:
        raise StateFileError(f"{path}: malformed skyrl state ({exc})") from None


def _encode(value: Any, tensors: dict[str, Any], where: str) -> Any:
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return {_TAG: "float", "value": repr(value)} if isinstance(value, float) else int(value)
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        # safetensors refuses views of shared storage: store a compact copy
        tensors[name] = value.detach().cpu().contiguous().clone()
        return {_TAG: "tensor", "name": name}
    if isinstance(value, np.ndarray):
        name = f"t{len(tensors)}"
        wide = value.astype(np.int64) if value.dtype.kind in "ui" else value
        tensors[name] = torch.from_numpy(np.ascontiguousarray(wide)).clone()
        return {_TAG: "ndarray", "name": name, "dtype": value.dtype.str}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return {_TAG: "tuple", "items": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        pairs = [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]
        return {_TAG: "dict", "items": pairs}
    raise TypeError(f"{where}: cannot store a {type(value).__name__} in a state file")


def _decode(node: Any, tensors: dict[str, Any]) -> Any:
    import numpy as np

    if node is None or isinstance(node, (bool, str, int)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict) or _TAG not in node:
        raise ValueError(f"unexpected node {str(node)[:60]}")
    tag = node[_TAG]
    if tag == "float":
        return float(node["value"])
    if tag == "tensor":
        return tensors[node["name"]]
    if tag == "ndarray":
        dtype = np.dtype(node["dtype"])
        if dtype.kind not in "biuf":
            raise ValueError(f"array dtype {dtype} is not numeric")
        return tensors[node["name"]].numpy().astype(dtype)
    if tag == "tuple":
        return tuple(_decode(v, tensors) for v in node["items"])
    if tag == "dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node["items"]}
    raise ValueError(f"unknown tag {tag!r}")
