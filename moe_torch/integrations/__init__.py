"""Integrations of moe_torch backends into other libraries."""
