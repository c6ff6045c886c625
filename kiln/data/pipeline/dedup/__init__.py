"""Deduplication: exact keys, MinHash band keys, near-duplicate clusters, partitioned on-disk clustering."""
