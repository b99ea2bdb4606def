"""Token datastores for retrieval drafting: suffix-array indexes over token corpora (see `store.py`)."""

from hf_spec.datastore.index import Matches, TokenIndex, scan_search
from hf_spec.datastore.store import (
    Datastore,
    DatastoreRecipe,
    build_datastore,
    get_datastore,
    load_datastore,
    save_datastore,
)

__all__ = [
    "Datastore",
    "DatastoreRecipe",
    "Matches",
    "TokenIndex",
    "build_datastore",
    "get_datastore",
    "load_datastore",
    "save_datastore",
    "scan_search",
]
