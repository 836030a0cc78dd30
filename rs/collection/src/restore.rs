//! Restoring a snapshot into a new collection directory ([`SnapshotRestore`]), checking one
//! without restoring it ([`verify_snapshot`]), and cleaning up after interrupted restores
//! ([`remove_interrupted_restores`]).
//!
//! Invariants:
//! - A restore writes only inside its own staging directory, `<parent>/.restore-<name>-<unique>`
//!   beside the target, and the target appears by one rename, after every check passed and
//!   every file was synced; the rename refuses to replace anything. So a failed, dropped or
//!   killed restore leaves at most a staging directory (removed on drop, or by
//!   `remove_interrupted_restores` after a crash), never a partial collection, and never
//!   touches another directory.
//! - The bytes are checked as they arrive (`SnapshotDecoder`): the first damage fails the
//!   restore and removes the staging directory at once.
//! - The WAL tail is written with tarn-wal's own code (`Wal::create_at` at the checkpoint's
//!   next sequence number, then appends), so the restored log is numbered as the source's was
//!   and the next write gets `seq_no + 1`.
//! - Before the rename, every segment and tombstone file is opened the way `Collection::open`
//!   opens it: what `finish` accepts, open accepts.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tarn_index::IndexError;
use tarn_wal::{Durability, Ticket, Wal, WalConfig};

use crate::config::CollectionConfig;
use crate::error::{CollectionError, Result};
use crate::manifest::{self, Manifest, CONFIG_FILE};
use crate::snapshot_format::{
    DiscardSink, PartKind, PartSink, SnapshotDecoder, SnapshotHeader, SnapshotInfo,
};

/// Staging directories start with this (then the target's name, a dash, a unique suffix).
const STAGING_PREFIX: &str = ".restore-";
/// WAL appends queued before the restore waits for them.
const MAX_PENDING_APPENDS: usize = 1024;

/// Checks a whole snapshot without restoring it: framing, every part's checksum and the
/// whole-file checksum, the header, the manifest against the files present, part names, the
/// WAL entries (consecutive, each a valid operation) and completeness. It reads `reader` to
/// its end and keeps nothing; it does not decode segment contents (their checksums are
/// checked; restore also opens them).
pub fn verify_snapshot(mut reader: impl Read) -> Result<SnapshotInfo> {
    let mut decoder = SnapshotDecoder::new();
    let mut buffer = vec![0u8; 256 << 10];
    loop {
        let n = match reader.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(CollectionError::io("read", "<snapshot stream>", e)),
        };
        decoder.push(&buffer[..n], &mut DiscardSink)?;
    }
    decoder.finish()
}

/// Deletes the staging directories that restores into `parent_dir` left behind (a process
/// killed mid-restore); returns how many. Call it when no restore into `parent_dir` is running
/// (the server does at startup). A missing `parent_dir` has none.
pub fn remove_interrupted_restores(parent_dir: &Path) -> Result<usize> {
    let entries = match std::fs::read_dir(parent_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(CollectionError::io("list directory", parent_dir, e)),
    };
    let mut n_removed = 0;
    for entry in entries {
        let entry = entry.map_err(|e| CollectionError::io("list directory", parent_dir, e))?;
        let is_staging = entry
            .file_name()
            .to_string_lossy()
            .starts_with(STAGING_PREFIX);
        let is_dir = entry
            .file_type()
            .map_err(|e| CollectionError::io("stat", entry.path(), e))?
            .is_dir();
        if is_staging && is_dir {
            let path = entry.path();
            std::fs::remove_dir_all(&path).map_err(|e| CollectionError::io("remove", &path, e))?;
            tracing::info!(path = %path.display(), "removed the staging directory of an interrupted restore");
            n_removed += 1;
        }
    }
    if n_removed > 0 {
        sync_dir(parent_dir)?;
    }
    Ok(n_removed)
}

/// A streaming restore of a snapshot into a new collection directory. Feed it the file's
/// bytes with [`SnapshotRestore::write`] in chunks of any size, then call
/// [`SnapshotRestore::finish`]. Dropping it before `finish` succeeded removes everything it
/// wrote. Blocking file I/O: from async code, use it on a blocking thread.
#[derive(Debug)]
pub struct SnapshotRestore {
    target: PathBuf,
    staging: PathBuf,
    decoder: SnapshotDecoder,
    sink: StagingSink,
    /// The first error, after which the staging directory is gone and nothing is accepted.
    failed: Option<String>,
    /// The rename happened: nothing to clean up.
    done: bool,
}

