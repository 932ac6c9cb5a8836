"""tierkv's bundled paged-attention inference engine.

Import-light on purpose: ``import engine`` pulls in nothing heavy (no torch). Use the
submodules: ``engine.llm.LLMEngine``, ``engine.async_engine.AsyncEngine``,
``engine.kv_connector``, ``engine.cli``.
"""
