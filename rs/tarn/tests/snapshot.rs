//! Snapshots through the real `tarn` binary: a snapshot taken under concurrent inserts, upserts
//! and removes of several tenants (with checkpoints forced meanwhile) restores to exactly the
//! acknowledged operations up to its sequence number, also after the restoring server restarts;
//! kill -9 in the middle of a snapshot and of a restore leaves a clean server, no partial
//! collection and no leaked files; the CLI's create, verify, restore and offline restore.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{run_cli, runtime, Server};
use rand::{Rng, SeedableRng};
use tarn_client::{Client, Code, CollectionSpec, Durability, Insert, Metric, Remove, Search};
use tarn_proto::v1 as pb;

const DIM: usize = 8;
const TENANTS: [u128; 3] = [1, 2, (1u128 << 90) + 3];
const DOCS_PER_TENANT: u128 = 150;

/// One acknowledged write: its sequence number, tenant, document and the vector (None: removed).
type Op = (u64, u128, u128, Option<Vec<f32>>);

/// The state after every op with seq_no <= `upto`, applied in sequence order.
fn model(ops: &[Op], upto: u64) -> BTreeMap<(u128, u128), Vec<f32>> {
    let mut sorted: Vec<&Op> = ops.iter().filter(|op| op.0 <= upto).collect();
    sorted.sort_by_key(|op| op.0);
    let mut state = BTreeMap::new();
    for (_, user, doc, vector) in sorted {
        match vector {
            Some(v) => state.insert((*user, *doc), v.clone()),
            None => state.remove(&(*user, *doc)),
        };
    }
    state
}

/// Checks a collection against the model: every document of every tenant (Get), the count, and
/// exact search for a few stored vectors against a brute-force answer over the model.
async fn assert_matches(client: &Client, name: &str, want: &BTreeMap<(u128, u128), Vec<f32>>) {
    let all_docs: Vec<u128> = (0..DOCS_PER_TENANT).collect();
    for &user in &TENANTS {
        let got: BTreeMap<u128, Vec<f32>> = client
            .get(name, user, &all_docs)
            .await
            .unwrap()
            .into_iter()
            .map(|d| (d.doc_id, d.vector))
            .collect();
        let expected: BTreeMap<u128, Vec<f32>> = want
            .iter()
            .filter(|((u, _), _)| *u == user)
            .map(|((_, d), v)| (*d, v.clone()))
            .collect();
        assert_eq!(got, expected, "tenant {user} of {name}");
        for (&doc, query) in expected.iter().take(3) {
            let hits = client
                .search(
                    Search::new(name, query.as_slice())
                        .users([user])
                        .top_k(5)
                        .exact(true),
                )
                .await
                .unwrap();
            let mut truth: Vec<(f32, u128)> = expected
                .iter()
                .map(|(d, v)| {
                    let dist: f32 = v.iter().zip(query).map(|(a, b)| (a - b) * (a - b)).sum();
                    (dist.sqrt(), *d)
                })
                .collect();
            truth.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            assert_eq!(hits[0].doc_id, doc, "tenant {user}: {hits:?}");
            for (hit, (dist, _)) in hits.iter().zip(&truth) {
                assert!((hit.score - dist).abs() < 1e-3, "{hits:?} vs {truth:?}");
            }
        }
    }
    let info = client.collection_info(name).await.unwrap();
    assert_eq!(info.n_documents, want.len() as u64, "{name}");
}

async fn snapshot_to_file(client: &Client, name: &str, path: &Path) -> u64 {
    let stream = client.create_snapshot(name).await.unwrap();
    let seq_no = stream.seq_no();
    let mut file = tokio::fs::File::create(path).await.unwrap();
    stream.write_to(&mut file).await.unwrap();
    seq_no
}

