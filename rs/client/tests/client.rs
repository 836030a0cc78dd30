//! tarn-client against a real server (started in this process with `tarn_server::start`, on a
//! real port or Unix socket): every call, every error code a client can provoke with its
//! message, Unix sockets, TLS and API keys, deadlines, and many tasks sharing one client.

use std::path::Path;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tarn_client::{
    Client, Code, CollectionSpec, Durability, Insert, Metric, ReadToken, Remove, Search,
};
use tarn_server::{RunningServer, ServeConfig};

async fn start(config: ServeConfig) -> RunningServer {
    tarn_server::start(config).await.expect("server starts")
}

fn vectors(rng: &mut rand::rngs::StdRng, n: usize, dimension: usize) -> Vec<f32> {
    (0..n * dimension)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_round_trips_with_tarn_types() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(ServeConfig::in_process(dir.path())).await;
    // The bare host:port form, as grpcurl and the Python client take it.
    let client = Client::connect(server.grpc_addr()).await.unwrap();
    assert!(client.is_serving().await.unwrap());
    assert!(client.list_collections().await.unwrap().is_empty());

    let info = client
        .create_collection(
            CollectionSpec::new("docs", 8)
                .metric(Metric::L2)
                .hnsw(12, 100, 40)
                .default_durability(Durability::Written),
        )
        .await
        .unwrap();
    assert_eq!(
        (info.name.as_str(), info.dimension, info.metric),
        ("docs", 8, Metric::L2)
    );
    assert_eq!(
        (info.m, info.ef_construction, info.ef_search),
        (12, 100, 40)
    );
    assert_eq!(info.default_durability, Durability::Written);
    assert_eq!(client.list_collections().await.unwrap(), vec!["docs"]);

    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let data = vectors(&mut rng, 50, 8);
    let big_id = (1u128 << 100) + 5; // ids use all 128 bits
    let doc_ids: Vec<u128> = (0..50u128).map(|i| big_id + i).collect();
    let ack = client
        .insert(
            Insert::new("docs", doc_ids.clone(), data.clone())
                .users([3u128, u128::MAX])
                .durability(Durability::Fsync),
        )
        .await
        .unwrap();
    assert_eq!(ack.n_written, 100);
    assert!(ack.seq_no > 0);

    // Read your write: exact search for document 17's own vector finds it first, at distance 0.
    let hits = client
        .search(
            Search::new("docs", &data[17 * 8..18 * 8])
                .users([u128::MAX])
                .top_k(3)
                .exact(true)
                .after(ack.read_token()),
        )
        .await
        .unwrap();
    assert_eq!(hits.len(), 3);
    assert_eq!((hits[0].doc_id, hits[0].user_id), (big_id + 17, u128::MAX));
    assert!(hits[0].score.abs() < 1e-4, "{hits:?}");
    let graph_hits = client
        .search(
            Search::new("docs", &data[17 * 8..18 * 8])
                .users([3u128])
                .ef(64),
        )
        .await
        .unwrap();
    assert_eq!(graph_hits.len(), 10);

    let docs = client.get("docs", 3, &[big_id + 1, 999]).await.unwrap();
    assert_eq!(docs.len(), 1);
    assert_eq!(docs[0].doc_id, big_id + 1);
    assert_eq!(docs[0].vector, data[8..16].to_vec());

    let removed = client
        .remove(Remove::new("docs", [big_id + 17]).users([u128::MAX]))
        .await
        .unwrap();
    assert!(removed.seq_no > ack.seq_no);
    let hits = client
        .search(
            Search::new("docs", &data[17 * 8..18 * 8])
                .users([u128::MAX])
                .exact(true)
                .after(removed.read_token()),
        )
        .await
        .unwrap();
    assert!(hits.iter().all(|h| h.doc_id != big_id + 17));

    let flushed = client.flush("docs").await.unwrap();
    assert!(flushed >= removed.seq_no);
    let info = client.collection_info("docs").await.unwrap();
    assert_eq!(info.n_documents, 99);
    assert_eq!(info.n_tenants, 2);
    assert!(info.checkpoint_seq_no >= removed.seq_no);

    client.drop_collection("docs").await.unwrap();
    assert!(client.list_collections().await.unwrap().is_empty());
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_keeps_its_code_and_the_server_message() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(ServeConfig::in_process(dir.path())).await;
    let client = Client::connect(format!("http://{}", server.grpc_addr()))
        .await
        .unwrap();
    client
        .create_collection(CollectionSpec::new("c", 4))
        .await
        .unwrap();

    let error = client
        .create_collection(CollectionSpec::new("c", 4))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::AlreadyExists);
    assert!(error.message().contains("'c'"), "{error}");

    let error = client.collection_info("missing").await.unwrap_err();
    assert_eq!(error.code(), Code::NotFound);
    assert!(error.message().contains("missing"), "{error}");
    assert!(!error.is_retryable());

    let error = client
        .insert(Insert::new("c", [1u128], vec![1.0f32, 2.0]))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("vectors"), "{error}");

    let error = client
        .search(Search::new("c", vec![1.0f32; 4]).top_k(0))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("top_k"), "{error}");

    let error = client
        .create_collection(CollectionSpec::new("bad name!", 4))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("name"), "{error}");

    // A read token the collection never reaches: the search gives up at the call's deadline.
    let error = client
        .search(
            Search::new("c", vec![1.0f32; 4])
                .after(ReadToken::from_seq_no(1_000_000))
                .timeout(Duration::from_millis(300)),
        )
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::DeadlineExceeded, "{error}");

    // Nothing listens: UNAVAILABLE, retryable, naming the address.
    server.shutdown().await.unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = listener.local_addr().unwrap().to_string();
    drop(listener);
    let error = Client::connect(closed.as_str()).await.unwrap_err();
    assert_eq!(error.code(), Code::Unavailable, "{error}");
    assert!(error.is_retryable());
    assert!(error.message().contains(&closed), "{error}");

    let error = Client::connect("ftp://example:1").await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_resource_exhausted_and_retryable() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServeConfig::in_process(dir.path());
    config.max_inflight_writes = 1;
    let server = start(config).await;
    let client = Client::connect(server.grpc_addr()).await.unwrap();
    client
        .create_collection(CollectionSpec::new("o", 2))
        .await
        .unwrap();
    let tasks: Vec<_> = (0..64u128)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .insert(Insert::new("o", [i], vec![1.0f32, 2.0]).durability(Durability::Fsync))
                    .await
            })
        })
        .collect();
    let mut codes = Vec::new();
    for task in tasks {
        codes.push(
            task.await
                .unwrap()
                .err()
                .map(|e| (e.code(), e.is_retryable())),
        );
    }
    assert!(codes.contains(&None), "some writes get through");
    assert!(
        codes.contains(&Some((Code::ResourceExhausted, true))),
        "{codes:?}"
    );
    assert!(codes
        .iter()
        .all(|c| matches!(c, None | Some((Code::ResourceExhausted, true)))));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_share_one_client() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(ServeConfig::in_process(dir.path())).await;
    let client = Client::builder(server.grpc_addr())
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap();
    client
        .create_collection(CollectionSpec::new("shared", 4).metric(Metric::Dot))
        .await
        .unwrap();
    let tasks: Vec<_> = (0..200u128)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                let tenant = i % 10;
                let vector = vec![i as f32, 1.0, 0.0, 0.0];
                let ack = client
                    .insert(Insert::new("shared", [i], vector.clone()).users([tenant]))
                    .await?;
                let hits = client
                    .search(
                        Search::new("shared", vector)
                            .users([tenant])
                            .exact(true)
                            .top_k(100)
                            .after(ack.read_token()),
                    )
                    .await?;
                assert!(hits.iter().any(|h| h.doc_id == i), "{i}: {hits:?}");
                assert!(hits.iter().all(|h| h.user_id == tenant));
                Ok::<_, tarn_client::Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(
        client.collection_info("shared").await.unwrap().n_documents,
        200
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_addresses_work() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("tarn.sock");
    let mut config = ServeConfig::in_process(dir.path().join("data"));
    config.listen = format!("unix:{}", socket.display());
    let server = start(config).await;
    assert_eq!(server.grpc_addr(), format!("unix:{}", socket.display()));
    let client = Client::connect(server.grpc_addr()).await.unwrap();
    client
        .create_collection(CollectionSpec::new("u", 2))
        .await
        .unwrap();
    let ack = client
        .insert(Insert::new("u", [5u128], vec![0.5f32, 0.5]))
        .await
        .unwrap();
    let hits = client
        .search(Search::new("u", vec![0.5f32, 0.5]).after(ack.read_token()))
        .await
        .unwrap();
    assert_eq!(hits[0].doc_id, 5);
    server.shutdown().await.unwrap();
    assert!(!socket.exists(), "the socket file is removed at shutdown");
}

