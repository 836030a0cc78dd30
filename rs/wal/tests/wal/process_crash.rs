//! Kills a real child process (SIGKILL) in the middle of concurrent appends and checks that
//! every sequence number the child reported durable is back, with its payload, after reopen.
//!
//! The child is this same test binary running the ignored test `child_writer`, selected by the
//! environment variable `TARN_WAL_CRASH_CHILD_DIR`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_wal::{Durability, Wal, WalConfig};

use crate::{payload, replay_all};

const CHILD_ENV: &str = "TARN_WAL_CRASH_CHILD_DIR";

fn config() -> WalConfig {
    // Small segments so that kills also land during rollovers.
    WalConfig {
        segment_bytes: 64 * 1024,
        ..WalConfig::default()
    }
}

fn payload_len(tag: u64) -> usize {
    16 + (tag as usize * 37) % 2000
}

/// The child: four threads append until killed, printing `DURABLE <seq> <tag>` for every
/// fsync-mode append as soon as it is acknowledged.
#[test]
#[ignore = "run only as the child of kill_during_concurrent_appends"]
fn child_writer() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (wal, _) = Wal::open(&dir, config()).expect("child opens WAL");
    let round: u64 = std::env::var("TARN_WAL_CRASH_ROUND")
        .unwrap()
        .parse()
        .unwrap();
    let stdout = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let threads: Vec<_> = (0..4u64)
        .map(|thread_idx| {
            let wal = wal.clone();
            let stdout = Arc::clone(&stdout);
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let tag = (round << 40) | (thread_idx << 32) | i;
                    let durability = if i % 4 == 3 {
                        Durability::Written
                    } else {
                        Durability::Fsync
                    };
                    let seq = wal
                        .append(payload(tag, payload_len(tag)), durability)
                        .wait()
                        .expect("append");
                    if durability == Durability::Fsync {
                        let mut out = stdout.lock().unwrap();
                        writeln!(out, "DURABLE {seq} {tag}").unwrap();
                        out.flush().unwrap();
                    }
                    i += 1;
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

#[test]
fn kill_during_concurrent_appends() {
    let dir = tempfile::tempdir().unwrap();
    let mut durable: HashMap<u64, u64> = HashMap::new();
    for (round, kill_after) in [(1u64, 40usize), (2, 400), (3, 1500)] {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "process_crash::child_writer",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir.path())
            .env("TARN_WAL_CRASH_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut seen = 0;
        while seen < kill_after {
            let line = lines.next().expect("child exited early").unwrap();
            if let Some(rest) = line.strip_prefix("DURABLE ") {
                let (seq, tag) = rest.split_once(' ').unwrap();
                durable.insert(seq.parse().unwrap(), tag.parse().unwrap());
                seen += 1;
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Lines printed before the kill are acknowledgements too.
        for line in lines.map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("DURABLE ") {
                if let Some((seq, tag)) = rest.split_once(' ') {
                    if let (Ok(seq), Ok(tag)) = (seq.parse(), tag.parse()) {
                        durable.insert(seq, tag);
                    }
                }
            }
        }

        let (wal, _report) = Wal::open(dir.path(), config()).unwrap();
        let entries: HashMap<u64, Vec<u8>> = replay_all(&wal, 1).into_iter().collect();
        assert_eq!(
            entries.len() as u64,
            wal.last_appended_seq(),
            "replay is a consecutive prefix"
        );
        for (seq, tag) in &durable {
            let stored = entries
                .get(seq)
                .unwrap_or_else(|| panic!("round {round}: acknowledged entry {seq} lost"));
            assert_eq!(
                stored,
                &payload(*tag, payload_len(*tag)).to_vec(),
                "entry {seq}"
            );
        }
    }
    assert!(durable.len() >= 1940);
}
