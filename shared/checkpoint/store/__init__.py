from shared.checkpoint.store.base import Store, open_store

__all__ = ["Store", "open_store"]
