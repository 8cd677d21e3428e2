"""Parsers of model output for the OpenAI chat API (upstream's ``sglang.srt.parser``)."""
