"""``kvledger serve``'s app and drain around the fake engine, as a process on loopback.

Usage: ``python serve_fake.py PORT [--step-delay-s S] [--max-model-len N] [--fail-every K]
[--api-key KEY ...] [--api-keys-file FILE] [--admin-api-key KEY] [--state-db FILE]
[limit=value ...]``.
``--fail-every K`` makes every K-th engine step raise (an injected engine fault). Keys are read
as ``kvledger serve`` reads them. Limits are :class:`ServerLimits` fields (``send_timeout_s=1``).
The engine has the session fakes' chat template, so ``/v1/responses`` serves too.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))

from session_fakes import ChatFakeEngine

from kvledger.server.app import create_app
from kvledger.server.auth.api_keys import read_api_keys
from kvledger.server.lifecycle import DrainingServer
from kvledger.server.limits.connection import uvicorn_config
from kvledger.server.limits.server_limits import ServerLimits
from kvledger.sessions.service import SessionOptions

BIG = 8192


class FaultyEngine(ChatFakeEngine):
    """Raises in every ``fail_every``-th step (0 = never); ``big:`` prompts get big tokens."""

    def __init__(self, fail_every: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_every, self.steps = fail_every, 0

    def step(self):
        self.steps += 1
        if self.fail_every and self.steps % self.fail_every == 0:
            raise RuntimeError(f"injected fault at step {self.steps}")
        outs = super().step()
        for out in outs:
            if out.prompt_token_ids[:4] == [ord(c) for c in "big:"]:
                out.new_text *= BIG
        return outs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--api-key", action="append", default=[])
    parser.add_argument("--api-keys-file")
    parser.add_argument("--admin-api-key", action="append", default=[])
    parser.add_argument("--state-db", default=":memory:")
    parser.add_argument("limits", nargs="*")
    args = parser.parse_intermixed_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = FaultyEngine(args.fail_every, step_delay_s=args.step_delay_s)
    engine.max_model_len = args.max_model_len
    limits = ServerLimits(**{k: (int(v) if v.isdigit() else float(v))
                             for k, v in (a.split("=") for a in args.limits)})
    keys = read_api_keys(args.api_key, args.api_keys_file, args.admin_api_key)
    app = create_app(engine, api_key=list(keys.keys), admin_api_key=list(keys.admin_keys),
                     limits=limits, log_interval_s=3600,
                     sessions=SessionOptions(state_db=args.state_db))
    config = uvicorn_config(app, "127.0.0.1", args.port, limits)
    state = app.state.server
    DrainingServer(config, state.drain, limits.drain_timeout_s, state.loop.stop).run()


if __name__ == "__main__":
    main()
