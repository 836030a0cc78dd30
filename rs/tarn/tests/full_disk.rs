//! A full disk, for real: the server runs on a size-capped tmpfs (72 MiB), all but 12 MiB of the
//! space is taken by a filler file, and a client writes until the log cannot grow (its segments
//! reserve 1, 2, 4, then 8 MiB: the fourth does not fit). Checked: the first failing write is
//! RESOURCE_EXHAUSTED, nothing acknowledged is lost, searches keep working, and after the space
//! is freed writes succeed again after a restart (a WAL that failed to grow is poisoned and stays
//! so until restart: docs/RELIABILITY.md).
//!
//! Mounting needs root (CAP_SYS_ADMIN): without it the test says SKIPPED and passes.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::Path;
use std::process::Command;

use tarn_proto::v1 as pb;
use tonic::Code;

mod common;
use common::*;

const DIM: usize = 128;
const BATCH: usize = 100;

struct Tmpfs<'a>(&'a Path);

impl Drop for Tmpfs<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}

fn free_bytes(path: &Path) -> u64 {
    let stat = rustix::fs::statvfs(path).unwrap();
    stat.f_bavail * stat.f_frsize
}

#[test]
fn a_full_disk_fails_writes_with_resource_exhausted_and_loses_nothing() {
    let mount_point = tempfile::tempdir().unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=72m", "tmpfs"])
        .arg(mount_point.path())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        println!("full_disk: SKIPPED (cannot mount a tmpfs here: needs root)");
        return;
    }
    let _guard = Tmpfs(mount_point.path());
    let data = mount_point.path().join("data");
    let rt = runtime();
    let server = Server::start(&data, &[]);
    let mut acked: Vec<u128> = Vec::new();
    let mut last_seq = 0;
    let first_failure = rt.block_on(async {
        let mut c = server.client().await;
        c.create_collection(create("full", DIM as u32, pb::Metric::L2))
            .await
            .unwrap();
        // Leave 12 MiB: WAL segments of 1, 2 and 4 MiB fit (with the checkpoints' files), the
        // 8 MiB one after them does not.
        let filler = mount_point.path().join("filler");
        let take = free_bytes(mount_point.path()).saturating_sub(12 << 20);
        std::fs::write(&filler, vec![1u8; take as usize]).unwrap();
        let mut doc = 0u128;
        loop {
            let docs: Vec<u128> = (doc..doc + BATCH as u128).collect();
            let vectors: Vec<f32> = docs
                .iter()
                .flat_map(|d| (0..DIM).map(move |i| (*d as f32) + i as f32 * 0.001))
                .collect();
            match c.insert(insert("full", &docs, &[], vectors)).await {
                Ok(response) => {
                    acked.extend(&docs);
                    last_seq = response.into_inner().seq_no;
                }
                Err(status) => return status,
            }
            doc += BATCH as u128;
            assert!(doc < 2_000_000, "the disk never filled");
        }
    });
    assert_eq!(
        first_failure.code(),
        Code::ResourceExhausted,
        "{first_failure:?}"
    );
    assert!(acked.len() > 10_000, "{} acknowledged", acked.len());
    rt.block_on(async {
        let mut c = server.client().await;
        // Later writes keep failing (the WAL is poisoned), still as a full disk.
        let again = c
            .insert(insert("full", &[5_000_000], &[], vec![0.5; DIM]))
            .await
            .unwrap_err();
        assert_eq!(again.code(), Code::ResourceExhausted, "{again:?}");
        // Searches keep working and find acknowledged documents.
        let probe = acked[acked.len() / 2];
        let mut request = search(
            "full",
            &[],
            (0..DIM).map(|i| probe as f32 + i as f32 * 0.001).collect(),
            1,
        );
        request.exact = true;
        // Every acknowledged write becomes searchable, even with the log poisoned.
        request.min_seq_no = last_seq;
        let hits = c.search(request).await.unwrap().into_inner().hits;
        assert_eq!(hits[0].doc_id, Some(id(probe)));
    });
    // Free the space and restart: everything acknowledged is there, writes work again.
    std::fs::remove_file(mount_point.path().join("filler")).unwrap();
    server.kill();
    let server = Server::start(&data, &[]);
    rt.block_on(async {
        let mut c = server.client().await;
        for chunk in acked.chunks(5_000) {
            let docs = c
                .get(pb::GetRequest {
                    collection: "full".into(),
                    user_id: None,
                    doc_ids: chunk.iter().map(|d| id(*d)).collect(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .docs;
            assert_eq!(docs.len(), chunk.len(), "acknowledged documents lost");
        }
        c.insert(insert("full", &[5_000_000], &[], vec![0.5; DIM]))
            .await
            .unwrap();
    });
    println!(
        "full_disk: {} acknowledged documents before the disk filled; all present after restart",
        acked.len()
    );
}
