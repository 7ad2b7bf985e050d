"""Why a stored entry could not be used. Both read as misses; only damaged entries are deleted."""


class KVStoreError(Exception):
    """Base of the store's own errors."""


class CorruptEntryError(KVStoreError):
    """A stored entry that cannot be trusted (checksum, fingerprint, shape or size mismatch)."""


class EntryLostError(KVStoreError):
    """An entry that vanished mid-read (evicted, expired) or whose tier became unreachable."""
