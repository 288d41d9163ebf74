"""Compressed values across devices: all-reduces (`_collective`), the two-phase
all-reduce and reduce-scatter (`_scatter`), the choice between them (`_schedule`),
the bytes a compiled program's collectives move (`_hlo`), and the helpers they share
with the rest of the package, which import no compressed type: named-axis operations
(`_devices`) and linear algebra on explicitly sharded operands (`_sharding`)."""
