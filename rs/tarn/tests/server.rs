//! Integration tests through a real tonic client against the real `tarn` binary on ephemeral
//! ports: every RPC and error code, auth, health, reflection, compression, restart with data
//! intact, the directory lock, and graceful shutdown under in-flight writes.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_client::TarnClient;
use tonic::transport::Channel;
use tonic::{Code, Request};

mod common;
use common::*;

#[test]
fn every_rpc_and_every_error_code() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    runtime().block_on(async {
        let mut c = server.client().await;
        // CreateCollection
        let info = c
            .create_collection(create("docs", 3, pb::Metric::L2))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.collection.unwrap().dimension, 3);
        assert_eq!(
            code(c.create_collection(create("docs", 3, pb::Metric::L2)).await),
            Code::AlreadyExists
        );
        for bad in ["../x", "", "a/b", &"x".repeat(65), "ünï"] {
            let status = c
                .create_collection(create(bad, 3, pb::Metric::L2))
                .await
                .unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}");
            assert!(status.message().contains("name"), "{}", status.message());
        }
        let status = c
            .create_collection(create("d0", 0, pb::Metric::L2))
            .await
            .unwrap_err();
        assert!(status.code() == Code::InvalidArgument && status.message().contains("dimension"));
        assert_eq!(
            code(
                c.create_collection(create("d5000", 5000, pb::Metric::L2))
                    .await
            ),
            Code::InvalidArgument
        );
        let status = c
            .create_collection(create("nometric", 3, pb::Metric::Unspecified))
            .await
            .unwrap_err();
        assert!(status.code() == Code::InvalidArgument && status.message().contains("metric"));
        // Quantization: reported with its rescore resolved; a bad kind or depth names its field.
        let mut int8 = create("int8", 3, pb::Metric::L2);
        int8.quantization = Some(pb::Quantization {
            kind: pb::QuantizationKind::QuantizationInt8 as i32,
            bits: 0,
            rescore: 0,
        });
        let info = created(&mut c, int8.clone()).await;
        let quantization = info.quantization.unwrap();
        assert_eq!(
            (quantization.kind, quantization.rescore),
            (pb::QuantizationKind::QuantizationInt8 as i32, 3)
        );
        c.drop_collection(pb::DropCollectionRequest {
            name: "int8".into(),
        })
        .await
        .unwrap();
        for (kind, rescore, field) in [(7, 0, "quantization.kind"), (1, 65, "quantization.rescore")]
        {
            int8.quantization = Some(pb::Quantization {
                kind,
                bits: 0,
                rescore,
            });
            let status = c.create_collection(int8.clone()).await.unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
            assert!(status.message().contains(field), "{}", status.message());
        }
        // RaBitQ: bits 0 = 1, rescore 0 = the default for the bits; bad bits name the field.
        let mut rabitq = create("rabitq", 3, pb::Metric::L2);
        rabitq.quantization = Some(pb::Quantization {
            kind: pb::QuantizationKind::QuantizationRabitq as i32,
            bits: 0,
            rescore: 0,
        });
        let info = created(&mut c, rabitq.clone()).await;
        let quantization = info.quantization.unwrap();
        assert_eq!(
            (quantization.kind, quantization.bits, quantization.rescore),
            (pb::QuantizationKind::QuantizationRabitq as i32, 1, 6)
        );
        c.drop_collection(pb::DropCollectionRequest {
            name: "rabitq".into(),
        })
        .await
        .unwrap();
        rabitq.quantization = Some(pb::Quantization {
            kind: pb::QuantizationKind::QuantizationRabitq as i32,
            bits: 9,
            rescore: 0,
        });
        let status = c.create_collection(rabitq).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains("quantization.bits"),
            "{}",
            status.message()
        );
        // Vectors on disk: reported; refused without a quantization, naming the field.
        int8.quantization = Some(pb::Quantization {
            kind: pb::QuantizationKind::QuantizationInt8 as i32,
            bits: 0,
            rescore: 2,
        });
        int8.vectors_on_disk = true;
        let info = created(&mut c, int8.clone()).await;
        assert!(info.vectors_on_disk);
        assert_eq!(info.cold_bytes, 0);
        c.drop_collection(pb::DropCollectionRequest {
            name: "int8".into(),
        })
        .await
        .unwrap();
        int8.quantization = None;
        let status = c.create_collection(int8.clone()).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains("vectors_on_disk"),
            "{}",
            status.message()
        );
        // ListCollections / GetCollection
        assert_eq!(
            c.list_collections(pb::ListCollectionsRequest {})
                .await
                .unwrap()
                .into_inner()
                .names,
            vec!["docs"]
        );
        assert_eq!(
            code(
                c.get_collection(pb::GetCollectionRequest {
                    name: "nope".into()
                })
                .await
            ),
            Code::NotFound
        );
        // Insert, with every validation error naming its field.
        let reply = c
            .insert(insert(
                "docs",
                &[1, 2, 3],
                &[7],
                vec![0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 5.0, 5.0, 5.0],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.n_inserted, 3);
        let last_seq = reply.seq_no;
        for (request, field) in [
            (insert("docs", &[1], &[], vec![1.0, 2.0]), "vectors"),
            (insert("docs", &[1, 2], &[], vec![1.0, 2.0, 3.0]), "vectors"),
            (
                insert("docs", &[1], &[], vec![f32::NAN, 0.0, 0.0]),
                "vectors",
            ),
            (
                insert("docs", &[1], &[], vec![f32::INFINITY, 0.0, 0.0]),
                "vectors",
            ),
            (insert("docs", &[], &[], vec![]), "doc_ids"),
        ] {
            let status = c.insert(request).await.unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument);
            assert!(status.message().contains(field), "{}", status.message());
        }
        let mut bad_durability = insert("docs", &[1], &[], vec![1.0, 2.0, 3.0]);
        bad_durability.durability = 99;
        assert_eq!(code(c.insert(bad_durability).await), Code::InvalidArgument);
        assert_eq!(
            code(
                c.insert(insert("nope", &[1], &[], vec![1.0, 2.0, 3.0]))
                    .await
            ),
            Code::NotFound
        );
        assert_eq!(
            code(
                c.insert(insert("../x", &[1], &[], vec![1.0, 2.0, 3.0]))
                    .await
            ),
            Code::InvalidArgument
        );
        // Search: read-your-writes, best first, tenant scoped.
        let mut request = search("docs", &[7], vec![0.9, 0.0, 0.0], 2);
        request.min_seq_no = last_seq;
        let hits = c.search(request).await.unwrap().into_inner().hits;
        assert_eq!(hits.len(), 2);
        assert_eq!(hits[0].doc_id, Some(id(2)));
        assert!(
            hits[0].score <= hits[1].score,
            "L2: lower is better, best first"
        );
        assert!(c
            .search(search("docs", &[8], vec![0.9, 0.0, 0.0], 2))
            .await
            .unwrap()
            .into_inner()
            .hits
            .is_empty());
        for (request, field) in [
            (search("docs", &[7], vec![1.0], 2), "vector"),
            (search("docs", &[7], vec![f32::NAN, 0.0, 0.0], 2), "vector"),
            (search("docs", &[7], vec![1.0, 0.0, 0.0], 0), "top_k"),
            (search("docs", &[7], vec![1.0, 0.0, 0.0], 10_001), "top_k"),
        ] {
            let status = c.search(request).await.unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument);
            assert!(status.message().contains(field), "{}", status.message());
        }
        assert_eq!(
            code(c.search(search("nope", &[], vec![1.0, 0.0, 0.0], 2)).await),
            Code::NotFound
        );
        // SearchBatch: each search answered as alone, in order; the first failure fails the
        // call, named; an empty or oversized batch is refused naming `searches`.
        let mut first = search("docs", &[7], vec![0.9, 0.0, 0.0], 2);
        first.min_seq_no = last_seq;
        let searches = vec![
            first,
            search("docs", &[8], vec![0.9, 0.0, 0.0], 2),
            search("docs", &[7], vec![5.0, 5.0, 5.0], 1),
        ];
        let mut alone = Vec::new();
        for request in &searches {
            alone.push(c.search(request.clone()).await.unwrap().into_inner());
        }
        let batch = c
            .search_batch(pb::SearchBatchRequest {
                searches: searches.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(batch.results, alone);
        assert_eq!(batch.results[0].hits[0].doc_id, Some(id(2)));
        for (searches, message) in [
            (
                vec![
                    searches[0].clone(),
                    search("docs", &[7], vec![1.0, 0.0, 0.0], 0),
                ],
                "searches[1]: invalid top_k",
            ),
            (
                vec![search("nope", &[], vec![1.0, 0.0, 0.0], 2)],
                "searches[0]: collection 'nope' not found",
            ),
            (Vec::new(), "searches: 1 to 1000"),
            (vec![searches[1].clone(); 1001], "searches: 1 to 1000"),
        ] {
            let status = c
                .search_batch(pb::SearchBatchRequest { searches })
                .await
                .unwrap_err();
            assert!(
                status.message().starts_with(message),
                "{}",
                status.message()
            );
            let expected = if message.contains("nope") {
                Code::NotFound
            } else {
                Code::InvalidArgument
            };
            assert_eq!(status.code(), expected, "{}", status.message());
        }
        // Count: exact per tenant; a bad filter names it.
        let count = |users: &[u128]| pb::CountRequest {
            collection: "docs".into(),
            user_ids: users.iter().map(|&u| id(u)).collect(),
            min_seq_no: last_seq,
            ..Default::default()
        };
        let n7 = c.count(count(&[7])).await.unwrap().into_inner().count;
        assert!(n7 > 0);
        assert_eq!(c.count(count(&[8])).await.unwrap().into_inner().count, 0);
        assert_eq!(
            c.count(count(&[7, 8, 7])).await.unwrap().into_inner().count,
            n7
        );
        assert_eq!(
            code(
                c.count(pb::CountRequest {
                    collection: "nope".into(),
                    ..Default::default()
                })
                .await
            ),
            Code::NotFound
        );
        // A batch shares the call's deadline: a search that waited for its position leaves the
        // next one only what is left (before, each had all of it: 2 s + 3 s here).
        created(&mut c, create("batchdl", 3, pb::Metric::L2)).await;
        let first = c
            .insert(insert("batchdl", &[1], &[], vec![1.0, 0.0, 0.0]))
            .await
            .unwrap()
            .into_inner()
            .seq_no;
        let mut writer = server.client().await;
        let late_write = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            writer
                .insert(insert("batchdl", &[2], &[], vec![0.0, 1.0, 0.0]))
                .await
                .unwrap();
        });
        let waiting = |min_seq_no| pb::SearchRequest {
            min_seq_no,
            ..search("batchdl", &[], vec![1.0, 0.0, 0.0], 1)
        };
        let mut request = Request::new(pb::SearchBatchRequest {
            searches: vec![waiting(first + 1), waiting(first + 1000)],
        });
        request.set_timeout(Duration::from_secs(3));
        let started = std::time::Instant::now();
        let status = c.search_batch(request).await.unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(status.message().starts_with("searches[1]: "), "{status:?}");
        assert!(started.elapsed() < Duration::from_millis(4500));
        late_write.await.unwrap();
        // A min_seq_no that never comes: the client's deadline is respected.
        let mut request = Request::new(search("docs", &[7], vec![1.0, 0.0, 0.0], 2));
        request.get_mut().min_seq_no = last_seq + 1000;
        request.set_timeout(Duration::from_secs(2));
        let started = std::time::Instant::now();
        assert_eq!(code(c.search(request).await), Code::DeadlineExceeded);
        assert!(started.elapsed() < Duration::from_secs(5));
        // Get: read-your-writes as a search; a position that never comes respects the deadline;
        // a bad token is refused naming it.
        let get = |min_seq_no, read_token| pb::GetRequest {
            collection: "docs".into(),
            user_id: Some(id(7)),
            doc_ids: vec![id(3), id(99)],
            min_seq_no,
            read_token,
            ..Default::default()
        };
        let docs = c
            .get(get(last_seq, Vec::new()))
            .await
            .unwrap()
            .into_inner()
            .docs;
        assert_eq!(docs.len(), 1, "missing ids are absent");
        assert_eq!(docs[0].vector, vec![5.0, 5.0, 5.0]);
        let mut request = Request::new(get(last_seq + 1000, Vec::new()));
        request.set_timeout(Duration::from_secs(2));
        let started = std::time::Instant::now();
        assert_eq!(code(c.get(request).await), Code::DeadlineExceeded);
        assert!(started.elapsed() < Duration::from_secs(5));
        let status = c.get(get(0, b"garbage".to_vec())).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().contains("read_token"),
            "{}",
            status.message()
        );
        // Remove, Flush, GetCollection
        let seq = c
            .remove(pb::RemoveRequest {
                collection: "docs".into(),
                doc_ids: vec![id(2)],
                user_ids: vec![id(7)],
                durability: 0,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .seq_no;
        let flushed = c
            .flush(pb::FlushRequest {
                collection: "docs".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .flushed_seq_no;
        assert!(flushed >= seq);
        let info = collection_info(&mut c, "docs").await;
        assert_eq!(
            (
                info.n_documents,
                info.checkpoint_seq_no,
                info.n_sealed_segments
            ),
            (2, flushed, 1)
        );
        assert_eq!(info.applied_seq_no, info.last_seq_no);
        // DropCollection
        c.drop_collection(pb::DropCollectionRequest {
            name: "docs".into(),
        })
        .await
        .unwrap();
        assert_eq!(
            code(
                c.drop_collection(pb::DropCollectionRequest {
                    name: "docs".into()
                })
                .await
            ),
            Code::NotFound
        );
        assert_eq!(
            code(c.search(search("docs", &[], vec![1.0, 0.0, 0.0], 1)).await),
            Code::NotFound
        );
        assert!(!dir.path().join("collections/docs").exists());
        // Metrics endpoint.
        let body = http_get(&server.metrics_addr, "/metrics");
        assert!(
            body.contains("tarn_rpc_duration_seconds_count{code=\"Ok\",method=\"Insert\"}"),
            "{body}"
        );
    });
    assert!(server.terminate().success());
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).unwrap();
    body
}

