from shared.store.base import Store, open_store

__all__ = ["Store", "open_store"]
