"""Decontamination: n-gram overlaps with evaluation sets cut out of training documents."""
