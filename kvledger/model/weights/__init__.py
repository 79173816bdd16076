"""A model's weights and tokenizer from a GGUF file or a Hugging Face folder (:mod:`.loader`),
GGUF tensors dequantized and renamed to Hugging Face names (:mod:`.gguf_tensors`), every
family's names brought to one naming (:mod:`.names`)."""

LOAD_FORMATS = ("auto", "dummy")
"""Where the weights come from: the checkpoint, or seeded ones at its shapes (:mod:`.dummy`)."""
