//! Snapshots and restores through the public API: consistency under concurrent writes and
//! checkpoints, the files a snapshot pins, damaged and hostile files, atomic restores, and a
//! restored collection's numbering.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tarn_collection::{
    remove_interrupted_restores, verify_snapshot, Collection, CollectionConfig, CollectionError,
    Snapshot, SnapshotInfo, SnapshotRestore,
};

use crate::{config, request, runtime, DIM};

/// Documents per tenant the random operations touch, and tenants.
const N_DOCS: u128 = 120;
const N_USERS: u128 = 4;

/// (tenant, doc) -> vector, as acknowledged.
type Model = HashMap<(u128, u128), Vec<f32>>;

#[derive(Debug, Clone)]
enum Op {
    Insert {
        users: Vec<u128>,
        docs: Vec<u128>,
        vectors: Vec<f32>,
    },
    Remove {
        users: Vec<u128>,
        docs: Vec<u128>,
    },
}

fn tenants(users: &[u128]) -> Vec<u128> {
    if users.is_empty() {
        vec![0]
    } else {
        users.to_vec()
    }
}

fn apply(model: &mut Model, op: &Op) {
    match op {
        Op::Insert {
            users,
            docs,
            vectors,
        } => {
            for user in tenants(users) {
                for (doc, vector) in docs.iter().zip(vectors.chunks(DIM)) {
                    model.insert((user, *doc), vector.to_vec());
                }
            }
        }
        Op::Remove { users, docs } => {
            for user in tenants(users) {
                for doc in docs {
                    model.remove(&(user, *doc));
                }
            }
        }
    }
}

/// Upserts (sometimes for two tenants at once, sometimes for the default tenant) and removes.
fn random_op(rng: &mut StdRng) -> Op {
    let users: Vec<u128> = match rng.random_range(0..10) {
        0 => vec![],
        1 => vec![1, 3],
        _ => vec![rng.random_range(0..N_USERS)],
    };
    let docs: Vec<u128> = (0..rng.random_range(1..8))
        .map(|_| rng.random_range(0..N_DOCS))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if rng.random_bool(0.7) {
        let vectors = (0..docs.len() * DIM)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        Op::Insert {
            users,
            docs,
            vectors,
        }
    } else {
        Op::Remove { users, docs }
    }
}

async fn run(c: &Collection, op: &Op) -> u64 {
    match op {
        Op::Insert {
            users,
            docs,
            vectors,
        } => c.insert(docs, users, vectors, None).await.unwrap(),
        Op::Remove { users, docs } => c.remove(docs, users, None).await.unwrap(),
    }
}

/// Applies the logged operations up to `seq_no` in sequence order; checks the log has no gap.
fn model_up_to(log: &[(u64, Op)], seq_no: u64) -> Model {
    let mut ops = log.to_vec();
    ops.sort_by_key(|(seq, _)| *seq);
    for (idx, (seq, _)) in ops.iter().enumerate() {
        assert_eq!(*seq, idx as u64 + 1, "every operation was logged");
    }
    let mut model = Model::new();
    for (_, op) in ops.iter().take_while(|(seq, _)| *seq <= seq_no) {
        apply(&mut model, op);
    }
    model
}

/// `get` of every (tenant, doc), per-tenant counts, and an exact search of each tenant that
/// must return exactly its live documents with their distances.
fn check_model(c: &Collection, model: &Model, when: &str) {
    let stats = c.stats();
    let per_tenant = c.documents_per_tenant();
    assert_eq!(stats.n_documents, model.len() as u64, "{when}: count");
    assert_eq!(
        per_tenant.values().sum::<u64>(),
        stats.n_documents,
        "{when}"
    );
    for user in 0..N_USERS {
        for doc in 0..N_DOCS {
            let got = c.get(user, &[doc]).unwrap();
            match model.get(&(user, doc)) {
                Some(v) => assert_eq!(got, vec![(doc, v.clone())], "{when}: ({user}, {doc})"),
                None => assert!(got.is_empty(), "{when}: ({user}, {doc}) should be absent"),
            }
        }
        let live: HashMap<u128, &Vec<f32>> = model
            .iter()
            .filter(|((u, _), _)| *u == user)
            .map(|((_, d), v)| (*d, v))
            .collect();
        assert_eq!(
            per_tenant.get(&user).copied().unwrap_or(0),
            live.len() as u64,
            "{when}: count of tenant {user}"
        );
        let hits = c
            .search(&request(&[user], &[0.0; DIM], live.len().max(1), true))
            .unwrap();
        let mut found: Vec<u128> = hits.iter().map(|h| h.doc_id).collect();
        found.sort_unstable();
        let mut expected: Vec<u128> = live.keys().copied().collect();
        expected.sort_unstable();
        assert_eq!(found, expected, "{when}: exact search of tenant {user}");
        for hit in &hits {
            let norm = live[&hit.doc_id].iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!(
                (hit.score - norm).abs() < 1e-3,
                "{when}: distance of ({user}, {}) is {} not {norm}",
                hit.doc_id,
                hit.score
            );
        }
    }
}

pub(crate) fn read_all(snapshot: &mut Snapshot) -> Vec<u8> {
    let mut bytes = Vec::new();
    snapshot.read_to_end(&mut bytes).unwrap();
    assert_eq!(bytes.len() as u64, snapshot.total_bytes());
    bytes
}

pub(crate) fn restore(
    bytes: &[u8],
    target: &Path,
    chunk: usize,
) -> tarn_collection::Result<SnapshotInfo> {
    let mut restore = SnapshotRestore::begin(target)?;
    for piece in bytes.chunks(chunk) {
        restore.write(piece)?;
    }
    restore.finish()
}

