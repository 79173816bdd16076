"""lm-eval through ``kvledger serve`` against lm-eval's in-process ``hf`` backend on the same
weights: accuracy, and each choice's log-likelihood, on the kvledger_mc task (this folder).

    python benchmarks/lm_eval/compare_backends.py --dtype fp32   # exact mode: equal accuracy
    python benchmarks/lm_eval/compare_backends.py                # default (bf16) mode

It starts ``kvledger serve --dtype DTYPE`` on a free loopback port, runs lm-eval's
``local-completions`` against it (the server's tokenizer through /tokenizer_info, /tokenize and
/detokenize; several prompts per request), runs lm-eval's ``hf`` backend on the bundled GGUF
loaded by transformers in fp32 (the reference), and prints both accuracies, the mean and max
|delta log-likelihood| over every (question, choice), and the issue's checks: equal accuracy in
fp32, mean |delta| <= 0.05 nats in the default mode. Needs ``pip install kvledger[lm-eval]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "kvledger_mc"
SERVED = "kvledger-mc"
MEAN_DELTA_LIMIT = 0.05  # nats, default mode (issue 44)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(dtype: str, port: int, log: Path, state_db: Path) -> subprocess.Popen:
    import httpx

    command = [sys.executable, "-m", "kvledger.cli", "serve", "--port", str(port),
               "--dtype", dtype, "--served-model-name", SERVED, "--state-db", str(state_db)]
    proc = subprocess.Popen(command, cwd=HERE.parents[1], stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvledger serve exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"kvledger serve did not start in 600 s; see {log}")


def _evaluate(model: str, model_args: dict, limit: int | None, batch_size: int) -> dict:
    """(doc_id, choice) -> log-likelihood, and the accuracy, of one lm-eval run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                  task_manager=TaskManager(include_path=str(HERE)),
                                  log_samples=True, limit=limit, batch_size=batch_size)
    samples = out["samples"][TASK]
    loglik = {(s["doc_id"], i): float(r[0]) for s in samples
              for i, r in enumerate(s["filtered_resps"])}
    return {"acc": out["results"][TASK]["acc,none"], "loglik": loglik,
            "picks": {s["doc_id"]: s["acc"] for s in samples}}


def compare(dtype: str = "bf16", limit: int | None = None, batch_size: int = 8,
            log: Path | None = None) -> dict:
    """Run both backends; the figures of the comparison."""
    from kvledger.paths import bundled_model_path

    gguf = bundled_model_path()
    port = _free_port()
    scratch = tempfile.TemporaryDirectory()  # the server's own conversation store
    server = _start_server(dtype, port, log or Path(os.devnull),
                           Path(scratch.name) / "state.sqlite3")
    try:
        served = _evaluate("local-completions", {
            "base_url": f"http://127.0.0.1:{port}/v1/completions", "model": SERVED,
            "tokenizer_backend": "remote", "tokenized_requests": True, "num_concurrent": 1,
            "max_retries": 1}, limit, batch_size)
    finally:
        server.terminate()
        server.wait(60)
        scratch.cleanup()
    reference = _evaluate("hf", {"pretrained": str(gguf.parent), "gguf_file": gguf.name,
                                 "dtype": "float32", "device": "cpu"}, limit, batch_size)
    deltas = [abs(served["loglik"][k] - reference["loglik"][k]) for k in reference["loglik"]]
    differ = sorted(d for d, acc in reference["picks"].items() if served["picks"][d] != acc)
    return {"dtype": dtype, "items": len(reference["picks"]), "choices": len(deltas),
            "acc_served": served["acc"], "acc_hf": reference["acc"],
            "mean_abs_delta": sum(deltas) / len(deltas), "max_abs_delta": max(deltas),
            "items_scored_differently": differ}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="the server's compute dtype (bf16: kvledger's default mode)")
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="prompts per /v1/completions request (and hf batch)")
    parser.add_argument("--server-log", type=Path, default=None)
    args = parser.parse_args()
    figures = compare(args.dtype, args.limit, args.batch_size, args.server_log)
    print(json.dumps(figures, indent=1))
    if args.dtype == "fp32":
        ok = figures["acc_served"] == figures["acc_hf"]
        print(f"accuracy equal in fp32: {'yes' if ok else 'NO'}")
    else:
        ok = figures["mean_abs_delta"] <= MEAN_DELTA_LIMIT
        print(f"mean |delta loglik| <= {MEAN_DELTA_LIMIT}: {'yes' if ok else 'NO'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