impl SnapshotRestore {
    /// Starts a restore into `target_dir`, which must not exist (its parent is created if
    /// missing). Creates the staging directory beside it.
    pub fn begin(target_dir: &Path) -> Result<SnapshotRestore> {
        let Some(name) = target_dir.file_name().and_then(|n| n.to_str()) else {
            return Err(CollectionError::invalid(
                "target_dir",
                "must end in a directory name (UTF-8)",
            ));
        };
        let parent = match target_dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
            _ => PathBuf::from("."),
        };
        if target_dir.symlink_metadata().is_ok() {
            return Err(CollectionError::AlreadyExists {
                path: target_dir.to_owned(),
            });
        }
        if !parent.exists() {
            std::fs::create_dir_all(&parent)
                .map_err(|e| CollectionError::io("create directory", &parent, e))?;
            if let Some(grandparent) = parent.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(grandparent)?;
            }
        }
        static N_RESTORES: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let staging = parent.join(format!(
            "{STAGING_PREFIX}{name}-{}-{nanos}-{}",
            std::process::id(),
            N_RESTORES.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&staging)
            .map_err(|e| CollectionError::io("create directory", &staging, e))?;
        tracing::info!(target = %target_dir.display(), staging = %staging.display(), "restore started");
        Ok(SnapshotRestore {
            target: target_dir.to_owned(),
            staging: staging.clone(),
            decoder: SnapshotDecoder::new(),
            sink: StagingSink::new(staging),
            failed: None,
            done: false,
        })
    }

    /// Takes the next bytes of the snapshot file. Fails as soon as damage is seen; the restore
    /// is then over (its staging directory already removed), and so is every later call.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.check_not_failed()?;
        let result = self.decoder.push(bytes, &mut self.sink);
        self.fail_on_error(result)
    }

    /// Completes the restore: checks that the snapshot ended where it should and that its
    /// whole-file checksum matches, syncs the WAL and every file, opens each segment as
    /// `Collection::open` would, renames the staging directory to the target (refusing to
    /// replace anything there), and syncs the parent directory. Afterwards
    /// `Collection::open(target_dir)` gives exactly the snapshot's state.
    pub fn finish(mut self) -> Result<SnapshotInfo> {
        self.check_not_failed()?;
        let result = self.finish_inner();
        let info = self.fail_on_error(result)?;
        self.done = true;
        tracing::info!(target = %self.target.display(), seq_no = info.seq_no, n_bytes = info.n_bytes, "restore finished");
        Ok(info)
    }

    fn finish_inner(&mut self) -> Result<SnapshotInfo> {
        let info = self.decoder.finish()?;
        let header = self
            .decoder
            .header()
            .expect("a complete snapshot has a header")
            .clone();
        self.sink.close_wal(&header)?;
        if header.manifest_generation > 0 {
            check_segments(&self.staging, header.manifest_generation, &header.config)?;
        }
        sync_dir(&self.staging)?;
        rename_no_replace(&self.staging, &self.target)?;
        let parent = self.target.parent().filter(|p| !p.as_os_str().is_empty());
        if let Err(error) = sync_dir(parent.unwrap_or(Path::new("."))) {
            // The rename may not be durable: a restore that reports failure leaves nothing.
            // Nobody has opened the new collection yet (the caller does after `finish`).
            if let Err(remove_error) = std::fs::remove_dir_all(&self.target) {
                tracing::error!(%remove_error, target = %self.target.display(),
                    "could not remove a restored collection after its parent's fsync failed");
            }
            return Err(error);
        }
        Ok(info)
    }

    /// A call after the restore failed is the caller's mistake, whatever the first error was.
    fn check_not_failed(&self) -> Result<()> {
        match &self.failed {
            Some(first) => Err(CollectionError::invalid(
                "snapshot",
                format!("this restore already failed ({first}); start a new one"),
            )),
            None => Ok(()),
        }
    }

    /// On an error: remember it, and remove the staging directory now.
    fn fail_on_error<T>(&mut self, result: Result<T>) -> Result<T> {
        if let Err(error) = &result {
            tracing::warn!(%error, target = %self.target.display(), "restore failed; removing its staging directory");
            self.failed = Some(error.to_string());
            self.clean_up();
        }
        result
    }

    fn clean_up(&mut self) {
        self.sink.abandon();
        match std::fs::remove_dir_all(&self.staging) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => tracing::error!(%error, staging = %self.staging.display(),
                "could not remove a restore's staging directory; remove_interrupted_restores will"),
        }
    }
}

impl Drop for SnapshotRestore {
    fn drop(&mut self) {
        if !self.done && self.failed.is_none() {
            tracing::info!(target = %self.target.display(), "restore abandoned; removing its staging directory");
            self.clean_up();
        }
    }
}

/// Writes what the decoder checked into the staging directory.
#[derive(Debug)]
struct StagingSink {
    dir: PathBuf,
    /// The file being written, and its path.
    file: Option<(BufWriter<File>, PathBuf)>,
    wal: Option<Wal>,
    /// Appends not yet waited for, with the sequence number each must get.
    pending: Vec<(u64, Ticket<tarn_wal::Result<u64>>)>,
}

impl StagingSink {
    fn new(dir: PathBuf) -> Self {
        StagingSink {
            dir,
            file: None,
            wal: None,
            pending: Vec::new(),
        }
    }

    fn wal(&self) -> Result<&Wal> {
        self.wal
            .as_ref()
            .ok_or_else(|| CollectionError::Corrupt("a restore's WAL is not open".to_owned()))
    }