/// Names in `dir` of restore staging directories.
fn staging_dirs(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(".restore-"))
        .collect()
}

#[test]
fn a_snapshot_under_concurrent_writes_holds_exactly_the_operations_up_to_its_sequence_number() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut cfg = config();
    cfg.graph_threshold = 50;
    let c = Collection::create(&dir.path().join("source"), cfg).unwrap();
    let log: Arc<Mutex<Vec<(u64, Op)>>> = Arc::default();
    // A checkpointed base, so the snapshot holds a segment as well as WAL entries.
    let mut rng = StdRng::seed_from_u64(41);
    rt.block_on(async {
        for round in 0..90 {
            let op = random_op(&mut rng);
            let seq = run(&c, &op).await;
            log.lock().unwrap().push((seq, op));
            if round == 60 {
                c.flush().await.unwrap();
            }
        }
    });
    let n_done = Arc::new(AtomicUsize::new(0));
    let acked_max = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..3u64)
        .map(|writer| {
            let (c, handle, log) = (c.clone(), rt.handle().clone(), Arc::clone(&log));
            let (n_done, acked_max) = (Arc::clone(&n_done), Arc::clone(&acked_max));
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(100 + writer);
                for _ in 0..150 {
                    let op = random_op(&mut rng);
                    let seq = handle.block_on(run(&c, &op));
                    log.lock().unwrap().push((seq, op));
                    acked_max.fetch_max(seq, Ordering::SeqCst);
                    n_done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    while n_done.load(Ordering::SeqCst) < 200 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let acked_before = acked_max.load(Ordering::SeqCst);
    let mut snapshot = c.snapshot().unwrap();
    let seq_no = snapshot.seq_no();
    assert!(
        seq_no >= acked_before,
        "the snapshot ({seq_no}) holds every write acknowledged before it ({acked_before})"
    );
    // Read while the writers go on.
    let bytes = read_all(&mut snapshot);
    assert_eq!(c.n_open_snapshots(), 1);
    drop(snapshot);
    assert_eq!(c.n_open_snapshots(), 0);
    for writer in writers {
        writer.join().unwrap();
    }
    let last = c.stats().last_appended_seq;
    assert!(
        seq_no < last,
        "writes went on after the snapshot ({seq_no} of {last})"
    );
    let model = model_up_to(&log.lock().unwrap(), seq_no);
    let source_stats = c.stats();
    assert!(source_stats.checkpoint_seq > 0);

    let info = verify_snapshot(&bytes[..]).unwrap();
    assert_eq!(
        (
            info.format_version,
            info.seq_no,
            info.n_bytes,
            info.n_segments
        ),
        (1, seq_no, bytes.len() as u64, 1)
    );
    assert_eq!(info.checkpoint_seq, source_stats.checkpoint_seq);
    assert_eq!(info.n_wal_entries, seq_no - info.checkpoint_seq);
    assert_eq!(&info.config, c.config());
    let target = dir.path().join("restored");
    assert_eq!(restore(&bytes, &target, 4096).unwrap(), info);
    assert!(staging_dirs(dir.path()).is_empty());
    {
        let r = Collection::open(&target).unwrap();
        let stats = r.stats();
        assert_eq!(
            (
                stats.last_appended_seq,
                stats.applied_seq,
                stats.checkpoint_seq
            ),
            (seq_no, seq_no, info.checkpoint_seq)
        );
        check_model(&r, &model, "restored");
    }
    let r = Collection::open(&target).unwrap();
    check_model(&r, &model, "restored, reopened");
    drop(r);
    // The same bytes, one at a time.
    let bytewise = dir.path().join("restored-bytewise");
    assert_eq!(restore(&bytes, &bytewise, 1).unwrap(), info);
    let r = Collection::open(&bytewise).unwrap();
    check_model(&r, &model, "restored byte by byte");
}

/// The snapshot's file parts: (kind, name).
fn file_parts(bytes: &[u8]) -> Vec<(u8, String)> {
    let (parts, _) = parse_parts(bytes);
    parts
        .iter()
        .filter(|p| (2..=4).contains(&p.kind))
        .map(|p| (p.kind, p.name.clone()))
        .collect()
}

/// The files the newest two manifests (the current one and its fallback, which checkpoints
/// keep for the collection's own sake) consist of.
fn referenced_by_kept_manifests(dir: &Path) -> HashSet<String> {
    let mut names = HashSet::new();
    let manifests = tarn_testkit::files_starting_with(dir, "MANIFEST-").unwrap();
    for path in manifests.iter().rev().take(2) {
        names.insert(path.file_name().unwrap().to_string_lossy().into_owned());
        let bytes = std::fs::read(path).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&bytes[..bytes.len() - 4]).unwrap();
        for segment in json["segments"].as_array().unwrap() {
            names.insert(segment["file"].as_str().unwrap().to_owned());
            if let Some(tombstones) = segment["tombstones"].as_str() {
                names.insert(tombstones.to_owned());
            }
        }
    }
    names
}

#[test]
fn files_a_snapshot_reads_outlive_the_checkpoints_and_merges_that_run_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("source");
    let rt = runtime();
    let mut cfg = config();
    cfg.graph_threshold = 50;
    cfg.max_sealed_segments = 2;
    // Automatic checkpoints as well as the flushes below.
    cfg.checkpoint_mutable_bytes = 80_000;
    let c = Collection::create(&path, cfg).unwrap();
    let log: Arc<Mutex<Vec<(u64, Op)>>> = Arc::default();
    let round = Arc::new(AtomicUsize::new(0));
    // One thread writes and flushes (each flush seals, and with more than two sealed segments
    // merges); the main thread takes snapshots meanwhile.
    let writer = {
        let (c, handle, log, round) = (
            c.clone(),
            rt.handle().clone(),
            Arc::clone(&log),
            Arc::clone(&round),
        );
        std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(7);
            for r in 0..8 {
                for _ in 0..70 {
                    let op = random_op(&mut rng);
                    let seq = handle.block_on(run(&c, &op));
                    log.lock().unwrap().push((seq, op));
                }
                // Removes make tombstone files and rebuilds as well.
                let docs: Vec<u128> = (0..N_DOCS).filter(|d| d % 9 == r as u128).collect();
                let op = Op::Remove {
                    users: vec![r as u128 % N_USERS],
                    docs,
                };
                let seq = handle.block_on(run(&c, &op));
                log.lock().unwrap().push((seq, op));
                handle.block_on(c.flush()).unwrap();
                round.store(r + 1, Ordering::SeqCst);
            }
        })
    };
    let wait_round = |n: usize| {
        while round.load(Ordering::SeqCst) < n {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    wait_round(2);
    let mut first = c.snapshot().unwrap();
    // Read part of it now, the rest after more checkpoints ran.
    let mut first_bytes = vec![0u8; 1000];
    first.read_exact(&mut first_bytes).unwrap();
    wait_round(4);
    let mut second = c.snapshot().unwrap();
    assert!(second.seq_no() > first.seq_no());
    first.read_to_end(&mut first_bytes).unwrap();
    writer.join().unwrap();
    let second_bytes = read_all(&mut second);
    assert_eq!(c.n_open_snapshots(), 2);

    // With the writes and flushes done, every file both snapshots name is still on disk,
    // though some are no longer needed by the collection itself.
    let kept = referenced_by_kept_manifests(&path);
    let named: Vec<(u8, String)> = file_parts(&first_bytes)
        .into_iter()
        .chain(file_parts(&second_bytes))
        .collect();
    assert!(named.iter().any(|(kind, _)| *kind == 3), "segments");
    let mut n_kept_only_by_pins = 0;
    for (_, name) in &named {
        assert!(
            path.join(name).exists(),
            "{name} was deleted under a snapshot"
        );
        if !kept.contains(name) {
            n_kept_only_by_pins += 1;
        }
    }
    assert!(n_kept_only_by_pins > 0, "the test must outlive its files");
    // Dropped, the next checkpoint deletes what only the snapshots kept.
    drop(first);
    drop(second);
    assert_eq!(c.n_open_snapshots(), 0);
    let mut rng = StdRng::seed_from_u64(8);
    rt.block_on(async {
        let op = random_op(&mut rng);
        let seq = run(&c, &op).await;
        log.lock().unwrap().push((seq, op));
        c.flush().await.unwrap();
    });
    let kept = referenced_by_kept_manifests(&path);
    for (_, name) in &named {
        assert_eq!(
            path.join(name).exists(),
            kept.contains(name),
            "{name}: on disk exactly when a kept manifest needs it"
        );
    }

    for (bytes, which) in [(&first_bytes, "first"), (&second_bytes, "second")] {
        let info = verify_snapshot(&bytes[..]).unwrap();
        let target = dir.path().join(which);
        restore(bytes, &target, 64 << 10).unwrap();
        let model = model_up_to(&log.lock().unwrap(), info.seq_no);
        let r = Collection::open(&target).unwrap();
        assert_eq!(r.stats().last_appended_seq, info.seq_no);
        check_model(&r, &model, which);
    }
}

#[test]
fn a_restored_collection_continues_at_the_next_sequence_number_and_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("source"), config()).unwrap();
    // An empty collection: no manifest, no WAL entry.
    let empty = read_all(&mut c.snapshot().unwrap());
    let info = restore(&empty, &dir.path().join("empty"), 100).unwrap();
    assert_eq!(
        (info.seq_no, info.checkpoint_seq, info.n_segments),
        (0, 0, 0)
    );
    let r = Collection::open(&dir.path().join("empty")).unwrap();
    assert_eq!(r.stats().n_documents, 0);
    assert_eq!(
        rt.block_on(r.insert(&[1], &[], &[1.0; DIM], None)).unwrap(),
        1
    );
    drop(r);

    let mut rng = StdRng::seed_from_u64(5);
    let mut log = Vec::new();
    rt.block_on(async {
        for _ in 0..80 {
            let op = random_op(&mut rng);
            log.push((run(&c, &op).await, op));
        }
        c.flush().await.unwrap();
    });
    // Checkpointed with no WAL entry after it, then with some.
    let at_checkpoint = read_all(&mut c.snapshot().unwrap());
    rt.block_on(async {
        for _ in 0..20 {
            let op = random_op(&mut rng);
            log.push((run(&c, &op).await, op));
        }
    });
    let with_tail = read_all(&mut c.snapshot().unwrap());
    // An idle collection snapshots to the same bytes, whatever the reads' sizes.
    let mut again = c.snapshot().unwrap();
    let mut by_sevens = Vec::new();
    let mut buf = [0u8; 7];
    loop {
        let n = again.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        by_sevens.extend_from_slice(&buf[..n]);
    }
    assert_eq!(by_sevens, with_tail);
    for (bytes, name, n_tail) in [
        (at_checkpoint, "at-checkpoint", 0),
        (with_tail, "with-tail", 20),
    ] {
        let target = dir.path().join(name);
        let info = restore(&bytes, &target, 8192).unwrap();
        assert_eq!(info.n_wal_entries, n_tail, "{name}");
        let seq_no = info.seq_no;
        let mut model = model_up_to(&log, seq_no);
        {
            let r = Collection::open(&target).unwrap();
            check_model(&r, &model, name);
            let far = [7.0f32; DIM];
            let seq = rt.block_on(r.insert(&[5], &[2], &far, None)).unwrap();
            assert_eq!(
                seq,
                seq_no + 1,
                "{name}: the next write continues the numbering"
            );
            model.insert((2, 5), far.to_vec());
            let seq = rt.block_on(r.remove(&[6, 7], &[1], None)).unwrap();
            assert_eq!(seq, seq_no + 2);
            model.remove(&(1, 6));
            model.remove(&(1, 7));
            rt.block_on(r.wait_applied(seq, Duration::from_secs(10)))
                .unwrap();
            check_model(&r, &model, name);
        }
        let r = Collection::open(&target).unwrap();
        assert_eq!(r.stats().last_appended_seq, seq_no + 2);
        check_model(&r, &model, &format!("{name}, reopened"));
        rt.block_on(r.flush()).unwrap();
        drop(r);
        let r = Collection::open(&target).unwrap();
        check_model(&r, &model, &format!("{name}, checkpointed and reopened"));
        assert_eq!(
            rt.block_on(r.insert(&[8], &[], &[1.0; DIM], None)).unwrap(),
            seq_no + 3
        );
    }
}

