"""A target sharded over several processes (mlx.core.distributed): rank 0's engine, the other
ranks' follower, the mirrored caches."""
