"""The compressed types, one module per type holding the type and every rule it
registers (`lowrank/` is a folder: the type, its compressor, its rules; `sparse`,
`quantized`, `signnorm`, `rows`, `outer`, and the blocked layout they share,
`_blocked`), and the construction primitives `compress` and `materialise`
(`_primitives`)."""