/// A collection with every kind of part: a manifest, two segments (one with a tombstone
/// file) and a WAL tail of inserts and removes. Returns the snapshot's bytes.
fn snapshot_with_every_part(dir: &Path) -> Vec<u8> {
    let rt = runtime();
    let c = Collection::create(&dir.join("source"), config()).unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    rt.block_on(async {
        let ids: Vec<u128> = (200..260).collect();
        let vectors: Vec<f32> = (0..ids.len() * DIM).map(|i| (i % 17) as f32).collect();
        c.insert(&ids, &[0], &vectors, None).await.unwrap();
        c.flush().await.unwrap();
        for _ in 0..20 {
            run(&c, &random_op(&mut rng)).await;
        }
        c.flush().await.unwrap();
        // Two removes from the first sealed segment, persisted as a tombstone file (too few
        // for a rebuild); then a WAL tail.
        c.remove(&[200, 201], &[0], None).await.unwrap();
        c.flush().await.unwrap();
        for _ in 0..15 {
            run(&c, &random_op(&mut rng)).await;
        }
    });
    let bytes = read_all(&mut c.snapshot().unwrap());
    let kinds: Vec<u8> = parse_parts(&bytes).0.iter().map(|p| p.kind).collect();
    for kind in 1..=5 {
        assert!(kinds.contains(&kind), "part kind {kind} in {kinds:?}");
    }
    bytes
}