#[test]
fn auth_health_reflection_and_compression() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        dir.path(),
        &["--api-key", "rw-secret", "--read-only-key", "ro-secret"],
    );
    runtime().block_on(async {
        let channel = Channel::from_shared(server.addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let with_key = |key: Option<&'static str>| {
            TarnClient::with_interceptor(channel.clone(), move |mut r: Request<()>| {
                if let Some(key) = key {
                    r.metadata_mut()
                        .insert("authorization", format!("Bearer {key}").parse().unwrap());
                }
                Ok(r)
            })
        };
        assert_eq!(
            code(
                with_key(None)
                    .list_collections(pb::ListCollectionsRequest {})
                    .await
            ),
            Code::Unauthenticated
        );
        assert_eq!(
            code(
                with_key(Some("wrong"))
                    .list_collections(pb::ListCollectionsRequest {})
                    .await
            ),
            Code::Unauthenticated
        );
        assert_eq!(
            code(
                with_key(Some("ro-secret"))
                    .create_collection(create("a", 2, pb::Metric::Dot))
                    .await
            ),
            Code::PermissionDenied
        );
        with_key(Some("rw-secret"))
            .create_collection(create("a", 2, pb::Metric::Dot))
            .await
            .unwrap();
        let ro = with_key(Some("ro-secret"));
        assert_eq!(
            code(
                ro.clone()
                    .insert(insert("a", &[1], &[], vec![1.0, 1.0]))
                    .await
            ),
            Code::PermissionDenied
        );
        // gzip and zstd requests are accepted.
        let mut gzip = with_key(Some("rw-secret"))
            .send_compressed(tonic::codec::CompressionEncoding::Gzip)
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
        gzip.insert(insert("a", &[1], &[], vec![1.0, 1.0]))
            .await
            .unwrap();
        let mut zstd = with_key(Some("rw-secret"))
            .send_compressed(tonic::codec::CompressionEncoding::Zstd)
            .accept_compressed(tonic::codec::CompressionEncoding::Zstd);
        let seq = zstd
            .insert(insert("a", &[2], &[], vec![3.0, 3.0]))
            .await
            .unwrap()
            .into_inner()
            .seq_no;
        let mut request = search("a", &[], vec![1.0, 1.0], 2);
        request.min_seq_no = seq;
        let hits = ro.clone().search(request).await.unwrap().into_inner().hits;
        assert_eq!(hits[0].doc_id, Some(id(2)), "dot: higher is better");
        assert!(hits[0].score > hits[1].score);
        // Health needs no key (container healthchecks).
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        // Reflection lists the service, as grpcurl would ask.
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::{
            server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
            ServerReflectionRequest,
        };
        let mut reflection = ServerReflectionClient::new(channel.clone());
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut replies = reflection
            .server_reflection_info(tokio_stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let reply = replies.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
            panic!("{reply:?}")
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&"tarn.v1.Tarn".to_owned()), "{names:?}");
    });
    // The healthcheck command.
    let status = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["healthcheck", "--addr", &server.addr])
        .output()
        .unwrap();
    assert!(status.status.success());
    drop(server);
    let status = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["healthcheck", "--addr", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!status.status.success());
}

