//! Reading entries back, in sequence order, from a snapshot of the segment list.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use crate::entry::{check_entry_at, EntryDefect};
use crate::error::{Result, WalError};
use crate::segment::{decode_segment_header, SEGMENT_HEADER_BYTES};
use crate::segmented_log::SegmentRef;

/// How much of a segment file a replay reads at a time (more when an entry is larger): segment
/// files are reserved (`fallocate`d) up to 64 MiB, so reading a whole file would read the
/// unwritten space too.
const READ_CHUNK_BYTES: usize = 1 << 20;

/// An iterator over `(sequence number, payload)` from a starting sequence number up to the last
/// entry appended when the replay was created. It reads one segment file at a time, a chunk at
/// a time.
#[derive(Debug)]
pub struct Replay {
    segments: std::vec::IntoIter<SegmentRef>,
    /// Where in the first segment to start reading, from an earlier replay of the same log.
    resume: Option<ReplayPosition>,
    max_entry_bytes: usize,
    /// Next sequence number to yield.
    next_seq: u64,
    /// Last sequence number to yield.
    last_seq: u64,
    current: Option<LoadedSegment>,
    failed: bool,
}

/// Where a replay stopped: the byte offset in a segment file of the entry with sequence number
/// `seq`. A later replay of the same log that starts at `seq` can begin reading there
/// ([`crate::Wal::replay_resuming`]) instead of reading and checking the segment from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayPosition {
    segment_first_seq: u64,
    offset: u64,
    seq: u64,
}

impl ReplayPosition {
    /// The sequence number of the entry at this position (the next one to read).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

#[derive(Debug)]
struct LoadedSegment {
    path: PathBuf,
    first_seq: u64,
    file: File,
    /// The file has no bytes past `buf`.
    at_eof: bool,
    /// Bytes of the file from offset `base` on.
    buf: Vec<u8>,
    base: u64,
    /// Offset in `buf` of the next entry.
    offset: usize,
    /// Sequence number of the entry at `offset`.
    seq: u64,
}

impl LoadedSegment {
    /// Opens a segment and checks its header; reading starts at `at` (an entry's offset and
    /// sequence number), or at the first entry.
    fn open(segment: SegmentRef, at: Option<(u64, u64)>) -> Result<Self> {
        let io = |e| WalError::io("read segment", &segment.path, e);
        let mut file = File::open(&segment.path).map_err(io)?;
        let mut header = [0u8; SEGMENT_HEADER_BYTES as usize];
        file.read_exact(&mut header).map_err(io)?;
        let header_seq = decode_segment_header(&header).map_err(|reason| WalError::Corrupt {
            path: segment.path.clone(),
            offset: 0,
            reason: reason.to_owned(),
        })?;
        if header_seq != segment.first_seq {
            return Err(WalError::Corrupt {
                path: segment.path.clone(),
                offset: 0,
                reason: "segment header does not match its name".to_owned(),
            });
        }
        let (base, seq) = at.unwrap_or((SEGMENT_HEADER_BYTES, segment.first_seq));
        if base != SEGMENT_HEADER_BYTES {
            file.seek(SeekFrom::Start(base)).map_err(io)?;
        }
        Ok(LoadedSegment {
            path: segment.path,
            first_seq: segment.first_seq,
            file,
            at_eof: false,
            buf: Vec::new(),
            base,
            offset: 0,
            seq,
        })
    }

