"""Serving: the inference engine, quantized weights, speculative decoding, the HTTP server."""