/// One part's place in a snapshot file (`docs/SNAPSHOT_FORMAT.md`).
#[derive(Debug, Clone)]
struct PartSpan {
    kind: u8,
    name: String,
    start: usize,
    len_at: usize,
    body: std::ops::Range<usize>,
    crc_at: usize,
    end: usize,
}

/// Splits a well-formed snapshot into its parts; returns them and the end marker's offset.
fn parse_parts(bytes: &[u8]) -> (Vec<PartSpan>, usize) {
    let mut parts = Vec::new();
    let mut pos = 16;
    while bytes[pos] != 255 {
        let name_len = bytes[pos + 1] as usize;
        let name = String::from_utf8(bytes[pos + 2..pos + 2 + name_len].to_vec()).unwrap();
        let len_at = pos + 2 + name_len;
        let body_len = u64::from_le_bytes(bytes[len_at..len_at + 8].try_into().unwrap()) as usize;
        let body = len_at + 8..len_at + 8 + body_len;
        let crc_at = body.end;
        parts.push(PartSpan {
            kind: bytes[pos],
            name,
            start: pos,
            len_at,
            body,
            crc_at,
            end: crc_at + 4,
        });
        pos = crc_at + 4;
    }
    (parts, pos)
}

/// Writes a snapshot file from parts (kind, name, body) with every checksum and length
/// recomputed: the header's declared total (bytes 24..32 of its body) and the end marker's.
fn reframe(version: u32, parts: &[(u8, String, Vec<u8>)]) -> Vec<u8> {
    let total: usize = 16
        + parts
            .iter()
            .map(|(_, name, body)| 1 + 1 + name.len() + 8 + body.len() + 4)
            .sum::<usize>()
        + 13;
    let mut out = b"TARNSNP1".to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    for (kind, name, body) in parts {
        let start = out.len();
        let mut body = body.clone();
        if *kind == 1 {
            body[24..32].copy_from_slice(&(total as u64).to_le_bytes());
        }
        out.push(*kind);
        out.push(name.len() as u8);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        let crc = crc32fast::hash(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
    }
    out.push(255);
    out.extend_from_slice(&(total as u64).to_le_bytes());
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    assert_eq!(out.len(), total);
    out
}

fn parts_of(bytes: &[u8]) -> Vec<(u8, String, Vec<u8>)> {
    parse_parts(bytes)
        .0
        .iter()
        .map(|p| (p.kind, p.name.clone(), bytes[p.body.clone()].to_vec()))
        .collect()
}

/// Both verify and restore refuse `bytes`; the restore leaves nothing behind. Returns the
/// restore's error message.
fn refused(bytes: &[u8], dir: &Path, case: &str) -> String {
    let verified = verify_snapshot(bytes).unwrap_err();
    let target = dir.join("target");
    let restored = restore(bytes, &target, 4096).unwrap_err();
    assert!(
        !target.exists(),
        "{case}: a refused restore left its target"
    );
    assert!(
        staging_dirs(dir).is_empty(),
        "{case}: a refused restore left {:?}",
        staging_dirs(dir)
    );
    for error in [&verified, &restored] {
        assert!(
            matches!(
                error,
                CollectionError::SnapshotDamaged { .. } | CollectionError::SnapshotVersion { .. }
            ),
            "{case}: {error:?}"
        );
        assert!(
            !error.to_string().contains(&*dir.to_string_lossy()),
            "{case}: the message shows a path: {error}"
        );
    }
    assert_eq!(
        verified.to_string(),
        restored.to_string(),
        "{case}: verify and restore agree"
    );
    restored.to_string()
}

#[test]
fn truncated_snapshots_are_refused_at_every_part_boundary_and_in_between() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = snapshot_with_every_part(dir.path());
    let (parts, end_at) = parse_parts(&bytes);
    let mut cuts: BTreeSet<usize> = [0, 1, 7, 8, 12, 15, 16, end_at, end_at + 1, end_at + 9]
        .into_iter()
        .collect();
    for part in &parts {
        for at in [
            part.start,
            part.len_at,
            part.body.start,
            part.crc_at,
            part.end,
        ] {
            cuts.extend([at.saturating_sub(1), at, at + 1]);
        }
    }
    cuts.extend((0..bytes.len()).step_by(bytes.len() / 40));
    cuts.extend(bytes.len() - 4..bytes.len());
    cuts.retain(|&cut| cut < bytes.len());
    let restores = dir.path().join("restores");
    std::fs::create_dir(&restores).unwrap();
    for &cut in &cuts {
        let message = refused(&bytes[..cut], &restores, &format!("cut at {cut}"));
        assert!(message.contains("truncated"), "cut at {cut}: {message}");
        if cut > 16 && cut < end_at {
            assert!(message.contains("part "), "cut at {cut}: {message}");
        }
    }
    assert!(cuts.len() > 60, "{} cuts", cuts.len());
    // Extra bytes after the end are refused too.
    let mut longer = bytes.clone();
    longer.push(0);
    let message = refused(&longer, &restores, "one byte more");
    assert!(message.contains("follow the end"), "{message}");
}