#[test]
fn a_snapshot_under_concurrent_writes_restores_exactly_the_acknowledged_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let file = dir.path().join("live.tsnap");
    let server = Server::start(&data, &[]);
    let rt = runtime();
    let ops: Arc<Mutex<Vec<Op>>> = Arc::default();
    let snap_seq = rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        client
            .create_collection(CollectionSpec::new("live", DIM as u32).metric(Metric::L2))
            .await
            .unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        for (w, &user) in TENANTS.iter().enumerate() {
            let (client, ops, stop) = (client.clone(), Arc::clone(&ops), Arc::clone(&stop));
            writers.push(tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64 + 1);
                let mut n = 0;
                // At least 300 writes each, then on until the snapshot is taken.
                while n < 300 || !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let doc = rng.random_range(0..DOCS_PER_TENANT);
                    if rng.random_bool(0.2) {
                        let ack = client
                            .remove(Remove::new("live", [doc]).users([user]))
                            .await
                            .unwrap();
                        ops.lock().unwrap().push((ack.seq_no, user, doc, None));
                    } else {
                        let vector: Vec<f32> =
                            (0..DIM).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                        let durability = if rng.random_bool(0.5) {
                            Durability::Fsync
                        } else {
                            Durability::Written
                        };
                        let ack = client
                            .insert(
                                Insert::new("live", [doc], vector.clone())
                                    .users([user])
                                    .durability(durability),
                            )
                            .await
                            .unwrap();
                        ops.lock()
                            .unwrap()
                            .push((ack.seq_no, user, doc, Some(vector)));
                    }
                    n += 1;
                    if n > 3000 {
                        break;
                    }
                }
            }));
        }
        // Checkpoints (and merges) run while the snapshot is taken.
        let flusher = {
            let (client, stop) = (client.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    client.flush("live").await.unwrap();
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            })
        };
        while ops.lock().unwrap().len() < 400 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let seq = snapshot_to_file(&client, "live", &file).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            writer.await.unwrap();
        }
        flusher.await.unwrap();
        seq
    });
    let ops = ops.lock().unwrap().clone();
    assert!(
        ops.iter().any(|op| op.0 > snap_seq),
        "writes went on after the snapshot's sequence number"
    );
    let want = model(&ops, snap_seq);
    let live = model(&ops, u64::MAX);

    let verify = std::process::Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["snapshot", "verify", "--in", file.to_str().unwrap()])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&verify.stdout);
    assert!(verify.status.success(), "{out}");
    assert!(out.contains(&format!("seq_no {snap_seq}")), "{out}");
    rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        let restored = client
            .restore_snapshot("copy", tokio::fs::File::open(&file).await.unwrap())
            .await
            .unwrap();
        assert_eq!(restored.seq_no, snap_seq);
        assert_matches(&client, "copy", &want).await;
        assert_matches(&client, "live", &live).await;
        // The restored collection goes on at seq_no + 1.
        let ack = client
            .insert(Insert::new("copy", [0u128], vec![0.0f32; DIM]).users([TENANTS[0]]))
            .await
            .unwrap();
        assert_eq!(ack.seq_no, snap_seq + 1);
        client
            .remove(Remove::new("copy", [0u128]).users([TENANTS[0]]))
            .await
            .unwrap();
    });
    // Across a restart of the restoring server.
    assert!(server.terminate().success());
    let server = Server::start(&data, &[]);
    rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        let mut want = want.clone();
        want.remove(&(TENANTS[0], 0));
        assert_matches(&client, "copy", &want).await;
        assert_matches(&client, "live", &live).await;
    });
}

/// Files of a collection directory that no manifest names (`.tseg`, `.tomb`), after checkpoints.
fn unreferenced_segment_files(collection_dir: &Path) -> Vec<String> {
    let mut referenced = std::collections::HashSet::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(collection_dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.starts_with("MANIFEST-") {
            let bytes = std::fs::read(collection_dir.join(&name)).unwrap();
            let text = String::from_utf8_lossy(&bytes[..bytes.len() - 4]).into_owned();
            for piece in text.split('"') {
                if piece.ends_with(".tseg") || piece.ends_with(".tomb") {
                    referenced.insert(piece.to_owned());
                }
            }
        } else if name.ends_with(".tseg") || name.ends_with(".tomb") {
            files.push(name);
        }
    }
    files.retain(|f| !referenced.contains(f));
    files
}

