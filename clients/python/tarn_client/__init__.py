"""A small Python client for tarn.

    from tarn_client import Client
    client = Client("localhost:50051")
    client.create_collection("docs", dimension=384, metric="cosine")
    seq = client.insert("docs", doc_ids=[1, 2], vectors=np.random.rand(2, 384), user_ids=7)
    hits = client.search("docs", query, top_k=10, user_ids=7, min_seq_no=seq)

Ids are Python ints up to 2**128 - 1 (tarn's u128, sent as two u64 halves); vectors are numpy
arrays (or anything numpy can turn into float32). Errors are `grpc.RpcError` with tarn's status
codes (INVALID_ARGUMENT naming the field, NOT_FOUND, ALREADY_EXISTS, UNAVAILABLE, ...).

Filtered search: a collection declares typed fields (`fields={"section": "keyword", "tags":
"keywords", "size": "number", "free": "bool"}`), inserts carry one attributes dict per document
(`attributes=[{"section": "python", "tags": ["a", "b"], "size": 120}, ...]`), and searches and
removes take a `filter`:

    client.search("docs", query, filter={"section": {"any_of": ["python", "libs"]},
                                         "size": {"gte": 100},
                                         "$not": {"architecture": "all"}})

Stored values: a `"text"` field holds a UTF-8 text per document (at most 1 MiB), stored and
returned on request but never filtered on; give its value as `Text("...")` (a plain str is a
keyword). Each document can also carry a payload, any JSON-serializable value (at most 1 MiB
encoded), stored and never indexed. Searches return the values with each hit on request:

    client.insert("docs", doc_ids=[1], vectors=v, attributes=[{"body": Text("...")}],
                  payloads=[{"url": "https://example.org"}])
    hits = client.search("docs", query, output_fields=["body"], with_payload=True)
    hits[0].attributes["body"], hits[0].payload

A filter dict ANDs its entries. A field's condition is a string (the keyword equals it, or is
among a KEYWORDS field's values), a list of strings (any of them), a bool (a BOOL field equals
it), a number (a NUMBER field equals it), or a dict of `any_of`, `eq`, `gt`, `gte`, `lt`, `lte`
and `exists` (ANDed). The keys `$and` and `$or` take lists of filters, `$not` one filter. A
`tarn_pb2.Filter` is accepted as it is. Searches return min(top_k, matching documents) hits.

An overloaded server answers RESOURCE_EXHAUSTED with a `retry-after-ms` hint: `retry_after(error)`
reads it (in seconds), and `Client(..., overload_retries=N)` makes every call wait that long and
try again, up to N times (off by default; inserts and removes are safe to repeat).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field as dc_field
from typing import Any, Iterable, Optional, Sequence, Union

import grpc
import numpy as np

from tarn_client._gen import tarn_pb2, tarn_pb2_grpc

__all__ = [
    "Client", "Hit", "Document", "CollectionInfo", "Text", "to_id", "from_id", "retry_after",
    "to_filter", "to_attributes",
]


class Text(str):
    """A TEXT field's value (a plain `str` is a keyword)."""

RETRY_AFTER_MS = "retry-after-ms"


def retry_after(error: grpc.RpcError) -> Optional[float]:
    """Seconds an overloaded server asked to wait before the same call (its `retry-after-ms`
    hint on a RESOURCE_EXHAUSTED answer), or None."""
    code = getattr(error, "code", None)
    if code is None or code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if trailing else None) or ():
        if key == RETRY_AFTER_MS:
            try:
                return int(value) / 1000.0
            except ValueError:
                return None
    return None

U128_MAX = (1 << 128) - 1
U64_MASK = (1 << 64) - 1

Ids = Union[int, Iterable[int], np.ndarray]

_METRICS = {"cosine": tarn_pb2.COSINE, "l2": tarn_pb2.L2, "dot": tarn_pb2.DOT}
_DURABILITY = {None: tarn_pb2.DURABILITY_UNSPECIFIED, "fsync": tarn_pb2.FSYNC, "written": tarn_pb2.WRITTEN}


def to_id(value: int) -> tarn_pb2.Id:
    """A u128 id as the protobuf `Id` (high and low 64-bit halves)."""
    value = int(value)
    if not 0 <= value <= U128_MAX:
        raise ValueError(f"id {value} is outside 0..2**128-1")
    return tarn_pb2.Id(high=value >> 64, low=value & U64_MASK)


def from_id(message: tarn_pb2.Id) -> int:
    return (message.high << 64) | message.low


