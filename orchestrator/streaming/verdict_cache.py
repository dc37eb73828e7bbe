"""Input verdicts kept per tenant (config `detection_cache`, DESIGN 4.5).

A chat client sends the whole conversation again every turn, and input detectors judge every
message of it (DESIGN 4.8): without a cache the 20th turn judges the 19 earlier messages again,
with exactly the replies the earlier turns got, so input detection grows with the history. This
keeps one detector's reply to one content, and `text_judgement` sends a detector only the
contents it has no reply for.

What a reply may be kept for is what it is a function of: the content, the detector (the client
object: a reload that rebuilds a detector builds a new one) and everything that can change its
reply: its config entry as loaded and the params sent. All of that is the `Fingerprint`; an entry
is keyed by a keyed BLAKE2b of the content's UTF-8 under it, never by the text. The replies are
kept compactly, a detection's `text` left out where it is the content's own slice (restored
from the content on a hit), so the cache holds no prompt text. Thresholds and actions are
applied after the cache as before: a hit is exactly the reply the detector gave.

Only a detector whose reply depends on nothing else may be kept (`DetectorClient.caches_verdicts`:
in-process built-ins; a remote service only when its config opts in; a judge never). Output is
not cached: a stream's chunks are new text.

Each tenant has a partition of its own: a hit on text another tenant sent would tell this one,
by its timing, that the text was sent. A partition is a bounded LRU (`max_entries_per_tenant`);
all partitions together are bounded too (`max_entries`): beyond it the largest partition gives
up its least recently used entry. Everything here runs on the event loop without awaiting
(hashing a large request's contents is done by the caller off the loop: `Lookup.keys`), so no
lock is needed; two requests that miss on the same text at once both ask the detector, and the
second reply stored is the same as the first.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from detectors.api import Detection

from ..clients.registry import RequestedDetector

# A reply with more detections than this for one content is not kept: such a content is rare
# (a list of addresses), and it would cost many entries' memory. Measured (tracemalloc): an
# entry without detections ~140 bytes, with one ~370; so at most ~1.5 KB an entry, and the
# default bounds (100,000 entries) hold ~14 MB of replies without detections, ~150 MB at worst.
MAX_KEPT_DETECTIONS = 8
DIGEST_BYTES = 32

# (start, end, text or None for content[start:end], detection, detection_type, score,
# evidence, metadata: each JSON bytes or None, so every hit gets dicts of its own that no
# request can change for the next one)
_Kept = tuple[int, int, str | None, str, str, float, bytes | None, bytes | None]
_Entry = tuple[str, tuple[_Kept, ...]]  # (detector_id, the reply)

# (detector_id, hits, misses) of one lookup; (detector_id) of one eviction
LookupRecorder = Callable[[str, int, int], None]
EvictionRecorder = Callable[[str], None]


def _ignore_lookup(detector_id: str, hits: int, misses: int) -> None:
    return None


def _ignore_eviction(detector_id: str) -> None:
    return None


class LruPartition:
    """One tenant's entries, least recently used first."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        """Least recently used first (tests)."""
        return list(self._entries)

    def get(self, key: bytes) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: _Entry) -> list[_Entry]:
        """Stores `entry` as the most recently used; what the bound pushed out."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.max_entries:
            evicted.append(self.pop_oldest())
        return evicted

    def pop_oldest(self) -> _Entry:
        return self._entries.popitem(last=False)[1]


@dataclass
class VerdictCache:
    """Every tenant's partition. `on_lookup` and `on_evict` feed the metrics."""

    max_entries_per_tenant: int
    max_entries: int
    on_lookup: LookupRecorder = _ignore_lookup
    on_evict: EvictionRecorder = _ignore_eviction
    _partitions: dict[str, LruPartition] = field(default_factory=dict)
    _size: int = 0
    # a salt per detector client: a rebuilt detector (a reload) never meets an old entry, and
    # its config entry's hash is computed once
    _clients: weakref.WeakKeyDictionary[Any, bytes] = field(
        default_factory=weakref.WeakKeyDictionary
    )

    def __len__(self) -> int:
        return self._size

    def partition(self, tenant_id: str) -> LruPartition | None:
        return self._partitions.get(tenant_id)

    def tenant(self, tenant_id: str) -> TenantVerdicts:
        """What one request of `tenant_id` looks up and stores in."""
        return TenantVerdicts(self, tenant_id)

    def retain(self, tenant_ids: Iterable[str]) -> None:
        """Drops the partitions of tenants no longer configured (a reload)."""
        keep = set(tenant_ids)
        for tenant_id in [t for t in self._partitions if t not in keep]:
            self._size -= len(self._partitions.pop(tenant_id))

    def fingerprint(self, detector: RequestedDetector) -> bytes:
        """The key of a content's hash: this client (its salt), its config entry as loaded and
        the params sent. Params that cannot be encoded canonically give a fresh salt (a miss,
        never a wrong hit)."""
        client = detector.client
        salt = self._clients.get(client)
        if salt is None:
            config = orjson.dumps(
                client.config.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS
            )
            salt = self._clients[client] = hashlib.blake2b(
                os.urandom(16) + client.detector_id.encode() + b"\0" + config,
                digest_size=DIGEST_BYTES,
            ).digest()
        try:
            params = orjson.dumps(detector.params, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            params = os.urandom(16)
        return hashlib.blake2b(salt + params, digest_size=DIGEST_BYTES).digest()

    def _get(self, tenant_id: str, key: bytes) -> _Entry | None:
        partition = self._partitions.get(tenant_id)
        return None if partition is None else partition.get(key)

    def _put(self, tenant_id: str, key: bytes, entry: _Entry) -> None:
        partition = self._partitions.get(tenant_id)
        if partition is None:
            partition = self._partitions[tenant_id] = LruPartition(self.max_entries_per_tenant)
        before = len(partition)
        evicted = partition.put(key, entry)
        self._size += len(partition) - before
        while self._size > self.max_entries:
            largest = max(self._partitions.values(), key=len)
            evicted.append(largest.pop_oldest())
            self._size -= 1
        for detector_id, _ in evicted:
            self.on_evict(detector_id)


@dataclass(frozen=True)
class TenantVerdicts:
    """The cache as one tenant's request sees it."""

    cache: VerdictCache
    tenant_id: str

    def lookup(self, detector: RequestedDetector) -> Lookup | None:
        """None: this detector's verdicts are not kept."""
        if not detector.client.caches_verdicts:
            return None
        return Lookup(self, detector.detector_id, self.cache.fingerprint(detector))


@dataclass(frozen=True)
class Lookup:
    """One detector's lookups in one request."""

    verdicts: TenantVerdicts
    detector_id: str
    fingerprint: bytes

    def keys(self, contents: list[str]) -> list[bytes]:
        """The contents' keys: pure, so a large request computes them off the loop."""
        return [
            hashlib.blake2b(
                c.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES, key=self.fingerprint
            ).digest()
            for c in contents
        ]

    def get(self, keys: list[bytes], contents: list[str]) -> list[list[Detection] | None]:
        """The kept reply of each content, None where there is none."""
        cache, tenant_id = self.verdicts.cache, self.verdicts.tenant_id
        out: list[list[Detection] | None] = []
        for key, content in zip(keys, contents, strict=True):
            entry = cache._get(tenant_id, key)
            out.append(None if entry is None else [_restored(k, content) for k in entry[1]])
        hits = sum(r is not None for r in out)
        cache.on_lookup(self.detector_id, hits, len(out) - hits)
        return out

    def put(self, key: bytes, content: str, reply: list[Detection]) -> None:
        if len(reply) > MAX_KEPT_DETECTIONS:
            return
        kept = tuple(_kept(d, content) for d in reply)
        self.verdicts.cache._put(self.verdicts.tenant_id, key, (self.detector_id, kept))


def _kept(d: Detection, content: str) -> _Kept:
    text = None if d.text == content[d.start : d.end] else d.text
    return (
        d.start,
        d.end,
        text,
        d.detection,
        d.detection_type,
        d.score,
        None if d.evidence is None else orjson.dumps(d.evidence),
        None if d.metadata is None else orjson.dumps(d.metadata),
    )


def _restored(k: _Kept, content: str) -> Detection:
    start, end, text, detection, detection_type, score, evidence, metadata = k
    return Detection(
        start=start,
        end=end,
        text=content[start:end] if text is None else text,
        detection=detection,
        detection_type=detection_type,
        score=score,
        evidence=None if evidence is None else orjson.loads(evidence),
        metadata=None if metadata is None else orjson.loads(metadata),
    )
