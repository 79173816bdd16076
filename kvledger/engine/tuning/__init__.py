"""Tuning: the choices the engine makes by measuring on this machine (the top of the engine
folder, above the model's Linear formats and the engine's attention backends and KV stores,
which it times).

The device (``kvledger.device``) says what it has; the probe (:mod:`.probe`, timing in
:mod:`.timing`) measures those candidates for a model's shapes and caches the result; a
:class:`.tuned.TunedDevice` gives the engine and the model the choices (weight format per shape
class, GEMM path, fused-op row limits, attention backend) beside the device's kernels.
"""
