"""Weight formats and transforms applied to a loaded model: int8/int4 weight-only quantization."""
