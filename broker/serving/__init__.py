"""Endpoints: replicas of a model served behind one OpenAI-compatible API; the router, the
per-key request shares, the autoscaler and the OpenAI routes."""
