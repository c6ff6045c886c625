"""What a filter task leaves for the global stages: its row files, reason codes and excerpt size.

Filter tasks write these and the global stages read them, so both import the names from here.
"""

EXACT_ROWS = "exact_rows"  # the task's exact keys and near-dedup band keys, hash-sliced
NEAR_ROWS = "near_rows"
LINE_ROWS = "line_rows"  # (unit key, node) per distinct line or paragraph of a document
EXCERPT_CHARS = 600
# Why a document that reached decontamination is dropped there (0: kept).
DECONTAM_CODES = ("", "decontaminate.too_many_pieces", "decontaminate.empty")
