"""Evaluation: loss, perplexity and bits-per-byte; multiple-choice tasks; an lm-eval adapter.

`kiln eval MODEL --tasks ...` is the command (kiln/eval/cli.py); the pieces are usable alone:
`tasks` loads the task files, `scoring` turns (context, continuation) pairs into log-probs,
`multiple_choice` and `lm` compute the metrics, `report` writes JSON and prints the table.
"""
