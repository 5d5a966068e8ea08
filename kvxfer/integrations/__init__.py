"""Integrations of kvxfer into other inference engines (vLLM). Nothing in kvxfer imports these."""
