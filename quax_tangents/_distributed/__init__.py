"""Compressed values across devices: all-reduces (`_collective`), the two-phase
all-reduce and reduce-scatter (`_scatter`), the choice between them (`_schedule`),
and the bytes a compiled program's collectives move (`_hlo`). The named-axis and
sharding helpers they build on live in `_core`, since the types use them too."""
