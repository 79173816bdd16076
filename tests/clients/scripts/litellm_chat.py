"""LiteLLM's completion (the ``openai/`` provider prefix, api_base) against kvledger, whole and
streamed.

Usage: python litellm_chat.py BASE_URL MODEL (exit status 0 when every check holds)."""

import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
import litellm

base_url, model = sys.argv[1], sys.argv[2]
ask = [{"role": "user", "content": "What is the capital of France?"}]
r = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="none",
                       messages=ask, temperature=0, max_tokens=32)
text = r.choices[0].message.content
assert text and r.usage.completion_tokens > 0, r
chunks = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="none",
                            messages=ask, temperature=0, max_tokens=32, stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
assert streamed == text, (streamed, text)
print(repr(text))