    /// Reads the next chunk of the file after what `buf` holds, dropping what was used.
    fn read_more(&mut self) -> Result<()> {
        self.buf.drain(..self.offset);
        self.base += self.offset as u64;
        self.offset = 0;
        let want = READ_CHUNK_BYTES.max(self.buf.len());
        let got = (&mut self.file)
            .take(want as u64)
            .read_to_end(&mut self.buf)
            .map_err(|e| WalError::io("read segment", &self.path, e))?;
        self.at_eof = got < want;
        Ok(())
    }
}

impl Replay {
    pub(crate) fn new(
        segments: Vec<SegmentRef>,
        from_seq: u64,
        last_seq: u64,
        max_entry_bytes: usize,
        resume: Option<ReplayPosition>,
    ) -> Result<Self> {
        let first_available = segments.first().map_or(last_seq + 1, |s| s.first_seq);
        let from_seq = from_seq.max(1);
        if from_seq < first_available {
            return Err(WalError::Truncated {
                requested: from_seq,
                first_available,
            });
        }
        // Skip segments that end before `from_seq`: a segment ends where the next one starts.
        let first_needed = segments
            .iter()
            .rposition(|s| s.first_seq <= from_seq)
            .unwrap_or(0);
        let mut segments = segments;
        segments.drain(..first_needed);
        // A position is used only where this replay starts, in the segment it starts in.
        let resume = resume.filter(|at| {
            at.seq == from_seq
                && at.offset >= SEGMENT_HEADER_BYTES
                && segments
                    .first()
                    .is_some_and(|s| s.first_seq == at.segment_first_seq)
        });
        Ok(Replay {
            segments: segments.into_iter(),
            resume,
            max_entry_bytes,
            next_seq: from_seq,
            last_seq,
            current: None,
            failed: false,
        })
    }

    /// Where the next entry is, once the replay has read into a segment (`None` before it
    /// has, and after an error).
    pub fn position(&self) -> Option<ReplayPosition> {
        let current = self.current.as_ref().filter(|_| !self.failed)?;
        Some(ReplayPosition {
            segment_first_seq: current.first_seq,
            offset: current.base + current.offset as u64,
            seq: current.seq,
        })
    }

    fn next_entry(&mut self) -> Result<Option<(u64, Vec<u8>)>> {
        while self.next_seq <= self.last_seq {
            let Some(current) = &mut self.current else {
                let Some(segment) = self.segments.next() else {
                    return Err(WalError::Corrupt {
                        path: PathBuf::new(),
                        offset: 0,
                        reason: format!(
                            "entries {}..={} are missing",
                            self.next_seq, self.last_seq
                        ),
                    });
                };
                let at = self.resume.take().map(|at| (at.offset, at.seq));
                self.current = Some(LoadedSegment::open(segment, at)?);
                continue;
            };
            let expected = current.seq;
            match check_entry_at(&current.buf, current.offset, self.max_entry_bytes, |s| {
                s == expected
            }) {
                Ok((header, size)) => {
                    let payload_start = current.offset + crate::entry::ENTRY_HEADER_BYTES;
                    current.offset += size;
                    current.seq += 1;
                    if header.seq >= self.next_seq {
                        self.next_seq = header.seq + 1;
                        let payload = current.buf
                            [payload_start..payload_start + header.payload_len as usize]
                            .to_vec();
                        return Ok(Some((header.seq, payload)));
                    }
                }
                Err(EntryDefect::ShortHeader | EntryDefect::ShortPayload) if !current.at_eof => {
                    current.read_more()?;
                }
                Err(defect) => {
                    // The end of this segment's entries: the next segment must continue the chain.
                    let ended_at_seq = current.seq;
                    let (path, offset) =
                        (current.path.clone(), current.base + current.offset as u64);
                    self.current = None;
                    let continues = self
                        .segments
                        .as_slice()
                        .first()
                        .is_some_and(|next| next.first_seq == ended_at_seq);
                    if !continues {
                        return Err(WalError::Corrupt {
                            path,
                            offset,
                            reason: format!(
                                "{} while replaying entry {ended_at_seq}",
                                defect.describe()
                            ),
                        });
                    }
                }
            }
        }
        Ok(None)
    }
}

impl Iterator for Replay {
    type Item = Result<(u64, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.next_entry() {
            Ok(entry) => entry.map(Ok),
            Err(error) => {
                self.failed = true;
                Some(Err(error))
            }
        }
    }
}