def _ids(values: Optional[Ids]) -> list:
    if values is None:
        return []
    if isinstance(values, (int, np.integer)):
        values = [values]
    return [to_id(v) for v in values]


def _matrix(vectors, dimension: Optional[int] = None) -> np.ndarray:
    array = np.asarray(vectors, dtype=np.float32)
    if array.ndim == 1:
        array = array.reshape(1, -1)
    if array.ndim != 2:
        raise ValueError(f"vectors must be one vector or a 2-d array, got shape {array.shape}")
    if dimension is not None and array.shape[1] != dimension:
        raise ValueError(f"vectors have {array.shape[1]} values, the collection {dimension}")
    return np.ascontiguousarray(array)


_FIELD_TYPES = {
    "keyword": tarn_pb2.FIELD_TYPE_KEYWORD,
    "keywords": tarn_pb2.FIELD_TYPE_KEYWORDS,
    "number": tarn_pb2.FIELD_TYPE_NUMBER,
    "bool": tarn_pb2.FIELD_TYPE_BOOL,
    "text": tarn_pb2.FIELD_TYPE_TEXT,
}
_FIELD_TYPE_NAMES = {v: k for k, v in _FIELD_TYPES.items()}


# A TEXT field's analyzer by name: what it adds to Unicode words, lowercasing and ASCII folding.
_ANALYZERS = {
    "text": (False, False),
    "text:english": (True, True),
    "text:stem": (True, False),
    "text:stop": (False, True),
}


def _field_specs(fields) -> list:
    """`{"name": "keyword", ...}` or `[("name", "keyword"), ...]` as FieldSpec messages. A TEXT
    field is "text", or "text:english" (English stemmer and stop words), "text:stem" or
    "text:stop"."""
    if fields is None:
        return []
    items = fields.items() if isinstance(fields, dict) else fields
    specs = []
    for name, kind in items:
        if kind in _ANALYZERS:
            stemmer, stop_words = _ANALYZERS[kind]
            analyzer = tarn_pb2.TextAnalyzer(english_stemmer=stemmer, english_stop_words=stop_words)
            specs.append(tarn_pb2.FieldSpec(name=name, type=tarn_pb2.FIELD_TYPE_TEXT, analyzer=analyzer))
            continue
        if kind not in _FIELD_TYPES:
            known = sorted(set(_FIELD_TYPES) | set(_ANALYZERS))
            raise ValueError(f"field {name!r}: type {kind!r} is not one of {known}")
        specs.append(tarn_pb2.FieldSpec(name=name, type=_FIELD_TYPES[kind]))
    return specs


def _field_name(spec) -> str:
    """A declared field's type as `_field_specs` takes it."""
    kind = _FIELD_TYPE_NAMES.get(spec.type, "unspecified")
    if kind == "text":
        options = (spec.analyzer.english_stemmer, spec.analyzer.english_stop_words)
        return next(name for name, value in _ANALYZERS.items() if value == options)
    return kind


