"""The protocol and the policy that every layer shares: `CompressedArray` and its
default rules (`_base`), the one place a value may become dense (`_fallback`), the
rule registry (`_registry`), input checks (`_validate`), rule outputs built without
checks (`_unchecked`), the guard leaf against leafwise arithmetic (`_guard`), small
helpers for rules (`_lax`), and the helpers every layer uses on meshes, which import
no compressed type: named-axis operations (`_devices`), sharding types and linear
algebra on explicitly sharded operands (`_sharding`), its eigendecomposition and its
products at the highest precision with TPU lowerings that compile quickly (`_eigh`,
`_row_blocks`), and layouts of sharded buffers (`_layout`)."""
