"""Sampling: a step's logits to tokens. The request's parameters (``sampling_params.py``), the
batched logit processing (``penalties.py``), grammar masks of structured output
(``structured/``), the sampler itself (``sampler.py``) and prompt logprobs
(``prompt_logprobs.py``). vLLM: ``v1/sample/``."""
