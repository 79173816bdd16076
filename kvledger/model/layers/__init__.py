"""The layers the families compose: two attention blocks, self-attention with its options
(:mod:`.attention`: q / k norms per head or over the whole projection, biases, sinks) and
multi-head latent attention (:mod:`.latent_attention`); rotary embeddings (:mod:`.rotary`:
Llama's halves with linear / Llama-3 / LongRoPE / YaRN scaling, DeepSeek's interleaved pairs);
two MLP blocks, the gated MLP (:mod:`.mlp`) and routed experts with their routers and shared
experts (:mod:`.experts`); Linears from a checkpoint's tensors (:mod:`.linears`); and the
decoder that composes them per layer as the spec says (:mod:`.decoder`). The norms and gated
activations are the device's fused ops (``kvledger.device.ops``)."""


def plain_decoder() -> type:
    """The plain :class:`.decoder.Decoder`, imported when called: the ``model`` factory of a
    family whose spec's options cover it (a family module imports no torch at module level)."""
    from kvledger.model.layers.decoder import Decoder

    return Decoder