    /// Waits for the queued appends; each must have got the number it had in the snapshot.
    fn wait_pending(&mut self) -> Result<()> {
        for (expected, ticket) in self.pending.drain(..) {
            let seq = ticket.wait()?;
            if seq != expected {
                return Err(CollectionError::Corrupt(format!(
                    "the restored WAL numbered entry {expected} as {seq}"
                )));
            }
        }
        Ok(())
    }

    /// Makes every appended entry durable, checks the log ends at the snapshot's sequence
    /// number, and closes it.
    fn close_wal(&mut self, header: &SnapshotHeader) -> Result<()> {
        self.wait_pending()?;
        let wal = self.wal()?.clone();
        let last = wal.sync().wait()?;
        if last != header.seq_no {
            return Err(CollectionError::Corrupt(format!(
                "the restored WAL ends at {last}, not at the snapshot's {}",
                header.seq_no
            )));
        }
        wal.close()?;
        self.wal = None;
        Ok(())
    }

    /// Stops the WAL's writer thread (before its directory is deleted) and drops any file.
    fn abandon(&mut self) {
        self.file = None;
        self.pending.clear();
        if let Some(wal) = self.wal.take() {
            let _ = wal.close();
        }
    }
}

impl PartSink for StagingSink {
    fn header(&mut self, header: &SnapshotHeader) -> Result<()> {
        manifest::write_checked(&self.dir.join(CONFIG_FILE), &header.config)?;
        // Entries checkpoint_seq + 1 ..= seq_no follow; with none, the next write still gets
        // checkpoint_seq + 1 = seq_no + 1.
        let wal = Wal::create_at(
            self.dir.join("wal"),
            WalConfig::default(),
            header.checkpoint_seq + 1,
        )?;
        self.wal = Some(wal);
        Ok(())
    }

    fn file_start(&mut self, _kind: PartKind, name: &str, _len: u64) -> Result<()> {
        // The decoder checked `name` against the exact patterns of a collection's files.
        let path = self.dir.join(name);
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| CollectionError::io("create", &path, e))?;
        self.file = Some((BufWriter::with_capacity(256 << 10, file), path));
        Ok(())
    }

    fn file_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let (file, path) = self
            .file
            .as_mut()
            .ok_or_else(|| CollectionError::Corrupt("file bytes outside a file".to_owned()))?;
        file.write_all(bytes)
            .map_err(|e| CollectionError::io("write", path.as_path(), e))
    }

    fn file_end(&mut self) -> Result<()> {
        let (file, path) = self
            .file
            .take()
            .ok_or_else(|| CollectionError::Corrupt("a file ends that never began".to_owned()))?;
        let file = file
            .into_inner()
            .map_err(|e| CollectionError::io("write", &path, e.into_error()))?;
        file.sync_all()
            .map_err(|e| CollectionError::io("fsync", &path, e))
    }

    fn wal_entry(&mut self, seq: u64, payload: &[u8]) -> Result<()> {
        // `Written`: one sync at the end (close_wal) instead of one per group.
        let ticket = self.wal()?.append(Arc::from(payload), Durability::Written);
        self.pending.push((seq, ticket));
        if self.pending.len() >= MAX_PENDING_APPENDS {
            self.wait_pending()?;
        }
        Ok(())
    }
}

/// Opens every segment and tombstone file of the staged manifest as `Collection::open` does,
/// one segment at a time; damage is reported without the staging path.
fn check_segments(dir: &Path, generation: u64, config: &CollectionConfig) -> Result<()> {
    let manifest: Manifest = manifest::read_checked(&manifest::manifest_path(dir, generation))?;
    for entry in &manifest.segments {
        crate::collection::open_sealed_segment(dir, entry, config).map_err(|error| {
            let reason = match error {
                CollectionError::Index(
                    IndexError::Corrupt { reason, .. } | IndexError::Mismatch { reason, .. },
                ) => reason,
                CollectionError::Index(IndexError::Format(reason)) => reason,
                CollectionError::Corrupt(reason) => reason,
                other => return other,
            };
            CollectionError::SnapshotDamaged {
                what: format!(
                    "segment file {} (or its tombstones) does not open: {reason}",
                    entry.file
                ),
            }
        })?;
    }
    Ok(())
}

/// Renames `from` to `to`, failing if `to` exists (even as an empty directory, which a plain
/// rename would replace).
fn rename_no_replace(from: &Path, to: &Path) -> Result<()> {
    let exists = || CollectionError::AlreadyExists {
        path: to.to_owned(),
    };
    match rustix::fs::renameat_with(
        rustix::fs::CWD,
        from,
        rustix::fs::CWD,
        to,
        rustix::fs::RenameFlags::NOREPLACE,
    ) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::EXIST) => Err(exists()),
        // A file system without RENAME_NOREPLACE: check, then rename (the window between the
        // two is the caller's to avoid, as for any directory it owns).
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {
            if to.symlink_metadata().is_ok() {
                return Err(exists());
            }
            std::fs::rename(from, to).map_err(|e| CollectionError::io("rename", from, e))
        }
        Err(errno) => Err(CollectionError::io("rename", from, errno.into())),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    tarn_index::fsutil::sync_dir(dir).map_err(|e| CollectionError::io("fsync directory", dir, e))
}
