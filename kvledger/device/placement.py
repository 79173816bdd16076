"""Placing a built object's tensors on a device: :func:`place` moves every tensor an object
holds (its attributes, and theirs, through lists, tuples and dicts) to a torch device, in
place. The engine places a model built on the CPU on its device's memory this way (the model
is plain objects, not ``torch.nn.Module``: this is its ``.to(device)``). A tensor or object held
twice (a tied LM head and embedding) is moved once and stays shared.
"""

from __future__ import annotations

import torch

OWN = "kvledger."
"""Objects of classes from this package are walked; any other object (a function, a module,
a library's object) is left as it is."""


def place(root: object, device: torch.device) -> None:
    """Move every tensor ``root`` holds to ``device``, in place (the module docstring)."""
    moved: dict[int, torch.Tensor] = {}
    walked: set[int] = set()

    def go(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in moved:
                moved[id(x)] = x.to(device)
            return moved[id(x)]
        if isinstance(x, (list, dict)) or (type(x).__module__ or "").startswith(OWN):
            if id(x) in walked:
                return x
            walked.add(id(x))
        if isinstance(x, list):
            x[:] = [go(v) for v in x]
        elif isinstance(x, dict):
            for k, v in x.items():
                x[k] = go(v)
        elif isinstance(x, tuple):
            items = [go(v) for v in x]
            if any(a is not b for a, b in zip(items, x)):
                return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
        elif (type(x).__module__ or "").startswith(OWN) and hasattr(x, "__dict__"):
            for k, v in list(vars(x).items()):
                new = go(v)
                if new is not v:
                    object.__setattr__(x, k, new)
        return x

    go(root)
