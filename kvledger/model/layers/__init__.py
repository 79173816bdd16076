"""The layers the families compose: self-attention's projections with their options
(:mod:`.attention`: q / k norms, biases, sinks), rotary embeddings (:mod:`.rotary`: Llama's
halves with linear / Llama-3 / LongRoPE / YaRN scaling, DeepSeek's interleaved pairs), routed
experts and their routers (:mod:`.experts`), multi-head latent attention
(:mod:`.latent_attention`), Linears from a checkpoint's tensors (:mod:`.linears`), and the
decoders built of them (:mod:`.decoder`, :mod:`.latent_decoder`). The norms and gated
activations are the device's fused ops (``kvledger.model.ops``)."""
