"""Expert parallelism (DESIGN §6): the shard_map body, the partitioned entry point and the collective transport.

Mesh axis ``ep`` (any name) of R ranks; E experts, L = E/R per rank: global expert id g lives on rank ``g // L`` as
local expert ``g % L``. Tokens are split over the same axis. See docs/expert_parallel.md.
"""

from gcmoe_jax.sharding._body import EPStats as EPStats
from gcmoe_jax.sharding._body import LocalFn as LocalFn
from gcmoe_jax.sharding._body import moe_shard_map_body as moe_shard_map_body
from gcmoe_jax.sharding._body import moe_shard_map_body_with_stats as moe_shard_map_body_with_stats
from gcmoe_jax.sharding._partitioned import moe_partitioned as moe_partitioned
from gcmoe_jax.sharding._partitioned import moe_partitioned_with_stats as moe_partitioned_with_stats
from gcmoe_jax.sharding._peers import release_fused_workspaces as release_fused_workspaces
from gcmoe_jax.sharding._specs import expert_shardings as expert_shardings
from gcmoe_jax.sharding._specs import expert_specs as expert_specs
from gcmoe_jax.sharding._transport import TRANSPORTS as TRANSPORTS

__all__ = [
  "TRANSPORTS",
  "EPStats",
  "LocalFn",
  "expert_shardings",
  "expert_specs",
  "moe_partitioned",
  "moe_partitioned_with_stats",
  "moe_shard_map_body",
  "moe_shard_map_body_with_stats",
  "release_fused_workspaces",
]
