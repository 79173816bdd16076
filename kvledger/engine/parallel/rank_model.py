"""The model one rank runs: its family's model over its share of the weights
(:mod:`.shard`), with the two row-split projections all-reduced and the LM head gathered.

Nothing in the forward pass changes: after the output projection and after down, each rank
holds a partial sum [T, hidden], and :class:`RowParallel` sums it over the ranks in place
(one all-reduce each, so 2 x layers per step), which makes the residual stream identical on
every rank. :class:`VocabParallelHead` computes this rank's ``ceil(vocab / tp)`` logits and
gathers them on rank 0, which cuts the zero-padded tail off.
"""

from __future__ import annotations

import torch

from kvledger.engine.model_load import build_model
from kvledger.engine.parallel.group import RankGroup
from kvledger.engine.parallel.shard import shard_spec, shard_weights
from kvledger.model.linear import Linear
from kvledger.spec import ModelSpec


class RowParallel:
    """A Linear whose input is split by columns: ``y = all_reduce(x_r @ W_r.T)``."""

    def __init__(self, linear: Linear, group: RankGroup) -> None:
        self.linear, self.group = linear, group

    @property
    def format(self) -> str:
        """The wrapped Linear's weight format."""
        return self.linear.format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in / tp] -> [tokens, out], summed over the ranks."""
        y = self.linear(x)
        self.group.all_reduce(y)
        return y


class VocabParallelHead:
    """The LM head split by vocabulary rows; the full logits exist on rank 0 only."""

    def __init__(self, linear: Linear, group: RankGroup, vocab_size: int) -> None:
        self.linear, self.group, self.vocab_size = linear, group, vocab_size

    @property
    def format(self) -> str:
        """The wrapped Linear's weight format."""
        return self.linear.format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab] on rank 0, [N, 0] on the other ranks."""
        local = self.linear(x).contiguous()
        parts = self.group.gather(local)
        if parts is None:
            return local[:, :0]
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


def build_rank_model(spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                     group: RankGroup, attention: str | None,
                     formats: dict[str, str] | None = None, device=None):
    """Rank ``group.rank``'s model of ``spec`` (the whole model's architecture) from the whole
    model's ``weights``, on ``device`` (a ``kvledger.engine.tuning.tuned.TunedDevice``).

    Raises:
        InvalidParameterError: the model does not split over ``group.world`` ranks.
        UnsupportedModelError: as :func:`kvledger.engine.model_load.build_model`.
    """
    tp = group.world
    model = build_model(shard_spec(spec, tp), shard_weights(weights, spec, tp, group.rank),
                        dtype, attention, formats, device)
    for layer in model.layers:
        layer["attn"].o = RowParallel(layer["attn"].o, group)
        layer["mlp"].down = RowParallel(layer["mlp"].down, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, spec.vocab_size)
    return model
