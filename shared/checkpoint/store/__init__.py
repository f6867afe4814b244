from shared.checkpoint.store.base import Store
from shared.checkpoint.store.factory import open_store

__all__ = ["Store", "open_store"]
