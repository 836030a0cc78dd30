//! Opening a log directory: find the segments, check the chain of sequence numbers, cut off a
//! torn tail, refuse (or salvage) any other damage. See `docs/WAL_FORMAT.md` for the rules.

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::config::{RecoveryMode, RecoveryReport, Salvage, TailRepair, WalConfig};
use crate::entry::check_entry_at;
use crate::error::{Result, WalError};
use crate::segment::{
    decode_segment_header, parse_segment_file_name, scan_segment, sync_dir, Damage,
    SEGMENT_HEADER_BYTES, TEMP_SUFFIX,
};

/// A segment that survived recovery.
#[derive(Debug, Clone)]
pub(crate) struct RecoveredSegment {
    pub(crate) first_seq: u64,
    pub(crate) path: PathBuf,
    pub(crate) n_entries: u64,
    /// Offset just past the last entry.
    pub(crate) end_offset: u64,
}

#[derive(Debug)]
pub(crate) struct RecoveredLog {
    /// In sequence order; empty when the directory held no segment.
    pub(crate) segments: Vec<RecoveredSegment>,
    /// First sequence number of a new log when `segments` is empty: 1, or after a salvage that
    /// set aside every segment, the first number those held (numbers are never reused).
    pub(crate) first_seq_if_empty: u64,
    pub(crate) report: RecoveryReport,
}

/// Lists the directory and classifies its files.
fn list_segments(dir: &Path, report: &mut RecoveryReport) -> Result<Vec<(u64, PathBuf)>> {
    let mut segments = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| WalError::io("list directory", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| WalError::io("list directory", dir, e))?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(first_seq) = parse_segment_file_name(&name) {
            segments.push((first_seq, path));
        } else if name.ends_with(TEMP_SUFFIX) {
            fs::remove_file(&path).map_err(|e| WalError::io("remove temp file", &path, e))?;
            tracing::info!(path = %path.display(), "removed the temp file of an interrupted segment creation");
            report.removed_temp_files.push(path);
        } else {
            tracing::debug!(path = %path.display(), "ignoring a file that is not a WAL segment");
            report.ignored_files.push(path);
        }
    }
    segments.sort_by_key(|(first_seq, _)| *first_seq);
    Ok(segments)
}

/// Overwrites `[from, to)` of a segment with zeros and syncs it, so that later opens see a clean end.
fn zero_fill(path: &Path, from: u64, to: u64) -> Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| WalError::io("open segment", path, e))?;
    file.seek(SeekFrom::Start(from))
        .map_err(|e| WalError::io("seek", path, e))?;
    let zeros = vec![0u8; (to - from).min(1 << 20) as usize];
    let mut remaining = to - from;
    while remaining > 0 {
        let n = remaining.min(zeros.len() as u64) as usize;
        file.write_all(&zeros[..n])
            .map_err(|e| WalError::io("zero-fill", path, e))?;
        remaining -= n as u64;
    }
    file.sync_data()
        .map_err(|e| WalError::io("fdatasync", path, e))
}

fn quarantine(paths: &[(u64, PathBuf)]) -> Result<Vec<PathBuf>> {
    let mut moved = Vec::new();
    for (_, path) in paths {
        let mut target = path.clone().into_os_string();
        target.push(".salvaged");
        let target = PathBuf::from(target);
        fs::rename(path, &target).map_err(|e| WalError::io("rename", path, e))?;
        tracing::warn!(from = %path.display(), to = %target.display(), "quarantined a WAL segment after the damage");
        moved.push(target);
    }
    Ok(moved)
}

/// Cuts the log in `dir` (not open) after the entry `last_kept`: the entries after it are gone
/// for good (a copy of a replicated log cutting off what a deposed primary wrote but never had
/// acknowledged). Later segments are deleted first, then the rest of the segment holding
/// `last_kept + 1` is zeroed from that entry on (a clean end for recovery, which then appends
/// there), each step synced, so a crash in between leaves a valid log that the same cut
/// finishes. Returns how many entries were cut. Refuses a cut before the log's first entry
/// (the entries it would keep are no longer in the log) and a log that recovery would refuse.
pub fn cut_after(dir: &Path, config: &WalConfig, last_kept: u64) -> Result<u64> {
    let strict = WalConfig {
        recovery_mode: RecoveryMode::Strict,
        ..config.clone()
    };
    let log = recover(dir, &strict)?;
    let Some(first) = log.segments.first().map(|s| s.first_seq) else {
        return Ok(0);
    };
    let last = log
        .segments
        .last()
        .map_or(0, |s| s.first_seq + s.n_entries - 1);
    if last_kept >= last {
        return Ok(0);
    }
    if last_kept + 1 < first {
        return Err(WalError::Corrupt {
            path: dir.to_path_buf(),
            offset: 0,
            reason: format!(
                "cannot cut the log after entry {last_kept}: it begins at entry {first}"
            ),
        });
    }
    let cut_from = last_kept + 1;
    // Segments that begin after the cut go whole, the last one first.
    for segment in log.segments.iter().rev() {
        if segment.first_seq >= cut_from && segment.first_seq > first {
            fs::remove_file(&segment.path)
                .map_err(|e| WalError::io("remove segment", &segment.path, e))?;
        }
    }
    sync_dir(dir)?;
    // The segment holding the cut: zero from the first cut entry to its end.
    let holding = log
        .segments
        .iter()
        .rev()
        .find(|s| s.first_seq <= cut_from && (s.first_seq < cut_from || s.first_seq == first))
        .expect("the first segment begins at or before the cut");
    let bytes =
        fs::read(&holding.path).map_err(|e| WalError::io("read segment", &holding.path, e))?;
    let mut offset = SEGMENT_HEADER_BYTES as usize;
    for seq in holding.first_seq..cut_from {
        let (_, size) = check_entry_at(&bytes, offset, config.max_entry_bytes, |s| s == seq)
            .map_err(|defect| WalError::Corrupt {
                path: holding.path.clone(),
                offset: offset as u64,
                reason: format!("{} while looking for entry {cut_from}", defect.describe()),
            })?;
        offset += size;
    }
    zero_fill(
        &holding.path,
        offset as u64,
        holding.end_offset.max(offset as u64),
    )?;
    tracing::warn!(dir = %dir.display(), last_kept, cut = last - last_kept, "cut the log's tail");
    Ok(last - last_kept)
}