#[test]
fn the_data_directory_is_locked_against_a_second_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let second = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--data-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("another tarn server") && stderr.contains("LOCK"),
        "{stderr}"
    );
    assert!(server.terminate().success());
    // Released at exit: a new server starts.
    let again = Server::start(dir.path(), &[]);
    assert!(again.terminate().success());
}

#[test]
fn graceful_shutdown_under_in_flight_writes_then_restart_with_everything_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let rt = runtime();
    let acknowledged: Vec<u128> = rt.block_on(async {
        let mut c = server.client().await;
        c.create_collection(create("w", 4, pb::Metric::Cosine))
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for t in 0..16u128 {
            let mut c = c.clone();
            tasks.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..10_000u128 {
                    let doc = t * 1_000_000 + i;
                    let v = vec![1.0 + (doc % 97) as f32, 2.0, 3.0, (i % 13) as f32];
                    match c.insert(insert("w", &[doc], &[t], v)).await {
                        Ok(_) => acked.push(doc),
                        Err(_) => break, // the server went away
                    }
                }
                acked
            }));
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        let pid = server.child.id();
        sigterm(pid);
        let mut all = Vec::new();
        for task in tasks {
            all.extend(task.await.unwrap());
        }
        all
    });
    let mut server = server;
    assert!(server.child.wait().unwrap().success(), "SIGTERM exits 0");
    std::mem::forget(server);
    assert!(acknowledged.len() > 100, "{}", acknowledged.len());

    let server = Server::start(dir.path(), &[]);
    rt.block_on(async {
        let mut c = server.client().await;
        let info = collection_info(&mut c, "w").await;
        assert!(
            info.n_documents >= acknowledged.len() as u64,
            "{} < {}",
            info.n_documents,
            acknowledged.len()
        );
        for chunk in acknowledged.chunks(500) {
            for tenant in 0..16u128 {
                let ids: Vec<pb::Id> = chunk
                    .iter()
                    .filter(|d| *d / 1_000_000 == tenant)
                    .map(|d| id(*d))
                    .collect();
                if ids.is_empty() {
                    continue;
                }
                let n = ids.len();
                let docs = c
                    .get(pb::GetRequest {
                        collection: "w".into(),
                        user_id: Some(id(tenant)),
                        doc_ids: ids,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .docs;
                assert_eq!(docs.len(), n, "acknowledged documents lost");
            }
        }
    });
    assert!(server.terminate().success());
}

#[test]
fn overload_is_resource_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--max-inflight-writes", "1"]);
    runtime().block_on(async {
        let mut c = server.client().await;
        c.create_collection(create("o", 2, pb::Metric::L2))
            .await
            .unwrap();
        // Every fourth call a Flush, which takes a write slot too.
        let tasks: Vec<_> = (0..64u128)
            .map(|i| {
                let mut c = c.clone();
                tokio::spawn(async move {
                    let result = if i % 4 == 3 {
                        c.flush(pb::FlushRequest {
                            collection: "o".into(),
                        })
                        .await
                        .map(|_| ())
                    } else {
                        c.insert(insert("o", &[i], &[], vec![1.0, 2.0]))
                            .await
                            .map(|_| ())
                    };
                    let hint = result.as_ref().err().and_then(|status| {
                        status
                            .metadata()
                            .get("retry-after-ms")
                            .map(|v| v.to_str().unwrap().to_owned())
                    });
                    (result, hint)
                })
            })
            .collect();
        let mut codes = Vec::new();
        let mut hints = Vec::new();
        for t in tasks {
            let (result, hint) = t.await.unwrap();
            codes.push(result.err().map(|s| s.code()));
            hints.push(hint);
        }
        assert!(codes.contains(&None), "some writes get through");
        // An overload answer carries the retry hint the clients honour.
        let hints: Vec<_> = hints.into_iter().flatten().collect();
        assert!(!hints.is_empty());
        assert!(hints.iter().all(|h| h == "50"), "{hints:?}");
        assert!(codes.contains(&Some(Code::ResourceExhausted)), "{codes:?}");
        assert!(codes
            .iter()
            .all(|c| matches!(c, None | Some(Code::ResourceExhausted))));
    });
}

