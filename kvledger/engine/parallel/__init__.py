"""Tensor parallelism over torch.distributed: the model split over ranks (:mod:`.shard`,
:mod:`.rank_model`), their collectives (:mod:`.group`), the broadcast step (:mod:`.runner`),
and how the ranks start and stop (:mod:`.launch`, :mod:`.worker`)."""
