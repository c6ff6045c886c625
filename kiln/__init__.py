"""kiln: raw text to a trained, evaluated, servable language model, every step built here."""

__version__ = "0.1.0"
