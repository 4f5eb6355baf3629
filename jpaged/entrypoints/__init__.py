"""Layer 1, entry points: how people use jpaged.

`LLM` (generate / chat, for scripts and notebooks) and the `jpaged` command line (`cli`: generate,
convert); the OpenAI-compatible server is to come here. They build an `LLMEngine` and drive it;
they may import every layer below.
"""