#[test]
fn a_flipped_bit_anywhere_is_refused_naming_the_part() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = snapshot_with_every_part(dir.path());
    let (parts, end_at) = parse_parts(&bytes);
    let restores = dir.path().join("restores");
    std::fs::create_dir(&restores).unwrap();
    let flip = |at: usize, bit: u8| {
        let mut damaged = bytes.clone();
        damaged[at] ^= 1 << bit;
        damaged
    };
    for (idx, part) in parts.iter().enumerate() {
        let number = idx + 1;
        // In the body (first, middle, last byte) and in the checksum: the part's checksum.
        let body = &part.body;
        for at in [
            body.start,
            (body.start + body.end) / 2,
            body.end - 1,
            part.crc_at + 2,
        ] {
            for bit in [0, 5] {
                let case = format!("part {number} ({}), byte {at} bit {bit}", part.name);
                let message = refused(&flip(at, bit), &restores, &case);
                assert!(
                    message.contains(&format!("part {number} (")) && message.contains("checksum"),
                    "{case}: {message}"
                );
            }
        }
        // In the kind, the name and the length: refused, whatever it then looks like.
        for at in [part.start, part.start + 2, part.len_at, part.len_at + 7] {
            let case = format!("part {number} ({}) framing, byte {at}", part.name);
            let message = refused(&flip(at, 1), &restores, &case);
            assert!(
                message.contains("part ") || message.contains("truncated"),
                "{case}: {message}"
            );
        }
    }
    // The file header and the end marker.
    for (at, expected) in [
        (0, "not a tarn snapshot"),
        (7, "not a tarn snapshot"),
        (9, "file header's checksum"),
        (13, "file header's checksum"),
        (end_at, "unknown kind 247"),
        (end_at + 2, "end marker says"),
        (end_at + 10, "whole file"),
    ] {
        let message = refused(&flip(at, 3), &restores, &format!("byte {at}"));
        assert!(message.contains(expected), "byte {at}: {message}");
    }
}