#[test]
fn tls_from_certificate_and_key_files() {
    let dir = tempfile::tempdir().unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert_pem, key_pem) = (certified.cert.pem(), certified.signing_key.serialize_pem());
    let cert_path = dir.path().join("cert.pem");
    let key_path = dir.path().join("key.pem");
    std::fs::write(&cert_path, &cert_pem).unwrap();
    std::fs::write(&key_path, &key_pem).unwrap();
    let data = dir.path().join("data");
    let server = Server::start(
        &data,
        &[
            "--tls-cert",
            cert_path.to_str().unwrap(),
            "--tls-key",
            key_path.to_str().unwrap(),
        ],
    );
    let https = server.addr.replace("http://", "https://");
    runtime().block_on(async {
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&cert_pem))
            .domain_name("localhost");
        let channel = Channel::from_shared(https)
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = TarnClient::new(channel);
        assert!(c
            .list_collections(pb::ListCollectionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .names
            .is_empty());
        // Plain text against the TLS port fails.
        let plain = TarnClient::connect(server.addr.clone()).await;
        let failed = match plain {
            Err(_) => true,
            Ok(mut c) => c
                .list_collections(pb::ListCollectionsRequest {})
                .await
                .is_err(),
        };
        assert!(failed);
    });
}

/// A failing fdatasync in a running server (fail points, `--features failpoints`): writes fail
/// with UNAVAILABLE from then on, health and metrics say so, searches keep working, and a
/// restart brings back everything acknowledged.
#[cfg(feature = "failpoints")]
#[test]
fn a_failing_fdatasync_makes_writes_unavailable_until_restart() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    {
        let server = Server::start(dir.path(), &[]);
        rt.block_on(async {
            let mut c = server.client().await;
            c.create_collection(create("f", 2, pb::Metric::L2))
                .await
                .unwrap();
            c.insert(insert("f", &[1], &[], vec![1.0, 1.0]))
                .await
                .unwrap();
        });
        assert!(server.terminate().success());
    }
    // Every fdatasync fails in this run.
    let server =
        Server::start_with_env(dir.path(), &[], &[("FAILPOINTS", "wal::fdatasync=return")]);
    rt.block_on(async {
        let mut c = server.client().await;
        for doc in 2..5u128 {
            let status = c
                .insert(insert("f", &[doc], &[], vec![2.0, 2.0]))
                .await
                .unwrap_err();
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            // The log has the WAL file's path; the client does not get it.
            let data_dir = dir.path().to_str().unwrap();
            assert!(!status.message().contains(data_dir), "{status:?}");
            assert!(status.message().contains("fdatasync"), "{status:?}");
        }
        let hits = c
            .search(search("f", &[], vec![1.0, 1.0], 5))
            .await
            .unwrap()
            .into_inner()
            .hits;
        assert_eq!(hits[0].doc_id, Some(id(1)), "searches keep working");
        // Health turns NOT_SERVING (within the watcher's 500 ms period), for the server and for
        // the collection, and `tarn healthcheck` fails.
        let channel = tonic::transport::Endpoint::new(server.addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
        for service in ["", "tarn.v1.Tarn", "tarn.v1.Tarn/f"] {
            let mut status = 0;
            for _ in 0..50 {
                status = health
                    .check(tonic_health::pb::HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .status;
                if status == not_serving {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert_eq!(status, not_serving, "health of {service:?}");
        }
    });
    let healthcheck = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["healthcheck", "--addr", &server.addr])
        .output()
        .unwrap();
    assert!(
        !healthcheck.status.success(),
        "healthcheck passed on a poisoned WAL"
    );
    let body = http_get(&server.metrics_addr, "/metrics");
    assert!(
        body.contains("tarn_wal_poisoned{collection=\"f\"} 1"),
        "{body}"
    );
    drop(server);
    // Restarted without the fault: the acknowledged write is there and writes work again.
    let server = Server::start(dir.path(), &[]);
    rt.block_on(document_1_of_f_is_back_and_f_takes_writes(&server));
    let healthcheck = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["healthcheck", "--addr", &server.addr])
        .output()
        .unwrap();
    assert!(
        healthcheck.status.success(),
        "healthy again after the restart"
    );
}

/// Searches naming many tenants run on the blocking pool, not on the runtime's workers: with one
/// more of them than the runtime has workers, each held inside its search for 4 s (fail point
/// `server::heavy_search=sleep(4000)`), durable writes and a one-tenant search still answer
/// within a 2 s deadline, and the held searches then answer in full.
#[cfg(feature = "failpoints")]
#[test]
fn heavy_searches_held_in_their_search_leave_writes_answered() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let server = Server::start_with_env(
        dir.path(),
        &[],
        &[("FAILPOINTS", "server::heavy_search=sleep(4000)")],
    );
    rt.block_on(async {
        let mut c = server.client().await;
        c.create_collection(create("h", 2, pb::Metric::L2))
            .await
            .unwrap();
        let tenants: Vec<u128> = (0..20).collect();
        for &t in &tenants {
            c.insert(insert("h", &[t], &[t], vec![t as f32, 1.0]))
                .await
                .unwrap();
        }
        let workers = std::thread::available_parallelism().map_or(1, usize::from);
        let mut searches = Vec::new();
        for _ in 0..=workers {
            let mut c = server.client().await;
            let request = search("h", &tenants, vec![3.0, 1.0], 5);
            searches.push(tokio::spawn(async move { c.search(request).await }));
        }
        // Let the first of them reach the fail point; the others wait for a slot.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for doc in 100..105u128 {
            let mut request = Request::new(insert("h", &[doc], &[0], vec![0.5, 0.5]));
            request.set_timeout(Duration::from_secs(2));
            c.insert(request).await.unwrap();
        }
        let mut request = Request::new(search("h", &[0], vec![0.5, 0.5], 1));
        request.set_timeout(Duration::from_secs(2));
        assert_eq!(c.search(request).await.unwrap().into_inner().hits.len(), 1);
        for held in searches {
            let hits = held.await.unwrap().unwrap().into_inner().hits;
            assert_eq!(hits.len(), 5, "{hits:?}");
        }
    });
}

