"""Byte-level BPE: train on a corpus, encode and decode, read and write tokenizer files."""

from kiln.tokenizer.patterns import NAMED_PATTERNS, SplitPattern, resolve_pattern
from kiln.tokenizer.tokenizer import Tokenizer
from kiln.tokenizer.train import train_bpe

__all__ = ["NAMED_PATTERNS", "SplitPattern", "Tokenizer", "resolve_pattern", "train_bpe"]
