"""Loading a model's weights and tokenizer from a GGUF file or a Hugging Face folder."""
