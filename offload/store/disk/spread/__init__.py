"""One store over several drives: `store.py` (`SpreadStore`, the store over them), `drives.py`
(the drives: placement by rendezvous order, each drive's health and its monitor)."""

from offload.store.disk.spread.store import SpreadStore

__all__ = ["SpreadStore"]
