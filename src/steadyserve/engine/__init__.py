"""The engine: Sequence -> Scheduler -> BlockManager -> ModelRunner -> Sampler.

Pure-Python parts (sequence, block_manager, scheduler, detokenizer, stop) import no
torch, so they can be tested alone.
"""