/// A panic on one collection's ingestion thread (fail point `ingest::apply=1*panic`): its writes
/// are UNAVAILABLE naming the thread, health is NOT_SERVING for it and for the server while the
/// other collection stays SERVING and writable, `tarn_collection_failed` says which thread;
/// a restart recovers the acknowledged write that ingestion died applying.
#[cfg(feature = "failpoints")]
#[test]
fn a_dead_ingestion_thread_fails_its_collection_only_until_restart() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let server = Server::start_with_env(
        dir.path(),
        &[],
        &[("FAILPOINTS", "ingest::apply=1*panic(killed by a test)")],
    );
    rt.block_on(async {
        let mut c = server.client().await;
        for name in ["f", "g"] {
            c.create_collection(create(name, 2, pb::Metric::L2))
                .await
                .unwrap();
        }
        // Acknowledged: in the WAL, although ingestion dies applying it.
        c.insert(insert("f", &[1], &[], vec![1.0, 1.0]))
            .await
            .unwrap();
        let channel = tonic::transport::Endpoint::new(server.addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        for (service, want) in [
            ("", ServingStatus::NotServing),
            ("tarn.v1.Tarn", ServingStatus::NotServing),
            ("tarn.v1.Tarn/f", ServingStatus::NotServing),
            ("tarn.v1.Tarn/g", ServingStatus::Serving),
        ] {
            let mut status = 0;
            // The watcher looks every 500 ms.
            for _ in 0..100 {
                status = health
                    .check(tonic_health::pb::HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .status;
                if status == want as i32 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert_eq!(status, want as i32, "health of {service:?}");
        }
        let status = c
            .insert(insert("f", &[2], &[], vec![2.0, 2.0]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("ingestion thread"), "{status:?}");
        let status = c
            .flush(pb::FlushRequest {
                collection: "f".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        // The other collection works.
        c.insert(insert("g", &[1], &[], vec![1.0, 1.0]))
            .await
            .unwrap();
        c.flush(pb::FlushRequest {
            collection: "g".into(),
        })
        .await
        .unwrap();
    });
    let body = http_get(&server.metrics_addr, "/metrics");
    assert!(
        body.contains("tarn_collection_failed{collection=\"f\",thread=\"ingestion\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("tarn_collection_failed{collection=\"g\",thread=\"ingestion\"} 0"),
        "{body}"
    );
    drop(server);
    let server = Server::start(dir.path(), &[]);
    rt.block_on(document_1_of_f_is_back_and_f_takes_writes(&server));
}

#[cfg(feature = "failpoints")]
/// After a restart: document 1 of collection `f` (acknowledged before a failure) is there, and
/// `f` takes writes again.
async fn document_1_of_f_is_back_and_f_takes_writes(server: &Server) {
    let mut c = server.client().await;
    let docs = c
        .get(pb::GetRequest {
            collection: "f".into(),
            user_id: None,
            doc_ids: vec![id(1)],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .docs;
    assert_eq!(docs.len(), 1, "the acknowledged write is back");
    c.insert(insert("f", &[9], &[], vec![3.0, 3.0]))
        .await
        .unwrap();
}

fn write_vecs(path: &Path, rows: &[Vec<u32>]) {
    let mut bytes = Vec::new();
    for row in rows {
        bytes.extend_from_slice(&(row.len() as u32).to_le_bytes());
        for word in row {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn the_cli_creates_inserts_searches_gets_removes_flushes_and_drops() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    // 300 vectors of 8 dimensions; the queries are the first 50 of them, so the true nearest
    // neighbour of query i is doc i.
    let rows: Vec<Vec<f32>> = (0..300)
        .map(|i| {
            (0..8)
                .map(|d| ((i * 31 + d * 7) % 101) as f32 / 10.0 + (i as f32) * 0.001)
                .collect()
        })
        .collect();
    let fvecs = dir.path().join("base.fvecs");
    write_vecs(
        &fvecs,
        &rows
            .iter()
            .map(|r| r.iter().map(|v| v.to_bits()).collect())
            .collect::<Vec<_>>(),
    );
    let ivecs = dir.path().join("truth.ivecs");
    write_vecs(&ivecs, &(0..50u32).map(|i| vec![i]).collect::<Vec<_>>());
    let tarn = |args: &[&str]| run_cli(&server.addr, args);
    // Every client command takes a bare host:port as well as http://host:port.
    let bare = server.addr.strip_prefix("http://").unwrap();
    run_cli(
        bare,
        &[
            "collection",
            "create",
            "cli",
            "--dimension",
            "8",
            "--metric",
            "l2",
        ],
    );
    assert_eq!(tarn(&["collection", "list"]).trim(), "cli");
    let out = tarn(&[
        "insert",
        "--collection",
        "cli",
        "--fvecs",
        fvecs.to_str().unwrap(),
        "--batch",
        "40",
        "--concurrency",
        "4",
    ]);
    assert!(out.contains("inserted 300 vectors"), "{out}");
    // The query set both search commands read: 50 queries with their exact answers.
    let queries = [
        "--collection",
        "cli",
        "--fvecs",
        fvecs.to_str().unwrap(),
        "--ivecs",
        ivecs.to_str().unwrap(),
        "--limit",
        "50",
    ];
    let out = tarn(&[&["search"][..], &queries, &["--top-k", "1", "--exact"]].concat());
    assert!(
        out.contains("recall@1: 1.0000") && out.contains("p99"),
        "{out}"
    );
    // `tarn bench search`: one JSON line per (clients, mode); every query answered once per pass.
    let out = tarn(
        &[
            &["bench", "search"][..],
            &queries,
            &[
                "--clients",
                "1,3",
                "--ef",
                "0",
                "--exact",
                "--passes",
                "2",
                "--json",
            ],
        ]
        .concat(),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    for line in &lines {
        assert!(line.contains("\"queries\":100,"), "{line}");
    }
    assert!(
        lines[1].contains("\"exact\":true") && lines[1].contains("\"recall\":1.0000"),
        "{out}"
    );
    assert!(tarn(&["get", "--collection", "cli", "--doc-id", "7"]).starts_with("7\t"));
    tarn(&["remove", "--collection", "cli", "--doc-id", "7"]);
    assert!(tarn(&["flush", "--collection", "cli"]).contains("flushed_seq_no"));
    let info = tarn(&["collection", "info", "cli"]);
    assert!(info.contains("documents:          299"), "{info}");
    assert!(info.contains("quantization:       none"), "{info}");
    tarn(&["collection", "drop", "cli"]);
    assert_eq!(tarn(&["collection", "list"]).trim(), "");
    tarn(&[
        "collection",
        "create",
        "q8",
        "--dimension",
        "8",
        "--quantization",
        "int8:2",
        "--vectors-on-disk",
    ]);
    let info = tarn(&["collection", "info", "q8"]);
    assert!(
        info.contains("quantization:       int8 (rescore x2)"),
        "{info}"
    );
    assert!(info.contains("vectors on disk:    yes"), "{info}");
    tarn(&[
        "collection",
        "create",
        "rq",
        "--dimension",
        "8",
        "--quantization",
        "rabitq:4",
    ]);
    let info = tarn(&["collection", "info", "rq"]);
    assert!(
        info.contains("quantization:       rabitq 4 bit(s) (rescore x3)"),
        "{info}"
    );
    tarn(&["collection", "drop", "rq"]);
    tarn(&["collection", "drop", "q8"]);
}

#[test]
fn tarn_bench_insert_and_freshness_do_what_they_report() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let tarn = |args: &[&str]| run_cli(&server.addr, args);
    // 12 timed requests per run plus one untimed request per connection.
    let out = tarn(&[
        "bench",
        "insert",
        "--collection",
        "b",
        "--dimension",
        "16",
        "--clients",
        "1,3",
        "--requests",
        "12",
        "--batch",
        "2",
        "--json",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].contains("\"clients\":1,") && lines[0].contains("\"requests\":12,"),
        "{out}"
    );
    assert!(
        lines[1].contains("\"clients\":3,") && lines[1].contains("\"vectors\":24,"),
        "{out}"
    );
    let rt = runtime();
    let n_documents = |rt: &tokio::runtime::Runtime| {
        rt.block_on(async {
            let mut client = server.client().await;
            collection_info(&mut client, "b").await.n_documents
        })
    };
    assert_eq!(n_documents(&rt), 2 * (12 + 1 + 12 + 3));
    // Freshness: 200 inserts at 200/s, every 5th searched for until found.
    let out = tarn(&[
        "bench",
        "freshness",
        "--collection",
        "b",
        "--dimension",
        "16",
        "--rate",
        "200",
        "--seconds",
        "1",
        "--sample-every",
        "5",
        "--json",
    ]);
    assert!(
        out.contains("\"inserts\":200,")
            && out.contains("\"probed\":40,")
            && out.contains("\"missed\":0,"),
        "{out}"
    );
    assert_eq!(n_documents(&rt), 2 * (12 + 1 + 12 + 3) + 200);
}

/// `--listen unix:/path`: the CLI (insert, search, healthcheck) works through the socket; a
/// socket file left by a killed server is taken over, a live one is refused, and a graceful
/// shutdown removes the file.
#[test]
fn a_unix_socket_serves_the_cli_and_is_cleaned_up() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("tarn.sock");
    let listen = format!("unix:{}", sock.display());
    let data = dir.path().join("data");
    let server = Server::start(&data, &["--listen", &listen]);
    assert_eq!(server.addr, listen);
    let tarn = |args: &[&str]| run_cli(&listen, args);
    tarn(&[
        "collection",
        "create",
        "u",
        "--dimension",
        "4",
        "--metric",
        "l2",
    ]);
    let rows: Vec<Vec<u32>> = (0..20)
        .map(|i| (0..4).map(|d| ((i * 4 + d) as f32).to_bits()).collect())
        .collect();
    let fvecs = dir.path().join("base.fvecs");
    write_vecs(&fvecs, &rows);
    let ivecs = dir.path().join("truth.ivecs");
    write_vecs(&ivecs, &(0..20u32).map(|i| vec![i]).collect::<Vec<_>>());
    let fvecs = fvecs.to_str().unwrap();
    let out = tarn(&["insert", "--collection", "u", "--fvecs", fvecs]);
    assert!(out.contains("inserted 20 vectors"), "{out}");
    let out = tarn(&[
        "search",
        "--collection",
        "u",
        "--fvecs",
        fvecs,
        "--ivecs",
        ivecs.to_str().unwrap(),
        "--top-k",
        "1",
        "--exact",
    ]);
    assert!(out.contains("recall@1: 1.0000"), "{out}");
    let health = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["healthcheck", "--addr", &listen])
        .output()
        .unwrap();
    assert!(health.status.success(), "{health:?}");

    // A second server on the live socket is refused and leaves it alone.
    let other = dir.path().join("other");
    let refused = Server::try_start(&other, &["--listen", &listen], &[])
        .err()
        .expect("a second server on a live socket must not start");
    assert!(refused.contains("another server is listening"), "{refused}");
    assert!(tarn(&["collection", "list"]).contains('u'));

    // Killed: the socket file stays behind, and the next server takes it over.
    server.kill();
    assert!(sock.exists());
    let server = Server::start(&data, &["--listen", &listen]);
    let info = tarn(&["collection", "info", "u"]);
    assert!(info.contains("documents:          20"), "{info}");
    assert!(server.terminate().success());
    assert!(
        !sock.exists(),
        "a graceful shutdown removes the socket file"
    );
}
