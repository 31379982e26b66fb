"""Layers of the 3D tensor-parallel grid (Algorithm 1 and its kin)."""

from par4d.nn.attention import CausalSelfAttention
from par4d.nn.base import ShardedModule, full_state_dict, load_full_state_dict
from par4d.nn.batchnorm import BatchNorm
from par4d.nn.conv import Conv2d
from par4d.nn.embedding import Embedding
from par4d.nn.linear import Linear
from par4d.nn.loss import vocab_parallel_cross_entropy
from par4d.nn.moe import MoE, ReferenceMoE
from par4d.nn.norm import LayerNorm, RMSNorm

__all__ = ["BatchNorm", "CausalSelfAttention", "Conv2d", "Embedding", "LayerNorm", "Linear", "MoE", "RMSNorm",
           "ReferenceMoE", "ShardedModule", "full_state_dict", "load_full_state_dict", "vocab_parallel_cross_entropy"]
