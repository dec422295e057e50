"""The engine. One step (LLMEngine.step): Scheduler.schedule -> ModelRunner.execute -> BatchSampler.sample ->
OutputProcessor.process -> Scheduler.update.

Pure-Python parts (sequence, block_manager, scheduler, speculation, ngram, detokenizer, stop) import no
torch, so they can be tested alone.
"""
