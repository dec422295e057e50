"""Receipts: a response's proof of what computed it, replayable bit for bit (docs/reference/receipts.md).

format.py is the JSON format (built by the server in api/receipts.py, read by `steadyserve verify`);
replay.py loads a model offline and replays receipts through the engine.
"""
