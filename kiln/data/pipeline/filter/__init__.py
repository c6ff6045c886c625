"""Per-document filters and rewrites: normalisation, language, PII, the C4 / FineWeb / Gopher quality rules."""
