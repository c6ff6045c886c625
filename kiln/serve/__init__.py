"""Serving: the inference engine, the OpenAI-compatible HTTP server and the Storyteller page."""
