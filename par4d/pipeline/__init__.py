"""The message-driven pipeline over the pipe axis (the async-pipeline paper's Algorithm 2).

* :mod:`par4d.pipeline.schedule`: a step's forward and backward over the stages, whichever
  message has arrived first (:func:`run_pipeline`), and evaluation (:func:`evaluate_pipeline`).
* :mod:`par4d.pipeline.inbox`: what a stage expects and which message it takes next.
* :mod:`par4d.pipeline.microbatches`: a shard cut into weighted microbatches (also the
  gradient accumulation of ``train_step`` without a pipeline).
"""

from par4d.pipeline.microbatches import split_microbatches, weighted_backward
from par4d.pipeline.schedule import PipelineStats, evaluate_pipeline, run_pipeline

__all__ = ["PipelineStats", "evaluate_pipeline", "run_pipeline", "split_microbatches", "weighted_backward"]
