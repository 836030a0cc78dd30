//! Damaged files after a crash, against the real server: the tail of the WAL cut, bit-flipped or
//! zero-filled after a SIGKILL (the server starts, logs what it cut, and serves every entry
//! before the damage and nothing after it); the newest checkpoint damaged (the server falls back
//! to the previous checkpoint plus a longer WAL replay, nothing lost); no valid checkpoint left
//! (the server refuses to start, naming the file).
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tarn_proto::v1 as pb;

mod common;
use common::*;

const DIM: usize = 4;
const COLLECTION: &str = "damage";
const WAL_HEADER: usize = 32;
const ENTRY_HEADER: usize = 16;

fn vector(doc: u128, seq_hint: u64) -> Vec<f32> {
    (0..DIM)
        .map(|i| doc as f32 + seq_hint as f32 / 1000.0 + i as f32)
        .collect()
}

/// (tenant, doc) -> vector.
type State = BTreeMap<(u128, u128), Vec<f32>>;

enum Op {
    Upsert(u128, Vec<u128>, Vec<Vec<f32>>),
    Remove(u128, Vec<u128>),
}

fn apply(state: &mut State, op: &Op) {
    match op {
        Op::Upsert(tenant, docs, vectors) => {
            for (d, v) in docs.iter().zip(vectors) {
                state.insert((*tenant, *d), v.clone());
            }
        }
        Op::Remove(tenant, docs) => {
            for d in docs {
                state.remove(&(*tenant, *d));
            }
        }
    }
}

const TENANTS: [u128; 2] = [1, 2];
const DOCS: u128 = 60;

