"""Data: token shards (writer, reader, manifest) and the resumable training loader."""

from kiln.data.loader import Batch, Loader, LoaderCursor
from kiln.data.manifest import Manifest
from kiln.data.shard_reader import Dataset, Split

__all__ = ["Batch", "Dataset", "Loader", "LoaderCursor", "Manifest", "Split"]
