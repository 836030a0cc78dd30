//! The synchronous core of the log: a directory of segments, one of them active, owned by a
//! single thread (the log writer, see `log_writer.rs`). Appends, fdatasync, rollover, truncation.
//!
//! Architecture invariant: after any failed write, fdatasync or segment creation the log is
//! poisoned and every later append and sync fails; nothing is retried.

use std::fs::File;
use std::io::{self, IoSlice, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use crate::config::{RecoveryReport, WalConfig};
use crate::entry::{encode_header, ENTRY_HEADER_BYTES};
use crate::error::{Result, WalError};
use crate::recovery::recover;
use crate::segment::{
    create_segment, grow_segment, open_for_append, sync_dir, SEGMENT_HEADER_BYTES,
};

/// A segment as readers see it: enough to find and read its entries.
#[derive(Debug, Clone)]
pub(crate) struct SegmentRef {
    pub(crate) first_seq: u64,
    pub(crate) path: PathBuf,
}

/// The segment list shared between the writer and readers (`Replay`).
pub(crate) type SharedSegments = Arc<RwLock<Vec<SegmentRef>>>;

#[derive(Debug)]
struct ActiveSegment {
    file: File,
    path: PathBuf,
    first_seq: u64,
    write_offset: u64,
    capacity: u64,
}

#[derive(Debug)]
pub(crate) struct SegmentedLog {
    dir: PathBuf,
    config: WalConfig,
    segments: SharedSegments,
    active: ActiveSegment,
    /// Sequence number the next append gets.
    next_seq: u64,
    /// Last sequence number known to be on disk.
    synced_seq: u64,
    poisoned: Option<Arc<str>>,
    poisoned_out_of_space: bool,
}

impl SegmentedLog {
    /// Opens (recovering) or creates the log in `dir`. A new log starts at sequence number 1.
    pub(crate) fn open(dir: &Path, config: WalConfig) -> Result<(Self, RecoveryReport)> {
        Self::open_or_create(dir, config, None)
    }

    /// Creates a new, empty log in `dir` (missing or empty) whose first entry gets `first_seq`.
    pub(crate) fn create_at(dir: &Path, config: WalConfig, first_seq: u64) -> Result<Self> {
        if first_seq == 0 {
            return Err(WalError::InvalidConfig(
                "the first sequence number of a log must be at least 1".to_owned(),
            ));
        }
        if dir.exists() {
            let mut entries =
                std::fs::read_dir(dir).map_err(|e| WalError::io("list directory", dir, e))?;
            if entries.next().is_some() {
                return Err(WalError::NotEmpty {
                    path: dir.to_owned(),
                });
            }
        }
        let (log, _) = Self::open_or_create(dir, config, Some(first_seq))?;
        Ok(log)
    }

    /// `first_seq`: where a log without segments starts (`None`: 1, or after a salvage that set
    /// every segment aside, the first number those held).
    fn open_or_create(
        dir: &Path,
        config: WalConfig,
        first_seq: Option<u64>,
    ) -> Result<(Self, RecoveryReport)> {
        config.validate()?;
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(|e| WalError::io("create directory", dir, e))?;
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent)?;
            }
        }
        let recovered = recover(dir, &config)?;
        let mut report = recovered.report;
        let active = match recovered.segments.last() {
            Some(last) => {
                let file = open_for_append(&last.path, last.end_offset)?;
                let capacity = file
                    .metadata()
                    .map_err(|e| WalError::io("stat", &last.path, e))?
                    .len();
                // Whatever recovery read may still be only in the page cache (the process that
                // wrote it crashed before its fdatasync): make it durable before calling it so.
                file.sync_data()
                    .map_err(|e| WalError::io("fdatasync", &last.path, e))?;
                ActiveSegment {
                    file,
                    path: last.path.clone(),
                    first_seq: last.first_seq,
                    write_offset: last.end_offset,
                    capacity,
                }
            }
            None => {
                let first_seq = first_seq.unwrap_or(recovered.first_seq_if_empty);
                let capacity = config.first_reservation();
                let (file, path) = create_segment(dir, first_seq, capacity)?;
                report.first_seq = first_seq;
                report.n_segments = 1;
                ActiveSegment {
                    file,
                    path,
                    first_seq,
                    write_offset: SEGMENT_HEADER_BYTES,
                    capacity,
                }
            }
        };
        let mut refs: Vec<SegmentRef> = recovered
            .segments
            .iter()
            .map(|s| SegmentRef {
                first_seq: s.first_seq,
                path: s.path.clone(),
            })
            .collect();
        if refs.is_empty() {
            refs.push(SegmentRef {
                first_seq: active.first_seq,
                path: active.path.clone(),
            });
        }
        let next_seq = match recovered.segments.last() {
            Some(last) => last.first_seq + last.n_entries,
            None => active.first_seq,
        };
        if report.last_seq == 0 && next_seq > 1 {
            report.last_seq = next_seq - 1;
        }
        tracing::info!(dir = %dir.display(), first_seq = report.first_seq, last_seq = next_seq - 1,
            n_segments = refs.len(), "opened WAL");
        let log = SegmentedLog {
            dir: dir.to_owned(),
            config,
            segments: Arc::new(RwLock::new(refs)),
            active,
            next_seq,
            synced_seq: next_seq - 1,
            poisoned: None,
            poisoned_out_of_space: false,
        };
        Ok((log, report))
    }

    pub(crate) fn segments(&self) -> SharedSegments {
        Arc::clone(&self.segments)
    }

    pub(crate) fn last_written_seq(&self) -> u64 {
        self.next_seq - 1
    }

    pub(crate) fn last_synced_seq(&self) -> u64 {
        self.synced_seq
    }

    pub(crate) fn has_unsynced(&self) -> bool {
        self.synced_seq + 1 < self.next_seq
    }

    pub(crate) fn poisoned(&self) -> Option<&Arc<str>> {
        self.poisoned.as_ref()
    }

    /// Whether the poisoning error was the disk being full.
    pub(crate) fn poisoned_out_of_space(&self) -> bool {
        self.poisoned_out_of_space
    }

    fn check_not_poisoned(&self) -> Result<()> {
        match &self.poisoned {
            Some(first_error) => Err(WalError::Poisoned {
                first_error: Arc::clone(first_error),
                out_of_space: self.poisoned_out_of_space,
            }),
            None => Ok(()),
        }
    }

    /// Runs `op`; poisons the log if it fails.
    fn poison_on_error<T>(&mut self, op: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.check_not_poisoned()?;
        let result = op(self);
        if let Err(error) = &result {
            tracing::error!(%error, "WAL poisoned: refusing every later write until reopened");
            // Without the path: this text reaches clients (the line above logs the path).
            self.poisoned = Some(Arc::from(error.client_message()));
            self.poisoned_out_of_space = error.is_out_of_space();
        }
        result
    }

    /// Writes `payloads` as consecutive entries (not synced); returns the first one's sequence
    /// number. All of them are written with as few vectored writes as segment boundaries allow.
    pub(crate) fn append(&mut self, payloads: &[&[u8]]) -> Result<u64> {
        self.poison_on_error(|log| log.append_inner(payloads))
    }

    fn append_inner(&mut self, payloads: &[&[u8]]) -> Result<u64> {
        let first_seq = self.next_seq;
        let headers: Vec<[u8; ENTRY_HEADER_BYTES]> = payloads
            .iter()
            .enumerate()
            .map(|(idx, payload)| encode_header(first_seq + idx as u64, payload))
            .collect();
        let mut batch_start = 0;
        let mut batch_bytes = 0u64;
        for (idx, payload) in payloads.iter().enumerate() {
            let entry_bytes = (ENTRY_HEADER_BYTES + payload.len()) as u64;
            let offset = self.active.write_offset + batch_bytes;
            if offset + entry_bytes > self.active.capacity {
                let segment_is_empty = offset == SEGMENT_HEADER_BYTES;
                if segment_is_empty {
                    grow_segment(&self.active.file, &self.active.path, offset + entry_bytes)?;
                    self.active.capacity = offset + entry_bytes;
                } else {
                    self.write_entries(
                        &headers[batch_start..idx],
                        &payloads[batch_start..idx],
                        batch_bytes,
                    )?;
                    self.roll_over()?;
                    batch_start = idx;
                    batch_bytes = 0;
                    if SEGMENT_HEADER_BYTES + entry_bytes > self.active.capacity {
                        let needed = SEGMENT_HEADER_BYTES + entry_bytes;
                        grow_segment(&self.active.file, &self.active.path, needed)?;
                        self.active.capacity = needed;
                    }
                }
            }
            batch_bytes += entry_bytes;
        }
        self.write_entries(
            &headers[batch_start..],
            &payloads[batch_start..],
            batch_bytes,
        )?;
        Ok(first_seq)
    }

    /// One vectored write of whole entries into the active segment.
    fn write_entries(
        &mut self,
        headers: &[[u8; ENTRY_HEADER_BYTES]],
        payloads: &[&[u8]],
        n_bytes: u64,
    ) -> Result<()> {
        if headers.is_empty() {
            return Ok(());
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(headers.len() * 2);
        for (header, payload) in headers.iter().zip(payloads) {
            slices.push(IoSlice::new(header));
            if !payload.is_empty() {
                slices.push(IoSlice::new(payload));
            }
        }
        write_all_vectored(&mut self.active.file, &mut slices)
            .map_err(|e| WalError::io("write", &self.active.path, e))?;
        self.active.write_offset += n_bytes;
        self.next_seq += headers.len() as u64;
        Ok(())
    }

    /// Seals the active segment (synced) and starts a new one at `next_seq`.
    fn roll_over(&mut self) -> Result<()> {
        self.sync_inner()?;
        // Each segment reserves twice what the one it follows held, up to `segment_bytes`: a
        // small log stays small and a busy one reaches full segments after a few rollovers.
        // (Growing one file's reservation in place instead measured slower appends on ext4
        // for the whole grown segment: docs/benchmarks/wal-segments.md.)
        let capacity = self.config.next_reservation(self.active.capacity);
        let (file, path) = create_segment(&self.dir, self.next_seq, capacity)?;
        self.active = ActiveSegment {
            file,
            path: path.clone(),
            first_seq: self.next_seq,
            write_offset: SEGMENT_HEADER_BYTES,
            capacity,
        };
        self.segments
            .write()
            .unwrap_or_else(|poison| poison.into_inner())
            .push(SegmentRef {
                first_seq: self.active.first_seq,
                path,
            });
        tracing::debug!(
            first_seq = self.active.first_seq,
            "WAL rolled over to a new segment"
        );
        Ok(())
    }

    /// fdatasync of the active segment (sealed segments were synced when sealed).
    pub(crate) fn sync(&mut self) -> Result<u64> {
        self.poison_on_error(|log| {
            log.sync_inner()?;
            Ok(log.synced_seq)
        })
    }

    fn sync_inner(&mut self) -> Result<()> {
        if !self.has_unsynced() {
            return Ok(());
        }
        fdatasync(&self.active.file)
            .map_err(|e| WalError::io("fdatasync", &self.active.path, e))?;
        self.synced_seq = self.next_seq - 1;
        Ok(())
    }

    /// Deletes every sealed segment whose entries all come before `seq`; returns the oldest
    /// sequence number still in the log. The active segment is never deleted.
    pub(crate) fn truncate_before(&mut self, seq: u64) -> Result<u64> {
        let mut removed_any = false;
        let result = loop {
            let victim = {
                let segments = self.segments.read().unwrap_or_else(|p| p.into_inner());
                match segments.get(1) {
                    Some(next) if next.first_seq <= seq => Some(segments[0].clone()),
                    _ => None,
                }
            };
            let Some(victim) = victim else { break Ok(()) };
            if let Err(e) = std::fs::remove_file(&victim.path) {
                break Err(WalError::io("remove segment", &victim.path, e));
            }
            removed_any = true;
            tracing::debug!(path = %victim.path.display(), "deleted a WAL segment before the checkpoint");
            self.segments
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .remove(0);
        };
        if removed_any {
            sync_dir(&self.dir)?;
        }
        if let Err(error) = &result {
            tracing::warn!(%error, "WAL truncation stopped early; it is retried at the next one");
        }
        result?;
        Ok(self.first_seq())
    }

    pub(crate) fn first_seq(&self) -> u64 {
        self.segments
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .first()
            .map_or(self.next_seq, |s| s.first_seq)
    }
}

fn fdatasync(file: &File) -> io::Result<()> {
    // `return(nospc)` fails as a full disk does; plain `return` with another error.
    fail::fail_point!("wal::fdatasync", |arg: Option<String>| Err(
        if arg.as_deref() == Some("nospc") {
            io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error())
        } else {
            io::Error::other("fail point wal::fdatasync")
        }
    ));
    file.sync_data()
}

/// `write_all` for a list of slices (std's `write_all_vectored` is not stable).
fn write_all_vectored(file: &mut File, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    fail::fail_point!("wal::write", |_| Err(io::Error::other(
        "fail point wal::write"
    )));
    fail::fail_point!("wal::torn_write", |_| {
        // Write half of the first slice, then fail: a short write followed by an error.
        let first = &slices[0];
        file.write_all(&first[..first.len() / 2])?;
        Err(io::Error::other("fail point wal::torn_write"))
    });
    while !slices.is_empty() {
        match file.write_vectored(slices) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote zero bytes")),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
