"""A state mixer (:mod:`.state`) in the decoder's place of a layer's attention block: it takes
the step's ``StepState`` from the attention metadata (``AttentionMetadata.state``, built by
the engine's runner over its state slots), gathers the layer's state, runs the mixer's
``forward(x, state, meta)`` and scatters the state back."""

from __future__ import annotations

import torch

from kvledger.model.linear import Linear


class StateBlock:
    """Layer ``index``'s state mixer called as an attention block (module docstring)."""

    def __init__(self, mixer) -> None:
        self.mixer = mixer

    def __call__(self, index: int, x: torch.Tensor, positions: torch.Tensor, backend, meta,
                 store) -> torch.Tensor:
        step = meta.state
        state = step.gather(index)
        out = self.mixer.forward(x, state, step.meta)
        step.scatter(index, state)
        return out

    def backend_params(self, how):
        """The attention backend's parameters of this layer: unused, as the engine set them."""
        return how

    def linears(self, shape_class: str) -> list[Linear]:
        return self.mixer.linears(shape_class)

    @property
    def decode_bytes(self) -> int:
        return self.mixer.decode_bytes

    @property
    def held_bytes(self) -> int:
        return self.mixer.held_bytes
