//! Segment files: naming, the fixed file header, creation with preallocation, and scanning.
//!
//! A segment is named `<first sequence number, 20 digits>.wal`. It starts with a 32-byte header
//! and holds consecutive entries after it; the rest of the file is preallocated zeros (a log's
//! first segment reserves `initial_segment_bytes`, each later one twice its predecessor, up to
//! `segment_bytes`). A segment
//! is created under a `.tmp` name, its header written and synced, then renamed into place and the
//! directory synced, so a file with a final name always has a durable, valid header.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::entry::{check_entry_at, EntryDefect, ENTRY_HEADER_BYTES};
use crate::error::{Result, WalError};

pub(crate) const SEGMENT_MAGIC: &[u8; 8] = b"TARNWAL1";
pub(crate) const SEGMENT_FORMAT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_BYTES: u64 = 32;
pub(crate) const SEGMENT_SUFFIX: &str = ".wal";
pub(crate) const TEMP_SUFFIX: &str = ".wal.tmp";

/// File name of the segment whose first entry is `first_seq`.
pub fn segment_file_name(first_seq: u64) -> String {
    format!("{first_seq:020}{SEGMENT_SUFFIX}")
}

/// Parses a segment file name back into its first sequence number.
pub(crate) fn parse_segment_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(SEGMENT_SUFFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

pub(crate) fn encode_segment_header(first_seq: u64) -> [u8; SEGMENT_HEADER_BYTES as usize] {
    let mut header = [0u8; SEGMENT_HEADER_BYTES as usize];
    header[0..8].copy_from_slice(SEGMENT_MAGIC);
    header[8..12].copy_from_slice(&SEGMENT_FORMAT_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&(SEGMENT_HEADER_BYTES as u32).to_le_bytes());
    header[16..24].copy_from_slice(&first_seq.to_le_bytes());
    let crc = crc32fast::hash(&header[0..24]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    header
}

/// Checks a segment header; returns the first sequence number it records.
pub(crate) fn decode_segment_header(bytes: &[u8]) -> Result<u64, &'static str> {
    let Some(header) = bytes.get(0..SEGMENT_HEADER_BYTES as usize) else {
        return Err("segment header cut short");
    };
    if &header[0..8] != SEGMENT_MAGIC {
        return Err("bad segment magic");
    }
    let crc = u32::from_le_bytes(header[24..28].try_into().expect("4 bytes"));
    if crc != crc32fast::hash(&header[0..24]) {
        return Err("segment header checksum mismatch");
    }
    let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
    if version != SEGMENT_FORMAT_VERSION {
        return Err("unsupported segment format version");
    }
    Ok(u64::from_le_bytes(
        header[16..24].try_into().expect("8 bytes"),
    ))
}

/// fsyncs a directory so that file creations, renames and deletions in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    let handle = File::open(dir).map_err(|e| WalError::io("open directory", dir, e))?;
    handle
        .sync_all()
        .map_err(|e| WalError::io("fsync directory", dir, e))
}

/// Reserves `len` bytes of disk for `file` so that appends do not change its size.
fn preallocate(file: &File, len: u64) -> io::Result<()> {
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        // Filesystems without fallocate: a sparse file of the right length still works.
        Err(errno) if errno == rustix::io::Errno::OPNOTSUPP => file.set_len(len),
        Err(errno) => Err(io::Error::from(errno)),
    }
}

/// Grows a segment's reservation to `len` bytes (for an entry larger than the reservation).
/// Not synced here: the file's new length is metadata that the next `fdatasync` makes durable
/// together with the entry written into the new space (fdatasync flushes the size whenever
/// reading the data needs it). A crash before that sync leaves the old or the new length, and
/// recovery reads zeros past the last entry either way.
pub(crate) fn grow_segment(file: &File, path: &Path, len: u64) -> Result<()> {
    preallocate(file, len).map_err(|e| WalError::io("preallocate", path, e))
}

/// Creates, preallocates and durably publishes a new empty segment; returns it open for writing,
/// positioned after the header.
pub(crate) fn create_segment(dir: &Path, first_seq: u64, capacity: u64) -> Result<(File, PathBuf)> {
    let path = dir.join(segment_file_name(first_seq));
    let temp_path = dir.join(format!("{first_seq:020}{TEMP_SUFFIX}"));
    (|| -> Result<()> {
        fail::fail_point!("wal::create_segment", |arg: Option<String>| Err(
            WalError::io(
                "create segment",
                &temp_path,
                if arg.as_deref() == Some("nospc") {
                    io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error())
                } else {
                    io::Error::other("fail point wal::create_segment")
                }
            )
        ));
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp_path)
            .map_err(|e| WalError::io("create segment", &temp_path, e))?;
        preallocate(&file, capacity.max(SEGMENT_HEADER_BYTES))
            .map_err(|e| WalError::io("preallocate", &temp_path, e))?;
        file.write_all(&encode_segment_header(first_seq))
            .map_err(|e| WalError::io("write segment header", &temp_path, e))?;
        file.sync_all()
            .map_err(|e| WalError::io("fsync", &temp_path, e))?;
        fs::rename(&temp_path, &path).map_err(|e| WalError::io("rename", &temp_path, e))?;
        sync_dir(dir)
    })()?;
    let file = open_for_append(&path, SEGMENT_HEADER_BYTES)?;
    Ok((file, path))
}