def _value(field: str, value) -> Optional[tarn_pb2.Value]:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return tarn_pb2.Value(boolean=bool(value))
    if isinstance(value, (int, float, np.integer, np.floating)):
        return tarn_pb2.Value(number=float(value))
    if isinstance(value, Text):
        return tarn_pb2.Value(text=str(value))
    if isinstance(value, str):
        return tarn_pb2.Value(keyword=value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tarn_pb2.Value(keywords=tarn_pb2.KeywordList(values=list(value)))
    raise ValueError(f"attribute {field!r}: {value!r} is not a string, a list of strings, a number or a bool")


def to_attributes(attributes: Optional[dict], payload: Any = None) -> tarn_pb2.Attributes:
    """One document's attributes as the wire message: a string is a keyword, a `Text` a TEXT
    value, a list of strings keywords, a bool a bool, an int or float a number; None values are
    left out. `payload` (any JSON-serializable value; None: no payload) is sent as JSON."""
    message = tarn_pb2.Attributes()
    for field, value in (attributes or {}).items():
        wire = _value(field, value)
        if wire is not None:
            message.values[field].CopyFrom(wire)
    if payload is not None:
        message.payload = json.dumps(payload)
    return message


def _from_value(value: tarn_pb2.Value):
    kind = value.WhichOneof("kind")
    if kind == "keywords":
        return list(value.keywords.values)
    if kind == "text":
        return Text(value.text)
    return getattr(value, kind) if kind else None


def _from_attributes(message: tarn_pb2.Attributes) -> tuple:
    """(attributes dict, payload or None) of a wire message."""
    values = {k: _from_value(v) for k, v in message.values.items()}
    return values, (json.loads(message.payload) if message.payload else None)


def _node(**kind) -> tarn_pb2.Filter:
    return tarn_pb2.Filter(**kind)


def _condition(field: str, condition) -> tarn_pb2.Filter:
    if isinstance(condition, (bool, np.bool_)):
        return _node(match=tarn_pb2.Match(field=field, boolean=bool(condition)))
    if isinstance(condition, (int, float, np.integer, np.floating)):
        return _node(range=tarn_pb2.Range(field=field, gte=float(condition), lte=float(condition)))
    if isinstance(condition, str):
        return _node(match=tarn_pb2.Match(field=field, any_of=[condition]))
    if isinstance(condition, (list, tuple)):
        return _node(match=tarn_pb2.Match(field=field, any_of=list(condition)))
    if not isinstance(condition, dict) or not condition:
        raise ValueError(f"filter on {field!r}: {condition!r} is not a value, a list or a non-empty dict")
    parts = []
    bounds = {}
    for op, operand in condition.items():
        if op in ("gt", "gte", "lt", "lte"):
            bounds[op] = float(operand)
        elif op in ("any_of", "eq"):
            parts.append(_condition(field, operand))
        elif op == "exists":
            node = _node(exists=field)
            parts.append(node if operand else _node(**{"not": node}))
        else:
            raise ValueError(f"filter on {field!r}: unknown operator {op!r} "
                             "(any_of, eq, gt, gte, lt, lte, exists)")
    if bounds:
        parts.append(_node(range=tarn_pb2.Range(field=field, **bounds)))
    return parts[0] if len(parts) == 1 else _node(all=tarn_pb2.FilterList(filters=parts))


def to_filter(spec) -> tarn_pb2.Filter:
    """A filter dict (see the module's help) as the wire message; a `tarn_pb2.Filter` as it is."""
    if isinstance(spec, tarn_pb2.Filter):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f"a filter is a dict or a tarn_pb2.Filter, not {type(spec).__name__}")
    parts = []
    for key, value in spec.items():
        if key in ("$and", "$or"):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"filter {key}: a list of filters, not {value!r}")
            inner = tarn_pb2.FilterList(filters=[to_filter(v) for v in value])
            parts.append(_node(all=inner) if key == "$and" else _node(any=inner))
        elif key == "$not":
            parts.append(_node(**{"not": to_filter(value)}))
        elif key.startswith("$"):
            raise ValueError(f"filter: unknown operator {key!r} ($and, $or, $not)")
        else:
            parts.append(_condition(key, value))
    return parts[0] if len(parts) == 1 else _node(all=tarn_pb2.FilterList(filters=parts))


@dataclass(frozen=True)
class Hit:
    doc_id: int
    user_id: int
    score: float
    # The values `output_fields` selected (field -> str, Text, list of str, float or bool).
    attributes: dict = dc_field(default_factory=dict)
    # The document's payload (decoded JSON) with `with_payload`, else None.
    payload: Any = None
    # Hybrid searches: (rank from 1, that side's score) on the vector and on the text side, or
    # None where that side did not retrieve the hit.
    vector_side: Optional[tuple] = None
    text_side: Optional[tuple] = None


def _hit(h) -> Hit:
    side = lambda s: (s.rank, s.score)  # noqa: E731
    return Hit(
        from_id(h.doc_id),
        from_id(h.user_id),
        h.score,
        *_from_attributes(h.attributes),
        vector_side=side(h.vector_side) if h.HasField("vector_side") else None,
        text_side=side(h.text_side) if h.HasField("text_side") else None,
    )


_FUSIONS = {"rrf": tarn_pb2.FUSION_METHOD_RRF, "relative_score": tarn_pb2.FUSION_METHOD_RELATIVE_SCORE}


@dataclass(frozen=True)
class Document:
    doc_id: int
    user_id: int
    vector: np.ndarray
    # The document's attributes (field -> str, Text, list of str, float or bool).
    attributes: dict = dc_field(default_factory=dict)
    # The document's payload (decoded JSON) with `with_payload`, else None.
    payload: Any = None


_QUANTIZATIONS = {
    "none": tarn_pb2.QUANTIZATION_NONE,
    "int8": tarn_pb2.QUANTIZATION_INT8,
    "rabitq": tarn_pb2.QUANTIZATION_RABITQ,
}
_QUANTIZATION_NAMES = {v: k for k, v in _QUANTIZATIONS.items()}


