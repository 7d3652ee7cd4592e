"""Dispatch: running an admitted request on engines (colocated or disaggregated) and streaming its deltas back."""
