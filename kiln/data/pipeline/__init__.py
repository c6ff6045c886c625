"""The pre-training data pipeline: sources -> per-document stages -> dedup -> mix -> token shards."""
