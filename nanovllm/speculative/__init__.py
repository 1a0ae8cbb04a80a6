"""Speculative decoding's drafts: the config (vLLM's `speculative_config`) and the proposers that
guess a sequence's next tokens without a second model (n-gram prompt lookup, suffix decoding).
The engine verifies the drafts in one target step (engine/speculation.py)."""