@dataclass(frozen=True)
class CollectionInfo:
    name: str
    dimension: int
    metric: str
    n_documents: int
    last_seq_no: int
    applied_seq_no: int
    durable_seq_no: int
    checkpoint_seq_no: int
    n_tenants: int
    # Stored vectors still searched by exact scan because they wait for a graph (a load that
    # outran indexing); 0 once the collection is indexed.
    n_unindexed: int
    # Copies of each shard and how many must be in sync for writes (1 and 1 on one node).
    replication_factor: int = 1
    min_in_sync: int = 1
    # The declared attribute fields: name -> "keyword" | "keywords" | "number" | "bool" |
    # "text" (or "text:english", "text:stem", "text:stop": its analyzer).
    fields: dict = dc_field(default_factory=dict)
    # "none", "int8" or "rabitq", RaBitQ's bits per dimension (0 otherwise), and the candidates
    # per result rescored on the full vectors (0 for none).
    quantization: str = "none"
    rescore: int = 0
    bits: int = 0
    # Approximate bytes the segments hold in memory, and the collection's bytes on disk.
    memory_bytes: int = 0
    bytes_on_disk: int = 0
    # Sealed full vectors left in the segment files (read only to rescore and for get), and
    # their bytes (of bytes_on_disk, not in memory).
    vectors_on_disk: bool = False
    cold_bytes: int = 0
    # Full-text search's BM25 settings (k1, b).
    bm25: tuple = (1.2, 0.75)

    @staticmethod
    def from_pb(info: tarn_pb2.CollectionInfo) -> "CollectionInfo":
        return CollectionInfo(
            name=info.name,
            dimension=info.dimension,
            metric=tarn_pb2.Metric.Name(info.metric).lower(),
            n_documents=info.n_documents,
            last_seq_no=info.last_seq_no,
            applied_seq_no=info.applied_seq_no,
            durable_seq_no=info.durable_seq_no,
            checkpoint_seq_no=info.checkpoint_seq_no,
            n_tenants=info.n_tenants,
            n_unindexed=info.n_unindexed,
            replication_factor=info.replication_factor,
            min_in_sync=info.min_in_sync,
            fields={f.name: _field_name(f) for f in info.fields},
            quantization=_QUANTIZATION_NAMES.get(info.quantization.kind, "unspecified"),
            rescore=info.quantization.rescore,
            bits=info.quantization.bits,
            memory_bytes=info.memory_bytes,
            bytes_on_disk=info.bytes_on_disk,
            vectors_on_disk=info.vectors_on_disk,
            cold_bytes=info.cold_bytes,
            bm25=(info.bm25.k1, info.bm25.b),
        )


@dataclass(frozen=True)
class WriteAck:
    """An acknowledged write: its sequence number (0 for a write to several shards) and the
    opaque read token to pass as `search(read_token=...)`."""

    seq_no: int
    read_token: bytes
    # Removes by filter: the (tenant, document) pairs removed.
    n_removed: int = 0


