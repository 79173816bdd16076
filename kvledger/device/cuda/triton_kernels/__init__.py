"""Our Triton kernels, one module per job: paged attention over block tables
(:mod:`.paged_attention`) and the KV codecs' encoders and decoders (:mod:`.kv_int`,
:mod:`.kv_fp8`). Each takes plain numbers and tensors, and importing a module defines its
kernels: set ``TRITON_INTERPRET=1`` before that to run them on CPU tensors."""
