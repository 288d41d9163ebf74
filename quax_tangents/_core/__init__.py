"""The protocol and the policy that every layer shares: `CompressedArray` and its
default rules (`_base`), the one place a value may become dense (`_fallback`), the
rule registry (`_registry`), input checks (`_validate`), rule outputs built without
checks (`_unchecked`), the guard leaf against leafwise arithmetic (`_guard`), and
small helpers for rules (`_lax`)."""