#[test]
fn foreign_newer_and_hostile_files_are_refused_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = snapshot_with_every_part(dir.path());
    let restores = dir.path().join("restores");
    std::fs::create_dir(&restores).unwrap();
    let parts = parts_of(&bytes);
    assert_eq!(
        reframe(1, &parts),
        bytes,
        "the test's encoder follows the format"
    );

    let mut zip = b"PK\x03\x04".to_vec();
    zip.extend_from_slice(&[0u8; 200]);
    for (foreign, case) in [
        (zip, "a zip file"),
        (b"{\"dimension\": 8}".to_vec(), "JSON"),
        (b"TARNSEG1".repeat(20), "a segment file"),
    ] {
        let message = refused(&foreign, &restores, case);
        assert!(message.contains("not a tarn snapshot"), "{case}: {message}");
    }
    let message = refused(&[], &restores, "empty");
    assert!(message.contains("truncated"), "{message}");

    let newer = reframe(2, &parts);
    let message = refused(&newer, &restores, "version 2");
    assert!(
        matches!(
            verify_snapshot(&newer[..]),
            Err(CollectionError::SnapshotVersion {
                found: 2,
                supported: 1
            })
        ),
        "{message}"
    );
    assert!(message.contains("version 2"), "{message}");

    let segment_idx = parts.iter().position(|p| p.0 == 3).unwrap();
    let tomb_idx = parts.iter().position(|p| p.0 == 4).unwrap();
    let wal_idx = parts.iter().position(|p| p.0 == 5).unwrap();
    let renamed = |idx: usize, name: &str| {
        let mut parts = parts.clone();
        parts[idx].1 = name.to_owned();
        reframe(1, &parts)
    };
    for (idx, name, expected) in [
        (
            segment_idx,
            "../seg-000000000001.tseg",
            "does not have a segment file name",
        ),
        (
            segment_idx,
            "../../collection.json",
            "does not have a segment file name",
        ),
        (
            segment_idx,
            "/etc/passwd",
            "does not have a segment file name",
        ),
        (
            segment_idx,
            "seg-000000000999.tseg",
            "is not a file the manifest lists",
        ),
        (
            tomb_idx,
            "seg-000000000001-../x.tomb",
            "does not have a tombstone file name",
        ),
        (wal_idx, "../wal", "should be named \"wal\""),
        (
            1,
            "../MANIFEST-00000000000000000001",
            "does not have a manifest file name",
        ),
        (0, "head/../er", "should be named \"header\""),
    ] {
        let message = refused(&renamed(idx, name), &restores, name);
        assert!(
            message.contains(expected) && message.contains(&format!("part {}", idx + 1)),
            "{name}: {message}"
        );
    }
    let message = refused(
        &renamed(segment_idx, "seg\n0001.tseg"),
        &restores,
        "newline",
    );
    assert!(message.contains("not printable"), "{message}");

    // Parts out of order, repeated, missing, or of an unknown kind.
    let mut swapped = parts.clone();
    swapped.swap(segment_idx, wal_idx);
    let message = refused(&reframe(1, &swapped), &restores, "WAL before a segment");
    assert!(message.contains("comes after"), "{message}");
    let mut repeated = parts.clone();
    repeated.insert(segment_idx, parts[segment_idx].clone());
    let message = refused(&reframe(1, &repeated), &restores, "segment twice");
    assert!(message.contains("repeats a file"), "{message}");
    let mut missing = parts.clone();
    missing.remove(tomb_idx);
    let message = refused(&reframe(1, &missing), &restores, "no tombstone file");
    assert!(message.contains("missing"), "{message}");
    let mut no_wal = parts.clone();
    no_wal.remove(wal_idx);
    let message = refused(&reframe(1, &no_wal), &restores, "no WAL part");
    assert!(message.contains("WAL entries from"), "{message}");
    let mut unknown = parts.clone();
    unknown[segment_idx].0 = 9;
    let message = refused(&reframe(1, &unknown), &restores, "kind 9");
    assert!(message.contains("unknown kind 9"), "{message}");

    // A WAL part whose entries skip a sequence number, and one whose payload is not an
    // operation (checksums recomputed: only the contents are wrong).
    let mut skipped = parts.clone();
    let first_seq = u64::from_le_bytes(skipped[wal_idx].2[0..8].try_into().unwrap());
    skipped[wal_idx].2[0..8].copy_from_slice(&(first_seq + 1).to_le_bytes());
    let message = refused(&reframe(1, &skipped), &restores, "skipped entry");
    assert!(
        message.contains(&format!(
            "WAL entry {} where {first_seq} was expected",
            first_seq + 1
        )),
        "{message}"
    );
    let mut garbage = parts.clone();
    garbage[wal_idx].2[12] = 77; // the first payload's operation code
    let message = refused(&reframe(1, &garbage), &restores, "bad operation");
    assert!(message.contains("is not a valid operation"), "{message}");
    // A segment whose bytes are not a segment (its own checksum fails when restore opens it).
    let mut not_a_segment = parts.clone();
    let body = &mut not_a_segment[segment_idx].2;
    body[30] ^= 0xFF;
    let message = refused_by_restore(&reframe(1, &not_a_segment), &restores);
    assert!(
        message.contains("does not open") && message.contains("checksum"),
        "{message}"
    );

    // Lengths that would make a careless reader allocate: refused before any allocation.
    let (spans, _) = parse_parts(&bytes);
    for span in &spans {
        let mut damaged = bytes.clone();
        damaged[span.len_at..span.len_at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let message = refused(
            &damaged,
            &restores,
            &format!("huge length of {}", span.name),
        );
        assert!(message.contains("out of range"), "{message}");
    }
}

/// Hands out a file in chunks of random sizes (1 byte to 1 KiB).
struct Dribble<'a> {
    bytes: &'a [u8],
    rng: StdRng,
}

impl Read for Dribble<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self
            .rng
            .random_range(1..=1024)
            .min(buf.len())
            .min(self.bytes.len());
        buf[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        Ok(n)
    }
}

