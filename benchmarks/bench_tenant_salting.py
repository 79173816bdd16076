"""What salting the prefix cache per API key costs in hits on a shared-system-prompt workload.

Every API key sends ``--requests`` chat requests with one common system prompt (``--system``
tokens of real text) and a distinct user question, round-robin over the keys, through the
server app on the bundled model (one token generated each). The same workload runs with each
key salted apart (the default) and with ``--share-prefix-cache-across-keys``; the figures are
counts of prompt and cached tokens from the responses' ``usage`` (no timing, so no quiet
machine needed). Expected: salting loses the system prompt's whole blocks once per key after
the first, ``(keys - 1) * floor(system / block) * block`` cached tokens.

Usage: python benchmarks/bench_tenant_salting.py [--keys 1,4,16] [--requests 8] [--system 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import real_text_ids


def run(model, keys: int, requests: int, system: str, share: bool) -> dict[str, int]:
    """Prompt and cached tokens of the workload on a fresh engine and server."""
    from fastapi.testclient import TestClient

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.server.app import create_app

    engine = LLMEngine(EngineConfig(model="default", dtype="fp32", num_blocks=2048), *model)
    names = [f"key-{i}" for i in range(keys)]
    app = create_app(engine, api_key=names, share_prefix_cache_across_keys=share)
    prompt = cached = 0
    with TestClient(app) as client:
        for i in range(requests * keys):
            body = {"messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Question {i}: what is item {i}?"}],
                    "max_tokens": 1, "temperature": 0}
            r = client.post("/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {names[i % keys]}"})
            r.raise_for_status()
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
    return {"prompt": prompt, "cached": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="1,4,16")
    parser.add_argument("--requests", type=int, default=8, help="requests per key")
    parser.add_argument("--system", type=int, default=512, help="system prompt tokens")
    args = parser.parse_args()
    import torch

    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights("default", torch.float32)
    tokenizer = load_tokenizer("default")
    model = (spec, weights, tokenizer)
    system = tokenizer.decode(real_text_ids(tokenizer, args.system, offset=2000))
    print("| keys | requests | prompt tokens | cached, salted per key | cached, shared | "
          "hits lost to salting |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for keys in (int(k) for k in args.keys.split(",")):
        salted = run(model, keys, args.requests, system, share=False)
        shared = run(model, keys, args.requests, system, share=True)
        lost = shared["cached"] - salted["cached"]
        print(f"| {keys} | {keys * args.requests} | {salted['prompt']:,} | "
              f"{salted['cached']:,} ({salted['cached'] / salted['prompt']:.1%}) | "
              f"{shared['cached']:,} ({shared['cached'] / shared['prompt']:.1%}) | "
              f"{lost:,} ({lost / shared['prompt']:.1%} of prompt tokens) |")


if __name__ == "__main__":
    main()
