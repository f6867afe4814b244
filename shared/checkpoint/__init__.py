"""The checkpoint: its files and tensors (`files`, `tensors`), the object store (`store`),
the write-once commit through a manifest (`commit`), retention and garbage (`retention`),
and the weights digest (`digest`)."""
