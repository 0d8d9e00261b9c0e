"""moe_comm inside the frameworks people train with: ``moe_comm.integrations.torchtitan`` and
``moe_comm.integrations.megatron`` (each imports its framework only when used)."""
