"""The Azure LLM inference trace importer, on a sample written here.

The real files (Azure/AzurePublicDataset, AzureLLMInferenceDataset2023) have the columns
TIMESTAMP, ContextTokens, GeneratedTokens with timestamps like ``2023-11-16 18:15:46.6805900``;
the rows below are made up in that shape.
"""

from __future__ import annotations

import pytest

from kvledger.replay.azure import read_azure
from kvledger.replay.trace import TraceError

SAMPLE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.1000000,879,0
"""


def test_rows_become_requests_relative_to_the_first(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(SAMPLE)
    trace = read_azure(path)
    got = [(round(r.arrival_s, 6), r.prompt_tokens, r.output_tokens, r.max_tokens)
           for r in trace.requests]
    # 18:15:46.680590 is the origin; 47.1 - 46.68059 = 0.41941; 50.995169 - 46.68059 = 4.314579
    assert got == [(0.0, 374, 44, 44), (0.41941, 879, 0, 1), (4.314579, 396, 109, 109)]
    assert trace.header["source"] == "azure"
    assert len(read_azure(path, max_requests=2).requests) == 2


def test_bad_rows_and_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(TraceError, match="no column GeneratedTokens"):
        read_azure(path)
    path.write_text(SAMPLE + "2023-11-16 18:16:00,lots,3\n")
    with pytest.raises(TraceError, match="bad.csv:5: bad row"):
        read_azure(path)
