"""The Python client against a real tarn server."""

import grpc
import numpy as np
import pytest

from tarn_client import Client, Text, from_id, to_id


def unit_rows(rng, n, dim):
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_ids_round_trip_the_whole_u128_range():
    for value in (0, 1, (1 << 64) - 1, 1 << 64, (1 << 128) - 1, 0x0123456789ABCDEF_FEDCBA9876543210):
        assert from_id(to_id(value)) == value
    with pytest.raises(ValueError):
        to_id(1 << 128)
    with pytest.raises(ValueError):
        to_id(-1)


def test_insert_search_get_remove_with_two_tenants(client):
    rng = np.random.default_rng(7)
    name = "py_tenants"
    info = client.create_collection(name, dimension=16, metric="cosine")
    assert info.dimension == 16 and info.metric == "cosine"
    assert name in client.list_collections()
    a, b = 11, (1 << 100) + 5  # a u128 tenant id beyond 64 bits
    va, vb = unit_rows(rng, 50, 16), unit_rows(rng, 50, 16)
    client.insert(name, doc_ids=range(1000, 1050), vectors=va, user_ids=a)
    seq = client.insert(name, doc_ids=range(2000, 2050), vectors=vb, user_ids=b, durability="written")

    # Each document is found by its own vector, for its own tenant only.
    for i in (0, 17, 49):
        hits = client.search(name, va[i], top_k=3, user_ids=a, min_seq_no=seq)
        assert hits[0].doc_id == 1000 + i and hits[0].user_id == a
        assert hits[0].score == pytest.approx(1.0, abs=1e-4)
        assert all(h.user_id == a for h in hits)
        assert all(h.user_id == b for h in client.search(name, va[i], top_k=5, user_ids=b))

    # A batch answers each row as a search alone does, in order.
    rows = va[[0, 17, 49]]
    batch = client.search_batch(name, rows, top_k=3, user_ids=a, min_seq_no=seq)
    assert [[h.doc_id for h in hits] for hits in batch] == [
        [h.doc_id for h in client.search(name, row, top_k=3, user_ids=a)] for row in rows
    ]
    assert [hits[0].doc_id for hits in batch] == [1000, 1017, 1049]
    with pytest.raises(grpc.RpcError) as err:
        client.search_batch(name, rows, top_k=0, user_ids=a)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("searches[0]: ") and "top_k" in err.value.details()

    docs = client.get(name, [1003, 2003, 999999], user_id=a)
    assert [d.doc_id for d in docs] == [1003]
    np.testing.assert_allclose(docs[0].vector, va[3], atol=1e-6)

    seq = client.remove(name, [1003], user_ids=a)
    hits = client.search(name, va[3], top_k=1, user_ids=a, min_seq_no=seq, exact=True)
    assert hits[0].doc_id != 1003
    assert client.get(name, [1003], user_id=a) == []

    flushed = client.flush(name)
    assert flushed >= seq
    info = client.collection(name)
    assert info.n_documents == 99 and info.n_tenants == 2
    client.drop_collection(name)
    assert name not in client.list_collections()


