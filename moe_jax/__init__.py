"""moe_jax: MoE expert backends for JAX on the shared moe_shared contract."""
