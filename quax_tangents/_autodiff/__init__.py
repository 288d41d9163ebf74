"""The autodiff entry points and the rules that carry compressed values through JAX's
transformations: `jvp`, `vjp`, `grad` and friends (`_ad`, with their argument checks
in `_arguments`), forward gradients (`_forward`), rules for `jit`, `checkpoint`,
`cond` and `scan` (`_control`), and the `shard_map` hook that quax lacks
(`_shard_map`). The construction primitives `compress` and `materialise` live in
`_types._primitives`, below the marks that use them."""