#[test]
fn random_damage_is_always_refused_and_never_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = snapshot_with_every_part(dir.path());
    let restores = dir.path().join("restores");
    std::fs::create_dir(&restores).unwrap();
    let mut rng = StdRng::seed_from_u64(99);
    let intact = Dribble {
        bytes: &bytes,
        rng: StdRng::seed_from_u64(1),
    };
    assert!(verify_snapshot(intact).is_ok(), "any chunking reads it");
    let mut n_cases = 0;
    for case in 0..3000 {
        let mut damaged = bytes.clone();
        let len = damaged.len();
        let at = rng.random_range(0..len);
        match rng.random_range(0..5) {
            0 => {
                for _ in 0..rng.random_range(1..4) {
                    let at = rng.random_range(0..len);
                    damaged[at] = rng.random();
                }
            }
            1 => damaged.truncate(at),
            2 => {
                let extra: Vec<u8> = (0..rng.random_range(1..64)).map(|_| rng.random()).collect();
                damaged.splice(at..at, extra);
            }
            3 => {
                let end = (at + rng.random_range(1..256)).min(len);
                damaged.drain(at..end);
            }
            _ => {
                let from = rng.random_range(0..len);
                let n = rng.random_range(1..64).min(len - from).min(len - at);
                damaged.copy_within(from..from + n, at);
            }
        }
        if damaged == bytes {
            continue;
        }
        n_cases += 1;
        let reader = Dribble {
            bytes: &damaged,
            rng: StdRng::seed_from_u64(case),
        };
        assert!(
            verify_snapshot(reader).is_err(),
            "case {case}: a damaged file was accepted"
        );
        if case % 30 == 0 {
            refused(&damaged, &restores, &format!("case {case}"));
        }
    }
    assert!(n_cases > 2900, "{n_cases}");
}

/// verify accepts it (segment contents are not decoded there), restore refuses it.
fn refused_by_restore(bytes: &[u8], dir: &Path) -> String {
    verify_snapshot(bytes).unwrap();
    let target = dir.join("target");
    let error = restore(bytes, &target, 4096).unwrap_err();
    assert!(
        matches!(error, CollectionError::SnapshotDamaged { .. }),
        "{error:?}"
    );
    assert!(!target.exists());
    assert!(staging_dirs(dir).is_empty());
    assert!(
        !error.to_string().contains(&*dir.to_string_lossy()),
        "{error}"
    );
    error.to_string()
}

#[test]
fn restores_are_atomic_and_leave_nothing_when_refused_or_abandoned() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = snapshot_with_every_part(dir.path());
    let parent = dir.path().join("collections");
    std::fs::create_dir(&parent).unwrap();
    let before = |p: &Path| -> BTreeSet<String> {
        std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };

    // The target exists: refused at once, and it is untouched.
    let existing = parent.join("existing");
    std::fs::create_dir(&existing).unwrap();
    std::fs::write(existing.join("keep"), b"mine").unwrap();
    assert!(matches!(
        SnapshotRestore::begin(&existing),
        Err(CollectionError::AlreadyExists { .. })
    ));
    // ... or appears while the restore runs (even as an empty directory): refused at finish.
    let raced = parent.join("raced");
    let mut racing = SnapshotRestore::begin(&raced).unwrap();
    racing.write(&bytes).unwrap();
    std::fs::create_dir(&raced).unwrap();
    assert!(matches!(
        racing.finish(),
        Err(CollectionError::AlreadyExists { .. })
    ));
    assert_eq!(std::fs::read_dir(&raced).unwrap().count(), 0, "untouched");
    assert_eq!(std::fs::read(existing.join("keep")).unwrap(), b"mine");
    assert!(staging_dirs(&parent).is_empty());
    let listing = before(&parent);

    // Refused half way: the staging directory goes at once, and later calls are refused.
    let mut damaged = bytes.clone();
    damaged[bytes.len() / 2] ^= 1;
    let mut refused_restore = SnapshotRestore::begin(&parent.join("damaged")).unwrap();
    let error = refused_restore.write(&damaged).unwrap_err();
    assert!(
        matches!(error, CollectionError::SnapshotDamaged { .. }),
        "{error:?}"
    );
    assert_eq!(
        before(&parent),
        listing,
        "nothing left while the restore is held"
    );
    assert!(matches!(
        refused_restore.write(&damaged[..10]),
        Err(CollectionError::InvalidArgument { .. })
    ));
    assert!(matches!(
        refused_restore.finish(),
        Err(CollectionError::InvalidArgument { .. })
    ));

    // Abandoned half way: dropping it removes everything it wrote.
    for cut in [20, bytes.len() / 2, bytes.len()] {
        let mut abandoned = SnapshotRestore::begin(&parent.join("abandoned")).unwrap();
        abandoned.write(&bytes[..cut]).unwrap();
        assert_eq!(staging_dirs(&parent).len(), 1);
        drop(abandoned);
        assert_eq!(before(&parent), listing, "abandoned after {cut} bytes");
    }

    // A process killed mid-restore leaves its staging directory (here: a restore that is
    // never dropped); the startup clean-up removes it and nothing else.
    let mut killed = SnapshotRestore::begin(&parent.join("killed")).unwrap();
    killed.write(&bytes[..bytes.len() / 2]).unwrap();
    std::mem::forget(killed);
    std::fs::write(
        parent.join(".restore-note"),
        b"a file, not a staging directory",
    )
    .unwrap();
    assert_eq!(staging_dirs(&parent).len(), 2, "the directory and the note");
    assert_eq!(remove_interrupted_restores(&parent).unwrap(), 1);
    assert_eq!(staging_dirs(&parent), vec![".restore-note".to_owned()]);
    assert!(existing.join("keep").exists() && raced.exists());
    assert_eq!(
        remove_interrupted_restores(&dir.path().join("none")).unwrap(),
        0
    );

    // And a complete restore into a fresh name works beside all that.
    let info = restore(&bytes, &parent.join("good"), 1 << 20).unwrap();
    let r = Collection::open(&parent.join("good")).unwrap();
    assert_eq!(r.stats().last_appended_seq, info.seq_no);
}