async fn fill(client: &Client, name: &str, n: u128, dim: usize) {
    client
        .create_collection(CollectionSpec::new(name, dim as u32).metric(Metric::L2))
        .await
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for start in (0..n).step_by(1000) {
        let end = (start + 1000).min(n);
        let vectors: Vec<f32> = (0..(end - start) as usize * dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        client
            .insert(Insert::new(name, (start..end).collect::<Vec<_>>(), vectors))
            .await
            .unwrap();
    }
}

#[test]
fn kill_9_in_the_middle_of_a_snapshot_or_a_restore_leaves_a_clean_server() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let file = dir.path().join("big.tsnap");
    let server = Server::start(&data, &[]);
    let rt = runtime();
    // 20,000 x 64-d: a snapshot of several 1 MiB chunks.
    let n_docs = rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        fill(&client, "big", 20_000, 64).await;
        client.flush("big").await.unwrap();
        client
            .insert(Insert::new("big", [1_000_000u128], vec![0.5f32; 64]))
            .await
            .unwrap();
        snapshot_to_file(&client, "big", &file).await;
        // A second snapshot, killed after its first chunk.
        let mut stream = client.create_snapshot("big").await.unwrap();
        assert!(stream.total_bytes() > 3 << 20, "{}", stream.total_bytes());
        stream.next_chunk().await.unwrap().unwrap();
        client.collection_info("big").await.unwrap().n_documents
    });
    server.kill();

    let server = Server::start(&data, &[]);
    rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        assert_eq!(
            client.collection_info("big").await.unwrap().n_documents,
            n_docs
        );
        // Checkpoints after the restart delete whatever the killed snapshot had pinned.
        client
            .insert(Insert::new("big", [1_000_001u128], vec![0.25f32; 64]))
            .await
            .unwrap();
        client.flush("big").await.unwrap();
        client.flush("big").await.unwrap();
    });
    let leaked = unreferenced_segment_files(&data.join("collections").join("big"));
    assert!(leaked.is_empty(), "files no manifest names: {leaked:?}");

    // A restore killed half-way through its upload.
    let bytes = std::fs::read(&file).unwrap();
    rt.block_on(async {
        let mut raw = server.client().await;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let half = bytes.len() / 2;
        tx.send(pb::RestoreSnapshotRequest {
            collection: "half".into(),
            data: bytes[..half].to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
        // The call stays open (it ends with the server): never awaited.
        tokio::spawn(async move {
            let _ = raw
                .restore_snapshot(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await;
        });
        // Wait until the server has staged part of it.
        let collections = data.join("collections");
        for _ in 0..200 {
            let staged = std::fs::read_dir(&collections).unwrap().any(|e| {
                e.unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(".restore-")
            });
            if staged {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        std::mem::forget(tx); // the upload never ends: the server is killed mid-stream
    });
    server.kill();

    let server = Server::start(&data, &[]);
    let entries: Vec<String> = std::fs::read_dir(data.join("collections"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        entries
            .iter()
            .all(|e| e != "half" && !e.starts_with(".restore-")),
        "{entries:?}"
    );
    rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        assert_eq!(client.list_collections().await.unwrap(), vec!["big"]);
        // The whole file restores, and the name is free again.
        let restored = client
            .restore_snapshot("half", tokio::fs::File::open(&file).await.unwrap())
            .await
            .unwrap();
        assert_eq!(restored.collection.n_documents, n_docs);
    });
}

#[test]
fn the_cli_backs_up_verifies_and_restores_online_and_offline() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let file = dir.path().join("docs.tsnap");
    let server = Server::start(&data, &[]);
    let rt = runtime();
    rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        fill(&client, "docs", 3_000, 16).await;
    });
    let path = file.to_str().unwrap();
    let out = run_cli(
        &server.addr,
        &["snapshot", "create", "--collection", "docs", "--out", path],
    );
    assert!(out.contains("snapshot of docs at seq_no"), "{out}");
    let out = run_cli(
        &server.addr,
        &["snapshot", "restore", "--in", path, "--collection", "docs2"],
    );
    assert!(out.contains("3000 documents"), "{out}");

    // Onto a taken name: refused, ALREADY_EXISTS.
    let taken = std::process::Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["snapshot", "restore", "--in", path, "--collection", "docs"])
        .args(["--addr", &server.addr])
        .output()
        .unwrap();
    assert!(!taken.status.success());
    assert!(
        String::from_utf8_lossy(&taken.stderr).contains("ALREADY_EXISTS"),
        "{}",
        String::from_utf8_lossy(&taken.stderr)
    );
    rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        let error = client.collection_info("nope").await.unwrap_err();
        assert_eq!(error.code(), Code::NotFound);
    });

    // Offline: refused while the server holds the data directory, done once it is stopped.
    let offline = |name: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tarn"))
            .args(["snapshot", "restore", "--in", path, "--collection", name])
            .arg("--data-dir")
            .arg(&data)
            .output()
            .unwrap()
    };
    let busy = offline("docs3");
    assert!(!busy.status.success());
    assert!(String::from_utf8_lossy(&busy.stderr).contains("another tarn server"));
    assert!(server.terminate().success());
    let done = offline("docs3");
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let server = Server::start(&data, &[]);
    rt.block_on(async {
        let client = Client::connect(server.addr.as_str()).await.unwrap();
        for name in ["docs", "docs2", "docs3"] {
            assert_eq!(
                client.collection_info(name).await.unwrap().n_documents,
                3000,
                "{name}"
            );
        }
    });

    // A damaged file is refused by verify and by restore, naming the damage.
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x10;
    let damaged = dir.path().join("damaged.tsnap");
    std::fs::write(&damaged, &bytes).unwrap();
    let verify = std::process::Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["snapshot", "verify", "--in", damaged.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!verify.status.success());
    assert!(
        String::from_utf8_lossy(&verify.stderr).contains("snapshot refused"),
        "{}",
        String::from_utf8_lossy(&verify.stderr)
    );
}
