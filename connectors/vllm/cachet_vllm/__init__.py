"""Cachet's KV connector for vLLM (see connector.py)."""