#[test]
fn snapshots_and_restores_can_move_to_a_blocking_thread() {
    fn send<T: Send + 'static>() {}
    send::<Snapshot>();
    send::<SnapshotRestore>();
    send::<SnapshotInfo>();
}

#[test]
fn a_config_is_carried_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: CollectionConfig = config();
    cfg.metric = tarn_collection::MetricName::Cosine;
    cfg.hnsw.m = 12;
    cfg.max_sealed_segments = 3;
    let c = Collection::create(&dir.path().join("source"), cfg.clone()).unwrap();
    let bytes = read_all(&mut c.snapshot().unwrap());
    assert_eq!(verify_snapshot(&bytes[..]).unwrap().config, cfg);
    restore(&bytes, &dir.path().join("copy"), 7).unwrap();
    assert_eq!(
        Collection::open(&dir.path().join("copy")).unwrap().config(),
        &cfg
    );
}

/// Attributes through a snapshot and its restore, and through a move's copy (a snapshot, then
/// its WAL tail appended to the restored copy): fields added before the snapshot's checkpoint
/// come in the snapshot's config, fields added after it come with the log, before the
/// documents that use them.
#[test]
fn snapshots_restores_and_wal_tails_carry_attributes_and_added_fields() {
    use crate::attributes::{
        attributed_config, check, filtered, insert, only, random_attributes, random_vector, Model,
    };
    use tarn_collection::{Attributes, FieldSpec, FieldType, Filter, Value};

    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("source"), attributed_config()).unwrap();
    let mut rng = StdRng::seed_from_u64(9);
    let queries: Vec<Vec<f32>> = (0..3).map(|_| random_vector(&mut rng)).collect();
    let mut model = Model::new();
    let with = |rng: &mut StdRng, field: &str, value: Value| -> Attributes {
        let mut attributes = random_attributes(rng);
        attributes.insert(field, value);
        attributes
    };
    rt.block_on(async {
        insert(&c, &mut model, &mut rng, &[1], 0..300, None).await;
        insert(&c, &mut model, &mut rng, &[2], 0..200, None).await;
        insert(
            &c,
            &mut model,
            &mut rng,
            &[1],
            2000..2001,
            Some(&only("only-one")),
        )
        .await;
        insert(
            &c,
            &mut model,
            &mut rng,
            &[1],
            3000..3009,
            Some(&only("nine")),
        )
        .await;
        c.add_fields(vec![FieldSpec::new("colour", FieldType::Keyword)])
            .await
            .unwrap();
        let red = with(&mut rng, "colour", Value::Keyword("red".into()));
        insert(&c, &mut model, &mut rng, &[2], 500..520, Some(&red)).await;
        c.flush().await.unwrap();
    });
    // The colour field is before this snapshot's checkpoint.
    let mut at_checkpoint = c.snapshot().unwrap();
    let at_checkpoint_bytes = read_all(&mut at_checkpoint);
    let mut tail = c.wal_tail(at_checkpoint);
    rt.block_on(async {
        c.add_fields(vec![FieldSpec::new("weight", FieldType::Number)])
            .await
            .unwrap();
        let heavy = with(&mut rng, "weight", Value::Number(3.5));
        insert(&c, &mut model, &mut rng, &[1], 600..612, Some(&heavy)).await;
        let removed: Vec<u128> = (0..300).step_by(5).collect();
        let seq = c.remove(&removed, &[1], None).await.unwrap();
        for doc in removed {
            model.remove(&(1, doc));
        }
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    let weighted = Filter::Exists("weight".to_string());
    let n_weighted = |c: &Collection| {
        c.search(&filtered(&[1, 2], &[0.0; DIM], 1000, false, &weighted))
            .unwrap()
            .len()
    };
    check(&c, &model, &queries, "source");
    assert_eq!(n_weighted(&c), 12);

    // A restore of a snapshot whose log adds the weight field.
    let bytes = read_all(&mut c.snapshot().unwrap());
    restore(&bytes, &dir.path().join("restored"), 4096).unwrap();
    let r = Collection::open(&dir.path().join("restored")).unwrap();
    assert_eq!(r.schema(), c.schema());
    check(&r, &model, &queries, "restored");
    assert_eq!(n_weighted(&r), 12);
    drop(r);
    let r = Collection::open(&dir.path().join("restored")).unwrap();
    assert_eq!(r.config().fields, c.schema().fields().to_vec());
    check(&r, &model, &queries, "restored and reopened");

    // A move: the snapshot at the checkpoint, then the log after it.
    restore(&at_checkpoint_bytes, &dir.path().join("copy"), 4096).unwrap();
    let copy = Collection::open(&dir.path().join("copy")).unwrap();
    assert_eq!(
        copy.schema().len(),
        5,
        "colour came with the snapshot's config"
    );
    let mut copied = Vec::new();
    loop {
        let batch = tail.read(u64::MAX, 1 << 20).unwrap();
        if batch.is_empty() {
            break;
        }
        copied.extend(batch);
    }
    let last = rt.block_on(async {
        let last = copy
            .append_copied(copied, tarn_collection::Durability::Fsync)
            .await
            .unwrap();
        copy.wait_applied(last, Duration::from_secs(10))
            .await
            .unwrap();
        last
    });
    assert_eq!(last, c.last_seq_no());
    assert_eq!(copy.schema(), c.schema());
    check(&copy, &model, &queries, "copied");
    assert_eq!(n_weighted(&copy), 12);
}
