"""The planner: communication / compute / memory model and ranking of grid configurations."""

from par4d.plan.collectives import bandwidths, ring_time
from par4d.plan.cost import VARIANTS, Prediction, factorizations, predict, rank_configurations
from par4d.plan.machines import BUILTIN, Machine, load_machine
from par4d.plan.workload import GPT_MODELS, GPTSpec, Layer, gpt_spec, layers_from_module

__all__ = ["BUILTIN", "GPT_MODELS", "GPTSpec", "Layer", "Machine", "Prediction", "VARIANTS", "bandwidths",
           "factorizations", "gpt_spec", "layers_from_module", "load_machine", "predict", "rank_configurations",
           "ring_time"]
