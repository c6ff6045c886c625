"""Synthetic data and LM annotation through kiln's engine: `kiln data synth generate|rewrite`
(TinyStories, WRAP) and `kiln data annotate` (FineWeb-Edu's LM-scored quality labels)."""
