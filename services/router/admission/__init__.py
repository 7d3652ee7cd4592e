"""Admission: API keys, rate limits, the bounded priority queue and the TTFT estimate behind it."""