fn write_certificate(dir: &Path) -> (String, std::path::PathBuf, std::path::PathBuf) {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
        .expect("a self-signed certificate");
    let (cert_pem, key_pem) = (certified.cert.pem(), certified.signing_key.serialize_pem());
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, &cert_pem).expect("writing the certificate");
    std::fs::write(&key, &key_pem).expect("writing the key");
    (cert_pem, cert, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_api_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_pem, cert, key) = write_certificate(dir.path());
    let mut config = ServeConfig::in_process(dir.path().join("data"));
    config.tls = Some((cert, key));
    config.api_keys = vec!["rw-key".to_owned()];
    config.read_only_keys = vec!["ro-key".to_owned()];
    let server = start(config).await;
    let port = server.grpc_addr().rsplit(':').next().unwrap().to_owned();
    let https = format!("https://localhost:{port}");
    let with_key = |key: Option<&str>| {
        let mut builder = Client::builder(https.as_str()).tls_ca_certificate(cert_pem.clone());
        if let Some(key) = key {
            builder = builder.api_key(key);
        }
        builder.connect()
    };

    let writer = with_key(Some("rw-key")).await.unwrap();
    writer
        .create_collection(CollectionSpec::new("secure", 2))
        .await
        .unwrap();
    let ack = writer
        .insert(Insert::new("secure", [1u128], vec![1.0f32, 0.0]))
        .await
        .unwrap();

    let reader = with_key(Some("ro-key")).await.unwrap();
    let hits = reader
        .search(Search::new("secure", vec![1.0f32, 0.0]).after(ack.read_token()))
        .await
        .unwrap();
    assert_eq!(hits[0].doc_id, 1);
    let error = reader
        .insert(Insert::new("secure", [2u128], vec![1.0f32, 0.0]))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied, "{error}");

    let anonymous = with_key(None).await.unwrap();
    let error = anonymous.list_collections().await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated, "{error}");
    assert!(error.message().contains("authorization"), "{error}");
    // Health needs no key (container healthchecks).
    assert!(anonymous.is_serving().await.unwrap());

    let wrong = with_key(Some("guess")).await.unwrap();
    assert_eq!(
        wrong.list_collections().await.unwrap_err().code(),
        Code::Unauthenticated
    );

    // Plain text against the TLS port fails; so does TLS without trusting the certificate.
    let plain = Client::connect(format!("127.0.0.1:{port}")).await;
    if let Ok(plain) = plain {
        assert!(plain.list_collections().await.is_err());
    }
    let untrusting = Client::builder(https.as_str())
        .api_key("rw-key")
        .connect()
        .await;
    if let Ok(untrusting) = untrusting {
        assert!(untrusting.list_collections().await.is_err());
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_deadline_applies_to_every_call_and_a_call_can_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(ServeConfig::in_process(dir.path())).await;
    let client = Client::builder(server.grpc_addr())
        .timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    client
        .create_collection(CollectionSpec::new("d", 2))
        .await
        .unwrap();
    let never = ReadToken::from_seq_no(u64::MAX / 2);
    let started = std::time::Instant::now();
    let error = client
        .search(Search::new("d", vec![1.0f32, 0.0]).after(never.clone()))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::DeadlineExceeded);
    let waited = started.elapsed();
    // The server answers a fifth of the deadline early (so the status is its own).
    assert!(waited >= Duration::from_millis(120), "{waited:?}");
    // A longer deadline of its own: this call waits longer than the client's default.
    let started = std::time::Instant::now();
    let error = client
        .search(
            Search::new("d", vec![1.0f32, 0.0])
                .after(never)
                .timeout(Duration::from_millis(700)),
        )
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::DeadlineExceeded);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    server.shutdown().await.unwrap();
}
