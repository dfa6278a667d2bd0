"""Model building blocks over the kernels: norms, the Mamba2 mixer, paged attention, MLPs, rotary.

Every layer gets the `Kernels` bundle at construction and, if it keeps state between steps, its
decoder-layer index, with which it fetches its own views of the CachePool.
"""

from pd_ssm.layers.attention import Attention
from pd_ssm.layers.mixer2 import Mamba2Mixer
from pd_ssm.layers.mlp import MLP, GatedMLP
from pd_ssm.layers.norm import GatedRMSNorm, RMSNorm
from pd_ssm.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "GatedMLP", "GatedRMSNorm", "MLP", "Mamba2Mixer", "RMSNorm", "RotaryEmbedding"]
