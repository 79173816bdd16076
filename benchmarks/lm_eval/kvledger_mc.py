"""The kvledger_mc task's data: the JSON lines beside this file, as a ``test`` split."""

from pathlib import Path


def load(**_):
    """A DatasetDict with the questions (lm-eval's ``custom_dataset`` hook)."""
    import datasets

    path = Path(__file__).with_name("kvledger_mc.jsonl")
    return datasets.load_dataset("json", data_files={"test": str(path)})