/// Opens and checks every segment in `dir`.
pub(crate) fn recover(dir: &Path, config: &WalConfig) -> Result<RecoveredLog> {
    let mut report = RecoveryReport::default();
    let listed = list_segments(dir, &mut report)?;
    let mut segments: Vec<RecoveredSegment> = Vec::with_capacity(listed.len());
    let n_listed = listed.len();
    let mut dir_changed = !report.removed_temp_files.is_empty();
    let mut first_seq_if_empty = 1;

    for (idx, (name_seq, path)) in listed.iter().enumerate() {
        let is_last = idx + 1 == n_listed;
        let bytes = fs::read(path).map_err(|e| WalError::io("read segment", path, e))?;
        let expected_first = segments.last().map(|s| s.first_seq + s.n_entries);

        // Damage in this segment that is not a torn tail: (offset, reason).
        let problem: Option<(u64, String)> = match decode_segment_header(&bytes) {
            Err(reason) => Some((0, reason.to_owned())),
            Ok(header_seq) if header_seq != *name_seq => Some((
                0,
                format!("segment header says first sequence number {header_seq}, file name says {name_seq}"),
            )),
            Ok(_) if expected_first.is_some_and(|e| e != *name_seq) => Some((
                0,
                format!(
                    "sequence numbers {}..{} are missing (segment starts at {name_seq})",
                    expected_first.unwrap_or_default(),
                    name_seq
                ),
            )),
            Ok(_) => {
                let scan = scan_segment(&bytes, *name_seq, config.max_entry_bytes);
                let mut problem = None;
                match &scan.damage {
                    None => {}
                    Some(damage) if is_last && damage.valid_entry_after.is_none() => {
                        report.torn_tail = Some(cut_torn_tail(path, damage)?);
                    }
                    Some(damage) => problem = Some((damage.offset, describe_mid_log_damage(damage, is_last))),
                }
                // The entries before the damage are good either way.
                segments.push(RecoveredSegment {
                    first_seq: *name_seq,
                    path: path.clone(),
                    n_entries: scan.n_entries,
                    end_offset: scan.end_offset,
                });
                problem
            }
        };

        if let Some((offset, reason)) = problem {
            if config.recovery_mode == RecoveryMode::Strict {
                return Err(WalError::Corrupt {
                    path: path.clone(),
                    offset,
                    reason,
                });
            }
            // Salvage: keep what precedes the damage, set aside everything after it.
            let header_ok = segments.last().is_some_and(|s| &s.path == path);
            let first_set_aside = if header_ok { idx + 1 } else { idx };
            if header_ok {
                let nonzero_end = bytes.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1) as u64;
                zero_fill(path, offset, nonzero_end.max(offset))?;
            }
            first_seq_if_empty = *name_seq;
            let quarantined = quarantine(&listed[first_set_aside..])?;
            sync_dir(dir)?;
            tracing::error!(path = %path.display(), offset, %reason, n_quarantined = quarantined.len(),
                "WAL damage salvaged: entries after it are dropped");
            report.salvage = Some(Salvage {
                path: path.clone(),
                offset,
                reason,
                quarantined,
            });
            dir_changed = false;
            break;
        }
    }

    if dir_changed {
        sync_dir(dir)?;
    }
    report.n_segments = segments.len();
    if let (Some(first), Some(last)) = (segments.first(), segments.last()) {
        report.first_seq = first.first_seq;
        report.last_seq = last.first_seq + last.n_entries - 1;
    }
    Ok(RecoveredLog {
        segments,
        first_seq_if_empty,
        report,
    })
}

fn describe_mid_log_damage(damage: &Damage, is_last: bool) -> String {
    match damage.valid_entry_after {
        Some((offset, seq)) => format!(
            "{} with a valid entry (sequence number {seq}) after it at byte {offset}",
            damage.defect.describe()
        ),
        None if !is_last => format!("{} in a sealed segment", damage.defect.describe()),
        None => damage.defect.describe().to_owned(),
    }
}

fn cut_torn_tail(path: &Path, damage: &Damage) -> Result<TailRepair> {
    zero_fill(path, damage.offset, damage.nonzero_end)?;
    let repair = TailRepair {
        path: path.to_owned(),
        offset: damage.offset,
        bytes_dropped: damage.nonzero_end - damage.offset,
        entries_dropped: damage.frames_dropped,
        reason: damage.defect.describe().to_owned(),
    };
    tracing::warn!(
        path = %path.display(),
        offset = repair.offset,
        bytes_dropped = repair.bytes_dropped,
        entries_dropped = repair.entries_dropped,
        reason = %repair.reason,
        "cut off a torn WAL tail"
    );
    Ok(repair)
}
