"""Mixing and output: copies per document to reach each source's target, the survivors, the dataset writer."""
