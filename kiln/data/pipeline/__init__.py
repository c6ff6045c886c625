"""The pre-training data pipeline: sources -> per-document stages -> dedup -> mix -> token shards.

The stage folders are in pipeline order: read/ (formats, WARC, HTML extraction), filter/
(normalise, language, PII, quality rules), dedup/ (exact, MinHash, near, partitioned),
decontaminate/ (eval-set n-grams), mix/ (copies per document, survivors, the dataset writer).
Here at the top: the config, the runner and its executors, the per-file tasks and the global
stages, the intermediate records, the audit trail and the reports.
"""
