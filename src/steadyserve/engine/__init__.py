"""The engine: Sequence -> Scheduler -> BlockManager -> ModelRunner -> Sampler.

Pure-Python parts (sequence, block_manager, scheduler, detokenizer) import no
torch, so they can be tested alone.
"""