def test_errors_carry_tarn_status_codes(client):
    client.create_collection("py_errors", dimension=4)
    with pytest.raises(grpc.RpcError) as err:
        client.insert("py_errors", doc_ids=[1], vectors=np.ones((1, 5)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dimension" in err.value.details() or "vectors" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.insert("py_errors", doc_ids=[1], vectors=[[1.0, float("nan"), 0.0, 0.0]])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        client.search("no_such_collection", np.ones(4))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        client.create_collection("py_errors", dimension=4)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(ValueError):
        client.insert("py_errors", doc_ids=[1, 2], vectors=np.ones((1, 4)))
    client.drop_collection("py_errors")


def test_reflection_lists_the_tarn_service(address):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        assert "tarn.v1.Tarn" in services
        pool = DescriptorPool(database)
        service = pool.FindServiceByName("tarn.v1.Tarn")
        assert {"Insert", "Search", "Remove", "Flush"} <= {m.name for m in service.methods}


def test_health_reports_serving(address):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_a_unix_socket_address_works(unix_address):
    assert unix_address.startswith("unix:")
    with Client(unix_address) as c:
        c.wait_ready(timeout=10)
        c.create_collection("sock", dimension=2, metric="l2")
        seq = c.insert("sock", doc_ids=[1, 2], vectors=[[0.0, 1.0], [1.0, 0.0]], user_ids=7)
        hits = c.search("sock", [0.1, 0.9], top_k=1, user_ids=7, min_seq_no=seq)
        assert [h.doc_id for h in hits] == [1]


def test_snapshot_and_restore_round_trip(client, tmp_path):
    rng = np.random.default_rng(11)
    name = "py_snap"
    client.create_collection(name, dimension=8, metric="l2")
    vectors = rng.standard_normal((100, 8)).astype(np.float32)
    client.insert(name, doc_ids=range(100), vectors=vectors, user_ids=[1, 2])
    seq = client.remove(name, doc_ids=[3, 4], user_ids=2)

    path = tmp_path / "py_snap.tsnap"
    snap_seq = client.snapshot(name, path)
    assert snap_seq >= seq
    assert not (tmp_path / "py_snap.tsnap.partial").exists()
    # A write after the snapshot is not in it.
    client.insert(name, doc_ids=[5000], vectors=vectors[:1], user_ids=1)

    info = client.restore("py_snap_copy", path)
    assert info.name == "py_snap_copy" and info.dimension == 8 and info.metric == "l2"
    assert info.n_documents == 198
    assert client.get("py_snap_copy", [5000], user_id=1) == []
    assert [d.doc_id for d in client.get("py_snap_copy", [3, 4, 5], user_id=2)] == [5]
    for q in (0, 42, 99):
        want = client.search(name, vectors[q], top_k=6, user_ids=1, exact=True)
        got = client.search("py_snap_copy", vectors[q], top_k=5, user_ids=1, exact=True)
        assert [h.doc_id for h in got] == [h.doc_id for h in want if h.doc_id != 5000][:5]

    # The same file from a file object, onto a taken name: refused, nothing changes.
    with open(path, "rb") as f, pytest.raises(grpc.RpcError) as taken:
        client.restore("py_snap_copy", f)
    assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS

    # A damaged file is refused naming the damage, and no collection appears.
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged = tmp_path / "damaged.tsnap"
    damaged.write_bytes(bytes(data))
    with pytest.raises(grpc.RpcError) as refused:
        client.restore("py_snap_bad", damaged)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "snapshot" in refused.value.details()
    assert "py_snap_bad" not in client.list_collections()


def test_read_tokens_make_a_search_and_a_get_wait_for_the_write(client):
    name = "py_tokens"
    client.create_collection(name, dimension=4, metric="l2")
    ack = client.insert_acked(name, doc_ids=[1, 2], vectors=np.eye(4, dtype=np.float32)[:2], user_ids=9)
    assert ack.seq_no > 0 and ack.read_token
    hits = client.search(name, [1, 0, 0, 0], top_k=2, user_ids=9, read_token=ack.read_token)
    assert [h.doc_id for h in hits] == [1, 2]
    gone = client.remove_acked(name, doc_ids=[1], user_ids=9)
    hits = client.search(name, [1, 0, 0, 0], top_k=2, user_ids=9, read_token=gone.read_token)
    assert [h.doc_id for h in hits] == [2]
    assert [d.doc_id for d in client.get(name, [1, 2], user_id=9, read_token=gone.read_token)] == [2]
    assert [d.doc_id for d in client.get(name, [1, 2], user_id=9, min_seq_no=ack.seq_no)] == [2]
    for call in (
        lambda: client.search(name, [1, 0, 0, 0], read_token=b"garbage"),
        lambda: client.get(name, [1], read_token=b"garbage"),
    ):
        with pytest.raises(grpc.RpcError) as bad:
            call()
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "read_token" in bad.value.details()


class _Overloaded(grpc.RpcError):
    """What grpc raises for a RESOURCE_EXHAUSTED answer with the server's retry hint."""

    def __init__(self, hint):
        self._hint = hint

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def trailing_metadata(self):
        return () if self._hint is None else (("retry-after-ms", self._hint),)


def test_retry_after_reads_the_hint_and_overload_retries_honour_it():
    from tarn_client import retry_after

    assert retry_after(_Overloaded("50")) == 0.05
    assert retry_after(_Overloaded(None)) is None
    assert retry_after(_Overloaded("soon")) is None

    calls = []

    def flaky(request, timeout, metadata):
        calls.append(request)
        if len(calls) < 3:
            raise _Overloaded("1")
        return "ok"

    client = Client("localhost:1", overload_retries=5)
    assert client._call(flaky, "req") == "ok" and len(calls) == 3
    # Off by default, and bounded.
    calls.clear()
    with pytest.raises(grpc.RpcError):
        Client("localhost:1")._call(flaky, "req")
    assert len(calls) == 1
    calls.clear()

    def always(request, timeout, metadata):
        calls.append(request)
        raise _Overloaded("1")

    with pytest.raises(grpc.RpcError):
        Client("localhost:1", overload_retries=2)._call(always, "req")
    assert len(calls) == 3


def _matches(attrs, section=None, min_size=None, tag=None, free=None):
    if section is not None and attrs.get("section") not in section:
        return False
    if min_size is not None and not ("size" in attrs and attrs["size"] >= min_size):
        return False
    if tag is not None and tag not in attrs.get("tags", []):
        return False
    if free is not None and attrs.get("free") != free:
        return False
    return True


def test_filtered_search_remove_by_filter_and_attributes(client):
    rng = np.random.default_rng(11)
    name = "py_filtered"
    info = client.create_collection(
        name, dimension=8, fields={"section": "keyword", "tags": "keywords", "size": "number"}
    )
    assert info.fields == {"section": "keyword", "tags": "keywords", "size": "number"}
    n = 300
    vectors = unit_rows(rng, n, 8)
    sections = ["python", "libs", "web", "devel"]
    attributes = []
    for i in range(n):
        attrs = {"section": sections[i % 4], "tags": [f"a{i % 7}", f"b{i % 11}"]}
        if i % 3:
            attrs["size"] = float(i)
        attributes.append(attrs)
    seq = client.insert(name, doc_ids=range(n), vectors=vectors, user_ids=5, attributes=attributes)

    cases = [
        ({"section": {"any_of": ["python", "libs"]}, "size": {"gte": 100}},
         dict(section={"python", "libs"}, min_size=100)),
        ({"tags": "a3"}, dict(tag="a3")),
        ({"section": "web", "tags": "b5", "size": {"gte": 200}},
         dict(section={"web"}, tag="b5", min_size=200)),
        ({"section": "nothing"}, dict(section={"nothing"})),
    ]
    for spec, oracle in cases:
        expected = [i for i in range(n) if _matches(attributes[i], **oracle)]
        for exact in (True, False):
            hits = client.search(name, vectors[0], top_k=10, user_ids=5, min_seq_no=seq,
                                 filter=spec, exact=exact)
            assert len(hits) == min(10, len(expected)), (spec, exact)
            assert all(h.doc_id in expected for h in hits), (spec, exact)
        # The exact path's answer is the brute-force top 10 among the matches.
        truth = sorted(expected, key=lambda i: -float(vectors[i] @ vectors[0]))[:10]
        hits = client.search(name, vectors[0], top_k=10, user_ids=5, filter=spec, exact=True)
        assert [h.doc_id for h in hits] == truth

    # $or, $not and exists.
    spec = {"$or": [{"section": "python"}, {"$not": {"size": {"exists": True}}}]}
    expected = {i for i in range(n) if attributes[i]["section"] == "python" or "size" not in attributes[i]}
    hits = client.search(name, vectors[1], top_k=n, user_ids=5, filter=spec, exact=True)
    assert {h.doc_id for h in hits} == expected

    docs = client.get(name, [1, 3], user_id=5)
    assert docs[0].attributes == {"section": "libs", "tags": ["a1", "b1"], "size": 1.0}
    assert docs[1].attributes == {"section": "devel", "tags": ["a3", "b3"]}

    # Count: exact, with and without a filter; other tenants count nothing.
    for spec, oracle in cases:
        expected = [i for i in range(n) if _matches(attributes[i], **oracle)]
        assert client.count(name, user_ids=5, filter=spec, min_seq_no=seq) == len(expected), spec
    assert client.count(name, user_ids=5) == n
    assert client.count(name, user_ids=[5, 6]) == n
    assert client.count(name) == 0

    # Scroll: every document once, in id order, a page at a time, with a filter too.
    pages = []
    cursor = b""
    while cursor is not None:
        docs, cursor = client.scroll(name, user_ids=5, limit=64, cursor=cursor, min_seq_no=seq,
                                     with_vectors=True)
        pages.append(docs)
    assert [len(p) for p in pages] == [64, 64, 64, 64, 44]
    listed = [d for p in pages for d in p]
    assert [d.doc_id for d in listed] == list(range(n))
    np.testing.assert_allclose(listed[7].vector, vectors[7], atol=1e-6)
    assert listed[7].attributes == attributes[7]
    web = [d.doc_id for d in client.scroll_all(name, user_ids=5, filter={"section": "web"},
                                                limit=7, output_fields=["section"])]
    assert web == [i for i in range(n) if attributes[i]["section"] == "web"]
    docs, _ = client.scroll(name, user_ids=5, limit=1, output_fields=["section"])
    assert docs[0].attributes == {"section": "python"} and docs[0].vector.size == 0
    with pytest.raises(grpc.RpcError) as err:
        client.scroll(name, user_ids=5, cursor=b"junk")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cursor" in err.value.details()

    # Remove by filter: counted, gone, the rest untouched.
    doomed = {i for i in range(n) if attributes[i]["section"] == "devel"}
    ack = client.remove_matching(name, {"section": "devel"}, user_ids=5)
    assert ack.n_removed == len(doomed)
    assert client.count(name, user_ids=5, read_token=ack.read_token) == n - len(doomed)
    hits = client.search(name, vectors[3], top_k=n, user_ids=5, exact=True, read_token=ack.read_token)
    assert {h.doc_id for h in hits} == set(range(n)) - doomed

    # Added fields are usable at once; documents written before have no value.
    info = client.add_fields(name, {"free": "bool"})
    assert info.fields["free"] == "bool"
    seq = client.insert(name, doc_ids=[1000, 1001], vectors=unit_rows(rng, 2, 8), user_ids=5,
                        attributes=[{"free": True}, {"free": False}])
    hits = client.search(name, vectors[0], top_k=10, user_ids=5, min_seq_no=seq, filter={"free": True})
    assert [h.doc_id for h in hits] == [1000]

    # Bad input names the field.
    with pytest.raises(grpc.RpcError) as err:
        client.count(name, user_ids=5, filter={"colour": "red"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "filter" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.search(name, vectors[0], filter={"colour": "red"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "colour" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.insert(name, doc_ids=[5000], vectors=unit_rows(rng, 1, 8), attributes=[{"size": "big"}])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "size" in err.value.details()
    with pytest.raises(ValueError):
        client.search(name, vectors[0], filter={"size": {"near": 3}})
    with pytest.raises(ValueError):
        client.insert(name, doc_ids=[1, 2], vectors=unit_rows(rng, 2, 8), attributes=[{}])
    client.drop_collection(name)


def test_texts_and_payloads_come_back_with_hits_and_gets(client):
    rng = np.random.default_rng(13)
    name = "py_stored"
    info = client.create_collection(name, dimension=8, fields={"section": "keyword", "body": "text"})
    assert info.fields == {"section": "keyword", "body": "text"}
    n = 50
    vectors = unit_rows(rng, n, 8)
    attributes = [{"section": f"s{i % 3}", "body": Text(f"Body {i}: ünïcode text")} for i in range(n)]
    payloads = [{"i": i, "tags": ["a", "b"], "nested": {"x": 1.5}} if i % 5 else None for i in range(n)]
    seq = client.insert(name, doc_ids=range(n), vectors=vectors, attributes=attributes, payloads=payloads)

    hits = client.search(name, vectors[7], top_k=1, min_seq_no=seq, output_fields=["body"], with_payload=True)
    assert hits[0].doc_id == 7
    assert hits[0].attributes == {"body": "Body 7: ünïcode text"}
    assert isinstance(hits[0].attributes["body"], Text)
    assert hits[0].payload == {"i": 7, "tags": ["a", "b"], "nested": {"x": 1.5}}
    plain = client.search(name, vectors[7], top_k=1)
    assert plain[0].attributes == {} and plain[0].payload is None
    assert client.search(name, vectors[10], top_k=1, with_payload=True)[0].payload is None

    client.flush(name)  # sealed: the values are read from the segment file
    docs = client.get(name, [3, 10], with_payload=True)
    assert docs[0].attributes == {"section": "s0", "body": "Body 3: ünïcode text"}
    assert docs[0].payload["i"] == 3 and docs[1].payload is None
    docs = client.get(name, [3], output_fields=["section"])
    assert docs[0].attributes == {"section": "s0"} and docs[0].payload is None

    # Bad input names the field: an undeclared output field, a filter on TEXT, a keyword as text.
    with pytest.raises(grpc.RpcError) as err:
        client.search(name, vectors[0], output_fields=["nope"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output_fields" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.search(name, vectors[0], filter={"body": {"exists": True}})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "TEXT" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.insert(name, doc_ids=[99], vectors=unit_rows(rng, 1, 8), attributes=[{"body": "a keyword"}])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "body" in err.value.details()
    with pytest.raises(ValueError):
        client.insert(name, doc_ids=[1, 2], vectors=unit_rows(rng, 2, 8), payloads=[None])
    client.drop_collection(name)


def test_full_text_search_ranks_by_bm25_with_filters_and_selected_fields(client):
    rng = np.random.default_rng(17)
    name = "py_text"
    info = client.create_collection(
        name, dimension=8, fields={"section": "keyword", "body": "text:english"}, bm25=(0.9, 0.6)
    )
    assert info.fields == {"section": "keyword", "body": "text:english"}
    assert info.bm25 == pytest.approx((0.9, 0.6))
    texts = [
        "Python library for parsing configuration files",
        "Python python tools",
        "Kernel modules and firmware",
        "The libraries of Debian",
    ]
    n = 40
    attributes = [{"section": f"s{i % 2}", "body": Text(texts[i % 4])} for i in range(n)]
    seq = client.insert(name, doc_ids=range(n), vectors=unit_rows(rng, n, 8), attributes=attributes)
    hits = client.search_text(name, "body", "python libraries", top_k=40, min_seq_no=seq, output_fields=["body"])
    # "library" and "libraries" stem alike: the documents with both terms come first.
    assert len(hits) == 30
    assert {h.doc_id % 4 for h in hits[:10]} == {0}
    assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    assert hits[0].attributes == {"body": texts[0]}
    odd = client.search_text(name, "body", "python libraries", top_k=40, filter={"section": "s1"})
    assert [(h.doc_id, h.score) for h in odd] == [(h.doc_id, h.score) for h in hits if h.doc_id % 2 == 1]
    # Hybrid: the nearest documents and the best by BM25, fused; each hit says its ranks.
    query = unit_rows(rng, 1, 8)[0]
    fused = client.search(name, query, top_k=5, text=("body", "python libraries"), depth=20)
    assert len(fused) == 5 and all(h.vector_side or h.text_side for h in fused)
    assert any(h.text_side for h in fused) and any(h.vector_side for h in fused)
    rank, score = next(h.text_side for h in fused if h.text_side)
    assert rank >= 1 and score > 0
    relative = client.search(name, query, top_k=5, text=("body", "python"), fusion="relative_score", weights=(0.2, 0.8))
    assert all(0 <= h.score <= 1.0 + 1e-6 for h in relative)
    with pytest.raises(ValueError):
        client.search(name, query, text=("body", "python"), fusion="borda")
    with pytest.raises(grpc.RpcError) as err:
        client.search(name, query, text=("body", "python"), weights=(0.0, 0.0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fusion" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.search_text(name, "section", "python")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text.field" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.search_text(name, "body", "the of")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text.query" in err.value.details()
    client.drop_collection(name)


def test_int8_quantized_collection_reports_its_settings_and_scores_exactly(client):
    rng = np.random.default_rng(29)
    name = "py_int8"
    info = client.create_collection(name, dimension=32, metric="cosine", quantization="int8")
    assert info.quantization == "int8" and info.rescore == 3
    rows = unit_rows(rng, 1500, 32)
    client.insert(name, doc_ids=range(1500), vectors=rows)
    client.flush(name)  # sealed: the graph walk now reads the codes
    info = client.collection(name)
    assert info.quantization == "int8" and info.memory_bytes > 1500 * 32 * 4
    for i in (0, 700, 1499):
        hits = client.search(name, rows[i], top_k=5)
        assert hits[0].doc_id == i
        # Scores are the exact metric on the full vectors, not the codes'.
        assert hits[0].score == pytest.approx(1.0, abs=1e-5)
        for hit in hits:
            assert hit.score == pytest.approx(float(rows[hit.doc_id] @ rows[i]), abs=1e-5)
    with pytest.raises(ValueError):
        client.create_collection("py_bad_q", dimension=4, quantization="int4")
    with pytest.raises(grpc.RpcError) as error:
        client.create_collection("py_bad_q", dimension=4, quantization="rabitq", bits=9)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "quantization.bits" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        client.create_collection("py_bad_q", dimension=4, quantization="int8", rescore=65)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "quantization.rescore" in error.value.details()
    client.drop_collection(name)


def test_vectors_on_disk_keep_memory_small_and_get_exact(client):
    rng = np.random.default_rng(30)
    name = "py_on_disk"
    info = client.create_collection(name, dimension=32, quantization="rabitq", vectors_on_disk=True)
    assert info.vectors_on_disk and info.cold_bytes == 0
    assert (info.quantization, info.bits, info.rescore) == ("rabitq", 1, 6)
    rows = unit_rows(rng, 1500, 32)
    client.insert(name, doc_ids=range(1500), vectors=rows)
    client.flush(name)  # sealed: the full vectors now stay in the segment file
    info = client.collection(name)
    assert info.cold_bytes == 1500 * 32 * 4
    got = client.get(name, [3, 1499])
    assert [d.doc_id for d in got] == [3, 1499]
    np.testing.assert_allclose(got[0].vector, rows[3], atol=1e-6)
    hits = client.search(name, rows[700], top_k=5)
    assert hits[0].doc_id == 700 and hits[0].score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(grpc.RpcError) as error:
        client.create_collection("py_bad_disk", dimension=4, vectors_on_disk=True)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vectors_on_disk" in error.value.details()
    client.drop_collection(name)