class Client:
    """A connection to one tarn server. Thread-safe (one gRPC channel)."""

    def __init__(
        self,
        address: str = "localhost:50051",
        api_key: Optional[str] = None,
        timeout: float = 30.0,
        max_message_bytes: int = 64 << 20,
        overload_retries: int = 0,
    ):
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        if address.startswith("unix:"):
            # A server on a Unix socket (`tarn serve --listen unix:/path`). grpc-core would send
            # the percent-encoded socket path as the HTTP/2 :authority, which the server's HTTP/2
            # layer rejects as malformed (the call fails with INTERNAL, RST_STREAM).
            options.append(("grpc.default_authority", "localhost"))
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = tarn_pb2_grpc.TarnStub(self.channel)
        self.timeout = timeout
        self.overload_retries = overload_retries
        self._metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request):
        n_retries = 0
        while True:
            try:
                return method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as error:
                wait = retry_after(error)
                if wait is None or n_retries >= self.overload_retries:
                    raise
                n_retries += 1
                time.sleep(wait)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the channel connects (raises grpc.FutureTimeoutError otherwise)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # Collections.

    def create_collection(
        self,
        name: str,
        dimension: int,
        metric: str = "cosine",
        m: int = 0,
        ef_construction: int = 0,
        ef_search: int = 0,
        durability: Optional[str] = None,
        shards: int = 0,
        shard_key: str = "user",
        fields=None,
        replication_factor: int = 0,
        min_in_sync: int = 0,
        quantization: str = "none",
        rescore: int = 0,
        vectors_on_disk: bool = False,
        bits: int = 0,
        bm25: Optional[tuple] = None,
    ) -> CollectionInfo:
        """Creates a collection. In cluster mode, `shards` (0: 8) and `shard_key` ("user": a
        tenant's documents on one shard; "doc": spread by document) say how it is split, and
        `replication_factor` (0: the server's default) and `min_in_sync` (0: one less, at least
        1) how many copies each shard has. `fields` declares attribute fields for filtered
        search: `{"name": "keyword" | "keywords" | "number" | "bool"}` (every one is indexed).
        `quantization` ("none", "int8" or "rabitq") keeps codes of sealed vectors for the graph
        walk (int8: a byte per dimension; rabitq: `bits` per dimension, 0 = 1), `rescore`
        candidates per result (0: the server's default) rescored on the full vectors: scores
        stay exact. `vectors_on_disk` (with a quantization) leaves the sealed
        full vectors in the segment files, read only for rescoring and `get`. TEXT fields
        ("text", or "text:english" for the English stemmer and stop words) are stored and
        full-text indexed (`search_text`), ranked by BM25 with `bm25=(k1, b)` (Lucene's
        (1.2, 0.75) unless given)."""
        if quantization.lower() not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {sorted(_QUANTIZATIONS)}, got {quantization!r}")
        request = tarn_pb2.CreateCollectionRequest(
            name=name,
            dimension=dimension,
            metric=_METRICS[metric.lower()],
            hnsw=tarn_pb2.HnswParams(m=m, ef_construction=ef_construction, ef_search=ef_search),
            default_durability=_DURABILITY[durability],
            shards=shards,
            shard_key={"user": tarn_pb2.SHARD_KEY_USER, "doc": tarn_pb2.SHARD_KEY_DOC}[shard_key.lower()],
            fields=_field_specs(fields),
            replication_factor=replication_factor,
            min_in_sync=min_in_sync,
            quantization=tarn_pb2.Quantization(
                kind=_QUANTIZATIONS[quantization.lower()], bits=bits, rescore=rescore
            ),
            vectors_on_disk=vectors_on_disk,
            bm25=tarn_pb2.Bm25Params(k1=bm25[0], b=bm25[1]) if bm25 is not None else None,
        )
        return CollectionInfo.from_pb(self._call(self.stub.CreateCollection, request).collection)

    def collection(self, name: str) -> CollectionInfo:
        request = tarn_pb2.GetCollectionRequest(name=name)
        return CollectionInfo.from_pb(self._call(self.stub.GetCollection, request).collection)

    def add_fields(self, name: str, fields) -> CollectionInfo:
        """Declares more attribute fields (documents written before have no value for them)."""
        request = tarn_pb2.AddFieldsRequest(collection=name, fields=_field_specs(fields))
        return CollectionInfo.from_pb(self._call(self.stub.AddFields, request).collection)

    def list_collections(self) -> list:
        return list(self._call(self.stub.ListCollections, tarn_pb2.ListCollectionsRequest()).names)

    def drop_collection(self, name: str) -> None:
        self._call(self.stub.DropCollection, tarn_pb2.DropCollectionRequest(name=name))

    # Writes: answered once durable (fsync, the default) or written (see the README).

    def insert(
        self,
        collection: str,
        doc_ids: Ids,
        vectors,
        user_ids: Optional[Ids] = None,
        durability: Optional[str] = None,
        attributes: Optional[Sequence[dict]] = None,
        payloads: Optional[Sequence[Any]] = None,
    ) -> int:
        """Inserts (or replaces) documents for each of `user_ids` (tenant 0 when None), with
        one attributes dict and one payload (None: none) per document when given. Returns the
        operation's sequence number (pass it as `min_seq_no` to read the write)."""
        return self.insert_acked(
            collection, doc_ids, vectors, user_ids, durability, attributes, payloads
        ).seq_no

    def insert_acked(
        self,
        collection: str,
        doc_ids: Ids,
        vectors,
        user_ids: Optional[Ids] = None,
        durability: Optional[str] = None,
        attributes: Optional[Sequence[dict]] = None,
        payloads: Optional[Sequence[Any]] = None,
    ) -> "WriteAck":
        """`insert`, returning a `WriteAck` whose `read_token` a later `search(read_token=...)`
        waits for on every shard the write touched (cluster mode; works on one node too)."""
        ids = _ids(doc_ids)
        matrix = _matrix(vectors)
        if len(ids) != matrix.shape[0]:
            raise ValueError(f"{len(ids)} doc_ids for {matrix.shape[0]} vectors")
        if attributes is not None and len(attributes) != len(ids):
            raise ValueError(f"{len(attributes)} attributes for {len(ids)} doc_ids")
        if payloads is not None and len(payloads) != len(ids):
            raise ValueError(f"{len(payloads)} payloads for {len(ids)} doc_ids")
        wire = []
        if attributes is not None or payloads is not None:
            attributes = attributes if attributes is not None else [None] * len(ids)
            payloads = payloads if payloads is not None else [None] * len(ids)
            wire = [to_attributes(a, p) for a, p in zip(attributes, payloads)]
        request = tarn_pb2.InsertRequest(
            collection=collection,
            doc_ids=ids,
            user_ids=_ids(user_ids),
            vectors=matrix.ravel().tolist(),
            durability=_DURABILITY[durability],
            attributes=wire,
        )
        reply = self._call(self.stub.Insert, request)
        return WriteAck(reply.seq_no, reply.read_token)

    def remove(
        self,
        collection: str,
        doc_ids: Ids,
        user_ids: Optional[Ids] = None,
        durability: Optional[str] = None,
    ) -> int:
        return self.remove_acked(collection, doc_ids, user_ids, durability).seq_no

    def remove_acked(self, collection: str, doc_ids: Ids, user_ids: Optional[Ids] = None,
                     durability: Optional[str] = None) -> "WriteAck":
        """`remove`, returning a `WriteAck` (see `insert_acked`)."""
        request = tarn_pb2.RemoveRequest(
            collection=collection,
            doc_ids=_ids(doc_ids),
            user_ids=_ids(user_ids),
            durability=_DURABILITY[durability],
        )
        reply = self._call(self.stub.Remove, request)
        return WriteAck(reply.seq_no, reply.read_token, reply.n_removed)

    def remove_matching(self, collection: str, filter, user_ids: Optional[Ids] = None,
                        durability: Optional[str] = None) -> "WriteAck":
        """Removes every document of `user_ids` (tenant 0 when None) that matches `filter` when
        the server handles the call; the answer's `n_removed` counts the (tenant, document)
        pairs removed."""
        request = tarn_pb2.RemoveRequest(
            collection=collection,
            user_ids=_ids(user_ids),
            durability=_DURABILITY[durability],
            filter=to_filter(filter),
        )
        reply = self._call(self.stub.Remove, request)
        return WriteAck(reply.seq_no, reply.read_token, reply.n_removed)

    def flush(self, collection: str) -> int:
        """Checkpoints everything logged so far; returns the last sequence number included."""
        return self._call(self.stub.Flush, tarn_pb2.FlushRequest(collection=collection)).flushed_seq_no

    # Reads.

    def _search_request(
        self,
        collection: str,
        query,
        top_k: int = 10,
        user_ids: Optional[Ids] = None,
        ef: int = 0,
        exact: bool = False,
        min_seq_no: int = 0,
        read_token: bytes = b"",
        allow_partial: bool = False,
        filter=None,
        output_fields: Optional[Sequence[str]] = None,
        with_payload: bool = False,
        text: Optional[tuple] = None,
        fusion: str = "rrf",
        rrf_k: float = 0,
        depth: int = 0,
        weights: Optional[tuple] = None,
    ):
        """The SearchRequest of `search` for one query row."""
        hybrid = {}
        if text is not None:
            field, text_query = text
            if fusion not in _FUSIONS:
                raise ValueError(f"fusion must be one of {sorted(_FUSIONS)}, got {fusion!r}")
            vector_weight, text_weight = weights if weights is not None else (None, None)
            hybrid = dict(
                text=tarn_pb2.TextQuery(field=field, query=text_query),
                fusion=tarn_pb2.Fusion(
                    method=_FUSIONS[fusion], rrf_k=rrf_k, depth=depth,
                    vector_weight=vector_weight, text_weight=text_weight,
                ),
            )
        request = tarn_pb2.SearchRequest(
            collection=collection,
            user_ids=_ids(user_ids),
            vector=query.tolist(),
            top_k=top_k,
            ef=ef,
            exact=exact,
            min_seq_no=min_seq_no,
            read_token=read_token,
            allow_partial=allow_partial,
            filter=to_filter(filter) if filter is not None else None,
            output_fields=list(output_fields or ()),
            with_payload=with_payload,
            **hybrid,
        )
        return request

    def search(
        self,
        collection: str,
        vector,
        top_k: int = 10,
        user_ids: Optional[Ids] = None,
        ef: int = 0,
        exact: bool = False,
        min_seq_no: int = 0,
        read_token: bytes = b"",
        allow_partial: bool = False,
        filter=None,
        output_fields: Optional[Sequence[str]] = None,
        with_payload: bool = False,
        text: Optional[tuple] = None,
        fusion: str = "rrf",
        rrf_k: float = 0,
        depth: int = 0,
        weights: Optional[tuple] = None,
    ) -> list:
        """The `top_k` nearest documents of the given tenants (tenant 0 when None), best first;
        with `filter`, only documents matching it (min(top_k, matches) hits). Each hit carries
        the fields `output_fields` names (`["*"]`: every field) and, with `with_payload`, the
        document's payload, read right after the search (a write of the document in between
        may show).

        With `text=(field, query)` too, a hybrid search: the nearest documents and those with the
        best BM25 scores for `query` in the TEXT field (`depth` candidates each, 0: max(top_k,
        100); filters apply to both), fused by `fusion` ("rrf", with `rrf_k` 0 meaning 60, or
        "relative_score") with `weights=(vector, text)` (1 and 1 unless given). Each hit's
        `score` is then the fused score, and `vector_side` / `text_side` are (rank, score)."""
        query = _matrix(vector)
        if query.shape[0] != 1:
            raise ValueError("search takes one vector")
        request = self._search_request(
            collection, query[0], top_k, user_ids=user_ids, ef=ef, exact=exact,
            min_seq_no=min_seq_no, read_token=read_token, allow_partial=allow_partial,
            filter=filter, output_fields=output_fields, with_payload=with_payload, text=text,
            fusion=fusion, rrf_k=rrf_k, depth=depth, weights=weights,
        )
        response = self._call(self.stub.Search, request)
        return [_hit(h) for h in response.hits]

    def search_batch(self, collection: str, vectors, top_k: int = 10, **options) -> list:
        """Searches with every row of `vectors` (a 2-d array, or a list of vectors; at most
        1,000) in one call, each with the options of `search`; returns one list of hits per row,
        in order. The first search that fails fails the call, its message naming it
        (`searches[3]: ...`). One collection and one set of options per call here; with
        `allow_partial`, the shards that did not answer are not reported (use `search` for
        that)."""
        queries = _matrix(vectors)
        request = tarn_pb2.SearchBatchRequest(
            searches=[self._search_request(collection, q, top_k, **options) for q in queries]
        )
        response = self._call(self.stub.SearchBatch, request)
        return [[_hit(h) for h in result.hits] for result in response.results]

    def search_text(
        self,
        collection: str,
        field: str,
        query: str,
        top_k: int = 10,
        user_ids: Optional[Ids] = None,
        min_seq_no: int = 0,
        read_token: bytes = b"",
        allow_partial: bool = False,
        filter=None,
        output_fields: Optional[Sequence[str]] = None,
        with_payload: bool = False,
    ) -> list:
        """Full-text search: the `top_k` documents of the given tenants with the best BM25
        scores for `query` in the TEXT field `field` (analysed by the field's analyzer), best
        first; `Hit.score` is the BM25 score. Filters, tenants and field selections work as in
        `search`."""
        request = tarn_pb2.SearchRequest(
            collection=collection,
            user_ids=_ids(user_ids),
            top_k=top_k,
            min_seq_no=min_seq_no,
            read_token=read_token,
            allow_partial=allow_partial,
            filter=to_filter(filter) if filter is not None else None,
            output_fields=list(output_fields or ()),
            with_payload=with_payload,
            text=tarn_pb2.TextQuery(field=field, query=query),
        )
        response = self._call(self.stub.Search, request)
        return [_hit(h) for h in response.hits]

    def get(
        self,
        collection: str,
        doc_ids: Ids,
        user_id: int = 0,
        min_seq_no: int = 0,
        read_token: bytes = b"",
        output_fields: Optional[Sequence[str]] = None,
        with_payload: bool = False,
    ) -> list:
        """The stored documents among `doc_ids` for one tenant (missing ids are absent), with
        every field (or those `output_fields` names) and, with `with_payload`, the payload.
        With a write's `read_token` (or `min_seq_no`), waits within the deadline until that
        write is visible; without one, a copy answers with what it has applied."""
        request = tarn_pb2.GetRequest(
            collection=collection,
            user_id=to_id(user_id),
            doc_ids=_ids(doc_ids),
            min_seq_no=min_seq_no,
            read_token=read_token,
            output_fields=list(output_fields or ()),
            with_payload=with_payload,
        )
        response = self._call(self.stub.Get, request)
        return [
            Document(
                from_id(d.doc_id),
                from_id(d.user_id),
                np.asarray(d.vector, dtype=np.float32),
                *_from_attributes(d.attributes),
            )
            for d in response.docs
        ]

    def count(
        self,
        collection: str,
        user_ids: Optional[Ids] = None,
        filter=None,
        min_seq_no: int = 0,
        read_token: bytes = b"",
    ) -> int:
        """The exact number of live documents of `user_ids` (tenant 0 when None), all of them or
        those matching `filter`; a document owned by two of the tenants counts twice. With a
        write's `read_token` (or `min_seq_no`), waits within the deadline until that write is
        counted."""
        request = tarn_pb2.CountRequest(
            collection=collection,
            user_ids=_ids(user_ids),
            min_seq_no=min_seq_no,
            read_token=read_token,
        )
        if filter is not None:
            request.filter.CopyFrom(to_filter(filter))
        return self._call(self.stub.Count, request).count

    def scroll(
        self,
        collection: str,
        user_ids: Optional[Ids] = None,
        filter=None,
        limit: int = 100,
        cursor: bytes = b"",
        output_fields: Optional[Sequence[str]] = None,
        with_payload: bool = False,
        with_vectors: bool = False,
        min_seq_no: int = 0,
        read_token: bytes = b"",
    ) -> tuple:
        """One page of the live documents of `user_ids` (tenant 0 when None), all or those
        matching `filter`, in (user_id, doc_id) order: `(documents, next_cursor)`; pass
        `next_cursor` as `cursor` for the next page (None after the last). Documents carry every
        field (or those `output_fields` names), the payload with `with_payload` and the vector
        with `with_vectors` (else an empty array). Each page is read when asked for: a document
        live and unchanged for the whole scroll comes exactly once."""
        request = tarn_pb2.ScrollRequest(
            collection=collection,
            user_ids=_ids(user_ids),
            limit=limit,
            cursor=cursor or b"",
            output_fields=list(output_fields or ()),
            with_payload=with_payload,
            with_vectors=with_vectors,
            min_seq_no=min_seq_no,
            read_token=read_token,
        )
        if filter is not None:
            request.filter.CopyFrom(to_filter(filter))
        response = self._call(self.stub.Scroll, request)
        docs = [
            Document(
                from_id(d.doc_id),
                from_id(d.user_id),
                np.asarray(d.vector, dtype=np.float32),
                *_from_attributes(d.attributes),
            )
            for d in response.docs
        ]
        return docs, (response.next_cursor or None)

    def scroll_all(self, collection: str, **options):
        """Every document `scroll` lists, page after page (the options of `scroll`)."""
        cursor = options.pop("cursor", b"")
        while True:
            docs, cursor = self.scroll(collection, cursor=cursor, **options)
            yield from docs
            if cursor is None:
                return

    # Backups: consistent snapshots of live collections (docs/SNAPSHOT_FORMAT.md).

    def snapshot(self, collection: str, out) -> int:
        """Streams a snapshot of a live collection (writes go on meanwhile) into `out`: a path,
        written to `<out>.partial` and renamed only once complete, or a binary file object.
        Returns the snapshot's sequence number: it holds exactly the operations up to it. No
        timeout applies (a large collection takes as long as it takes)."""
        request = tarn_pb2.CreateSnapshotRequest(collection=collection)
        chunks = self.stub.CreateSnapshot(request, metadata=self._metadata)
        if hasattr(out, "write"):
            return _write_snapshot(chunks, out)
        partial = f"{os.fspath(out)}.partial"
        try:
            with open(partial, "wb") as f:
                seq_no = _write_snapshot(chunks, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, out)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial)
            raise
        return seq_no

    def restore(self, collection: str, source) -> CollectionInfo:
        """Restores a snapshot (a path or a binary file object) as the new collection
        `collection`; it appears only once the whole file is in and verified. A damaged file is
        refused (INVALID_ARGUMENT naming the damage), a taken name too (ALREADY_EXISTS); either
        way nothing is left behind."""
        with contextlib.ExitStack() as stack:
            f = source if hasattr(source, "read") else stack.enter_context(open(source, "rb"))

            def requests():
                yield tarn_pb2.RestoreSnapshotRequest(collection=collection, data=f.read(_CHUNK))
                while True:
                    data = f.read(_CHUNK)
                    if not data:
                        return
                    yield tarn_pb2.RestoreSnapshotRequest(data=data)

            reply = self.stub.RestoreSnapshot(requests(), metadata=self._metadata)
        return CollectionInfo.from_pb(reply.collection)


_CHUNK = 1 << 20


def _write_snapshot(chunks, f) -> int:
    seq_no, total, received = None, None, 0
    for chunk in chunks:
        seq_no, total = chunk.seq_no, chunk.total_bytes
        f.write(chunk.data)
        received += len(chunk.data)
    if seq_no is None or received != total:
        raise IOError(f"snapshot stream ended after {received} of {total} bytes")
    return seq_no
