"""Speculative decoding's Prometheus counters and request-log fields."""

from __future__ import annotations

import logging

from kvledger.engine.output.request_output import RequestMetrics, RequestOutput
from kvledger.server.metrics.observer import RequestObserver
from kvledger.server.metrics.server_metrics import ServerMetrics


def test_counters_follow_the_engine_totals_and_methods():
    m = ServerMetrics("m")
    m.update_from_stats({"spec_proposed_tokens": 10, "spec_accepted_tokens": 6,
                         "spec_proposed_tokens_ngram": 10, "spec_accepted_tokens_ngram": 6})
    m.update_from_stats({"spec_proposed_tokens": 15, "spec_accepted_tokens": 7,
                         "spec_proposed_tokens_ngram": 12, "spec_accepted_tokens_ngram": 6,
                         "spec_proposed_tokens_suffix": 3, "spec_accepted_tokens_suffix": 1})
    text = m.render().decode()
    assert 'kvledger:spec_proposed_tokens_total{model_name="m"} 15.0' in text
    assert 'kvledger:spec_accepted_tokens_total{model_name="m"} 7.0' in text
    assert ('kvledger:spec_method_proposed_tokens_total{method="ngram",model_name="m"} 12.0'
            in text)
    assert ('kvledger:spec_method_accepted_tokens_total{method="suffix",model_name="m"} 1.0'
            in text)


def test_the_request_log_line_has_the_acceptance(caplog):
    observer = RequestObserver(ServerMetrics("m"))
    track = observer.on_added("r1")
    out = RequestOutput("r1", [1, 2], token_ids=[3, 4, 5], new_token_ids=[3, 4, 5],
                        finished=True, finish_reason="length",
                        metrics=RequestMetrics(spec_proposed_tokens=8, spec_accepted_tokens=5))
    with caplog.at_level(logging.INFO, logger="kvledger.server"):
        observer.on_output(track, out, 1.0)
    assert "spec_proposed=8 spec_accepted=5" in caplog.text
