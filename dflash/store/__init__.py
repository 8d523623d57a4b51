"""The on-disk format of extracted states: manifest, shard writer, shard reader (design.md §3)."""

from dflash.store.layers import zlab_target_layer_ids
from dflash.store.reader import IncompleteStates, StateReader, StoredSample
from dflash.store.shards import CorruptShard

__all__ = ["StateReader", "StoredSample", "IncompleteStates", "CorruptShard", "zlab_target_layer_ids"]