/// Opens an existing segment for writing at `offset`.
pub(crate) fn open_for_append(path: &Path, offset: u64) -> Result<File> {
    use std::io::Seek;
    let mut file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| WalError::io("open segment", path, e))?;
    file.seek(io::SeekFrom::Start(offset))
        .map_err(|e| WalError::io("seek", path, e))?;
    Ok(file)
}

/// What scanning one segment's bytes found.
#[derive(Debug, Clone)]
pub(crate) struct SegmentScan {
    pub(crate) n_entries: u64,
    /// Offset just past the last valid entry.
    pub(crate) end_offset: u64,
    /// The first place the entry chain breaks with non-zero bytes at or after it.
    pub(crate) damage: Option<Damage>,
}

#[derive(Debug, Clone)]
pub(crate) struct Damage {
    pub(crate) offset: u64,
    pub(crate) defect: EntryDefect,
    /// One past the last non-zero byte of the file.
    pub(crate) nonzero_end: u64,
    /// Best guess at how many entries the damaged bytes held (frames with a plausible header).
    pub(crate) frames_dropped: u64,
    /// A valid entry with a later sequence number found after the damage, if any: proof that
    /// the damage is not a torn tail.
    pub(crate) valid_entry_after: Option<(u64, u64)>,
}

/// Walks the entries of a segment whose header says `first_seq`.
pub(crate) fn scan_segment(bytes: &[u8], first_seq: u64, max_entry_bytes: usize) -> SegmentScan {
    let mut offset = SEGMENT_HEADER_BYTES as usize;
    let mut expected_seq = first_seq;
    loop {
        match check_entry_at(bytes, offset, max_entry_bytes, |seq| seq == expected_seq) {
            Ok((_, size)) => {
                offset += size;
                expected_seq += 1;
            }
            Err(defect) => {
                let nonzero_end = bytes
                    .iter()
                    .rposition(|&b| b != 0)
                    .map_or(0, |last| last + 1)
                    .max(offset);
                let n_entries = expected_seq - first_seq;
                let damage = (nonzero_end > offset).then(|| Damage {
                    offset: offset as u64,
                    defect,
                    nonzero_end: nonzero_end as u64,
                    frames_dropped: count_plausible_frames(
                        &bytes[..nonzero_end],
                        offset,
                        max_entry_bytes,
                    ),
                    valid_entry_after: find_valid_entry_after(
                        &bytes[..nonzero_end],
                        offset + 1,
                        expected_seq - 1,
                        max_entry_bytes,
                    ),
                });
                return SegmentScan {
                    n_entries,
                    end_offset: offset as u64,
                    damage,
                };
            }
        }
    }
}

fn count_plausible_frames(bytes: &[u8], mut offset: usize, max_entry_bytes: usize) -> u64 {
    let mut frames = 0;
    while offset < bytes.len() {
        frames += 1;
        let Some(len_bytes) = bytes.get(offset..offset + 4) else {
            break;
        };
        let len = u32::from_le_bytes(len_bytes.try_into().expect("4 bytes")) as usize;
        if len > max_entry_bytes {
            break;
        }
        offset += ENTRY_HEADER_BYTES + len;
    }
    frames
}

/// Byte-by-byte search for any checksum-valid entry with a sequence number after `last_good_seq`
/// starting at or after `from`. Runs only when damage was found, so its cost does not matter.
fn find_valid_entry_after(
    bytes: &[u8],
    from: usize,
    last_good_seq: u64,
    max_entry_bytes: usize,
) -> Option<(u64, u64)> {
    (from..bytes.len().saturating_sub(ENTRY_HEADER_BYTES - 1)).find_map(|offset| {
        check_entry_at(bytes, offset, max_entry_bytes, |seq| {
            seq > last_good_seq && seq - last_good_seq < (1 << 40)
        })
        .ok()
        .map(|(header, _)| (offset as u64, header.seq))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_reject_strangers() {
        assert_eq!(segment_file_name(42), "00000000000000000042.wal");
        assert_eq!(parse_segment_file_name(&segment_file_name(42)), Some(42));
        assert_eq!(
            parse_segment_file_name("00000000000000000042.wal.tmp"),
            None
        );
        assert_eq!(parse_segment_file_name("42.wal"), None);
        assert_eq!(parse_segment_file_name("notes.txt"), None);
    }

    #[test]
    fn header_round_trip_and_damage() {
        let header = encode_segment_header(9);
        assert_eq!(decode_segment_header(&header), Ok(9));
        let mut damaged = header;
        damaged[17] ^= 1;
        assert!(decode_segment_header(&damaged).is_err());
        assert!(decode_segment_header(&header[..10]).is_err());
    }
}