/// Runs `n` random acknowledged operations from one client; returns them with their seq_no.
async fn load(server: &Server, rng: &mut StdRng, n: usize, tag: u64) -> Vec<(u64, Op)> {
    let mut client = server.client().await;
    let mut done = Vec::new();
    for i in 0..n {
        let tenant = TENANTS[rng.random_range(0..2)];
        let docs: Vec<u128> = (0..rng.random_range(1..6))
            .map(|_| rng.random_range(0..DOCS))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let op = if rng.random_bool(0.75) {
            let vectors: Vec<Vec<f32>> = docs
                .iter()
                .map(|d| vector(*d, tag * 10_000 + i as u64))
                .collect();
            Op::Upsert(tenant, docs, vectors)
        } else {
            Op::Remove(tenant, docs)
        };
        let seq = match &op {
            Op::Upsert(tenant, docs, vectors) => {
                client
                    .insert(insert(COLLECTION, docs, &[*tenant], vectors.concat()))
                    .await
                    .unwrap()
                    .into_inner()
                    .seq_no
            }
            Op::Remove(tenant, docs) => {
                client
                    .remove(pb::RemoveRequest {
                        collection: COLLECTION.into(),
                        doc_ids: docs.iter().map(|d| id(*d)).collect(),
                        user_ids: vec![id(*tenant)],
                        durability: 0,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .seq_no
            }
        };
        done.push((seq, op));
    }
    done
}

async fn stored(server: &Server) -> State {
    let mut client = server.client().await;
    let mut state = State::new();
    for tenant in TENANTS {
        let docs = client
            .get(pb::GetRequest {
                collection: COLLECTION.into(),
                user_id: Some(id(tenant)),
                doc_ids: (0..DOCS).chain([999]).map(id).collect(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .docs;
        for d in docs {
            state.insert((tenant, d.doc_id.unwrap().low as u128), d.vector);
        }
    }
    state
}

/// The entries of a WAL segment file: (offset, total length, seq).
fn frames(bytes: &[u8]) -> Vec<(usize, usize, u64)> {
    let mut out = Vec::new();
    let mut at = WAL_HEADER;
    while at + ENTRY_HEADER <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let seq = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap());
        if len == 0 && seq == 0 {
            break; // the preallocated zeros after the last entry
        }
        out.push((at, ENTRY_HEADER + len, seq));
        at += ENTRY_HEADER + len;
    }
    out
}

fn last_wal_segment(data: &Path) -> PathBuf {
    let mut segments: Vec<PathBuf> =
        std::fs::read_dir(data.join("collections").join(COLLECTION).join("wal"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "wal"))
            .collect();
    segments.sort();
    segments.pop().unwrap()
}

#[test]
fn a_damaged_wal_tail_is_cut_and_everything_before_it_is_served() {
    let rt = runtime();
    for (seed, mode) in (1..=9u64).zip(["truncate", "flip", "zero"].iter().cycle()) {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        let server = Server::start(dir.path(), &[]);
        let ops = rt.block_on(async {
            let mut c = server.client().await;
            c.create_collection(create(COLLECTION, DIM as u32, pb::Metric::L2))
                .await
                .unwrap();
            load(&server, &mut rng, 80, seed).await
        });
        server.kill();

        let path = last_wal_segment(dir.path());
        let mut bytes = std::fs::read(&path).unwrap();
        let entries = frames(&bytes);
        assert!(entries.len() >= 80, "{} entries", entries.len());
        // Damage inside the last 10 entries.
        let first = entries.len() - 10;
        let (last_intact, cut_at) = match *mode {
            "truncate" | "zero" => {
                let (start, _, _) = entries[first];
                let end = entries.last().map(|(o, l, _)| o + l).unwrap();
                let offset = rng.random_range(start..end);
                let intact = entries
                    .iter()
                    .take_while(|(o, l, _)| o + l <= offset)
                    .last()
                    .map_or(0, |e| e.2);
                if *mode == "truncate" {
                    bytes.truncate(offset);
                } else {
                    bytes[offset..end].iter_mut().for_each(|b| *b = 0);
                }
                (intact, offset)
            }
            _ => {
                // A flipped bit in the last entry (header or payload).
                let (o, l, _) = *entries.last().unwrap();
                let offset = rng.random_range(o..o + l);
                bytes[offset] ^= 1 << rng.random_range(0..8);
                (entries[entries.len() - 2].2, offset)
            }
        };
        std::fs::write(&path, &bytes).unwrap();

        let server = Server::start(dir.path(), &[]);
        let mut expected = State::new();
        for (seq, op) in &ops {
            if *seq <= last_intact {
                apply(&mut expected, op);
            }
        }
        let got = rt.block_on(stored(&server));
        assert_eq!(
            got, expected,
            "seed {seed}, {mode} at byte {cut_at}: state must be exactly the entries up to seq {last_intact}"
        );
        let logs = server.logs();
        assert!(
            logs.contains("cut") || logs.contains("torn"),
            "seed {seed}: the server should log what it cut: {logs}"
        );
        // And it keeps working: a new write is acknowledged and survives another restart.
        rt.block_on(async {
            let mut c = server.client().await;
            c.insert(insert(COLLECTION, &[999], &[1], vec![9.0; DIM]))
                .await
                .unwrap();
        });
        server.kill();
        let server = Server::start(dir.path(), &[]);
        let after = rt.block_on(stored(&server));
        assert_eq!(
            after.len(),
            expected.len() + 1 - usize::from(expected.contains_key(&(1, 999)))
        );
        assert_eq!(after.get(&(1, 999)), Some(&vec![9.0; DIM]));
    }
}

#[test]
fn a_damaged_newest_checkpoint_falls_back_and_nothing_valid_left_refuses_to_start() {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(42);
    let server = Server::start(dir.path(), &[]);
    let mut expected = State::new();
    rt.block_on(async {
        let mut c = server.client().await;
        c.create_collection(create(COLLECTION, DIM as u32, pb::Metric::L2))
            .await
            .unwrap();
        for round in 0..3 {
            for (_, op) in load(&server, &mut rng, 40, round).await {
                apply(&mut expected, &op);
            }
            c.flush(pb::FlushRequest {
                collection: COLLECTION.into(),
            })
            .await
            .unwrap();
        }
        for (_, op) in load(&server, &mut rng, 20, 9).await {
            apply(&mut expected, &op);
        }
    });
    server.kill();

    let collection_dir = dir.path().join("collections").join(COLLECTION);
    let manifests = tarn_testkit::files_starting_with(&collection_dir, "MANIFEST-").unwrap();
    let newest = manifests.last().unwrap().clone();
    let mut bytes = std::fs::read(&newest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&newest, &bytes).unwrap();

    let server = Server::start(dir.path(), &[]);
    assert_eq!(
        rt.block_on(stored(&server)),
        expected,
        "fell back to the previous checkpoint and replayed the WAL"
    );
    server.kill();

    // Damage every sealed segment: no checkpoint is valid any more.
    damage_files(&collection_dir, "tseg");
    match Server::try_start(dir.path(), &[], &[]) {
        Ok(_) => panic!("the server started without a valid checkpoint"),
        Err(log) => assert!(
            log.contains(".tseg") || log.contains("MANIFEST"),
            "the refusal should name the file: {log}"
        ),
    }
}

/// A collection with `vectors_on_disk`: sealed vectors are read from the segment file only to
/// rescore and for Get. Damaged in place while the server runs, they are answered DATA_LOSS
/// (never a wrong vector or a wrong ranking); the other tenants' documents are still served.
#[test]
fn damaged_vectors_on_disk_are_answered_data_loss_never_served() {
    const N: usize = 1_500; // over the default graph threshold (1,024): one cold partition
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let vectors: Vec<f32> = (0..N * DIM)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0)
        .collect();
    rt.block_on(async {
        let mut c = server.client().await;
        let mut request = create(COLLECTION, DIM as u32, pb::Metric::L2);
        request.quantization = Some(pb::Quantization {
            kind: pb::QuantizationKind::QuantizationInt8 as i32,
            bits: 0,
            rescore: 0,
        });
        request.vectors_on_disk = true;
        c.create_collection(request).await.unwrap();
        let docs: Vec<u128> = (0..N as u128).collect();
        c.insert(insert(COLLECTION, &docs, &[1], vectors.clone()))
            .await
            .unwrap();
        c.insert(insert(COLLECTION, &[5], &[2], vec![0.5; DIM]))
            .await
            .unwrap();
        c.flush(pb::FlushRequest {
            collection: COLLECTION.into(),
        })
        .await
        .unwrap();
        let info = collection_info(&mut c, COLLECTION).await;
        assert!(info.vectors_on_disk);
        assert_eq!(info.cold_bytes, (N * DIM * 4) as u64, "{info:?}");
        let got = c
            .get(pb::GetRequest {
                collection: COLLECTION.into(),
                user_id: Some(id(1)),
                doc_ids: vec![id(3)],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.docs[0].vector, vectors[3 * DIM..4 * DIM]);
    });

    // Tenant 1's vectors start after the segment header (37 bytes) and its partition's
    // (user, slots, indexed) fields (24 bytes): overwrite all of them in place.
    let collection_dir = dir.path().join("collections").join(COLLECTION);
    let segments = tarn_testkit::files_starting_with(&collection_dir, "").unwrap();
    let segment = segments
        .iter()
        .find(|p| p.extension().is_some_and(|e| e == "tseg"))
        .unwrap();
    let mut bytes = std::fs::read(segment).unwrap();
    bytes[61..61 + N * DIM * 4].fill(0x5a);
    std::fs::write(segment, &bytes).unwrap();

    rt.block_on(async {
        let mut c = server.client().await;
        let status = c
            .get(pb::GetRequest {
                collection: COLLECTION.into(),
                user_id: Some(id(1)),
                doc_ids: vec![id(3)],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::DataLoss, "{status:?}");
        assert!(status.message().contains("checksum"), "{status:?}");
        assert!(
            !status.message().contains(".tseg"),
            "no server path: {status:?}"
        );
        let status = c
            .search(search(COLLECTION, &[1], vectors[..DIM].to_vec(), 5))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::DataLoss, "{status:?}");
        // Tenant 2's document (in memory: below the graph threshold) is still served.
        let hits = c
            .search(search(COLLECTION, &[2], vec![0.5; DIM], 5))
            .await
            .unwrap()
            .into_inner()
            .hits;
        assert_eq!(hits.len(), 1);
    });
    server.kill();
}
