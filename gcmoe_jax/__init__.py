"""gcmoe_jax: the GC-MoE expert-parallel Mixture-of-Experts decode operator as a JAX op.

    import gcmoe_jax as gm
    w = gm.quantize_experts(w13, w2)               # w13 [E, H, 2I], w2 [E, I, H]
    y = gm.moe(x, w, gm.Routes(ids, weights))       # x [T, H] bf16 -> y [T, H] bf16
"""

from gcmoe_jax.api import BACKENDS as BACKENDS
from gcmoe_jax.api import Explanation as Explanation
from gcmoe_jax.api import MAX_TOP_K as MAX_TOP_K
from gcmoe_jax.api import Routes as Routes
from gcmoe_jax.api import Support as Support
from gcmoe_jax.api import explain as explain
from gcmoe_jax.api import moe as moe
from gcmoe_jax.formats import ExpertWeights as ExpertWeights
from gcmoe_jax.formats import SharedWeights as SharedWeights
from gcmoe_jax.formats import dequantize_experts as dequantize_experts
from gcmoe_jax.formats import from_mxfp4 as from_mxfp4
from gcmoe_jax.formats import quantize_experts as quantize_experts
from gcmoe_jax.formats import to_mxfp4 as to_mxfp4
from gcmoe_jax.sharding import release_fused_workspaces as release_fused_workspaces

__version__ = "0.1.0"
