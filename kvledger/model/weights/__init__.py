"""A model's weights and tokenizer from a GGUF file or a Hugging Face folder (:mod:`.loader`),
GGUF tensors dequantized and renamed to Hugging Face names (:mod:`.gguf_tensors`)."""
