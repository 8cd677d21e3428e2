"""Tool-call parsing for the OpenAI chat API (upstream's ``sglang.srt.function_call``)."""
