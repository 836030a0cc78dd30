//! Reading entries back, in sequence order, from a snapshot of the segment list.

use std::path::PathBuf;

use crate::entry::check_entry_at;
use crate::error::{Result, WalError};
use crate::segment::{decode_segment_header, SEGMENT_HEADER_BYTES};
use crate::segmented_log::SegmentRef;

/// An iterator over `(sequence number, payload)` from a starting sequence number up to the last
/// entry appended when the replay was created. It reads one segment file at a time.
#[derive(Debug)]
pub struct Replay {
    segments: std::vec::IntoIter<SegmentRef>,
    max_entry_bytes: usize,
    /// Next sequence number to yield.
    next_seq: u64,
    /// Last sequence number to yield.
    last_seq: u64,
    current: Option<LoadedSegment>,
    failed: bool,
}

#[derive(Debug)]
struct LoadedSegment {
    path: PathBuf,
    bytes: Vec<u8>,
    offset: usize,
    /// Sequence number of the entry at `offset`.
    seq: u64,
}

impl Replay {
    pub(crate) fn new(
        segments: Vec<SegmentRef>,
        from_seq: u64,
        last_seq: u64,
        max_entry_bytes: usize,
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
        Ok(Replay {
            segments: segments.into_iter(),
            max_entry_bytes,
            next_seq: from_seq,
            last_seq,
            current: None,
            failed: false,
        })
    }

    fn load_next_segment(&mut self) -> Result<bool> {
        let Some(segment) = self.segments.next() else {
            return Ok(false);
        };
        let bytes = std::fs::read(&segment.path)
            .map_err(|e| WalError::io("read segment", &segment.path, e))?;
        let header_seq = decode_segment_header(&bytes).map_err(|reason| WalError::Corrupt {
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
        self.current = Some(LoadedSegment {
            path: segment.path,
            bytes,
            offset: SEGMENT_HEADER_BYTES as usize,
            seq: segment.first_seq,
        });
        Ok(true)
    }

    fn next_entry(&mut self) -> Result<Option<(u64, Vec<u8>)>> {
        while self.next_seq <= self.last_seq {
            let Some(current) = &mut self.current else {
                if !self.load_next_segment()? {
                    return Err(WalError::Corrupt {
                        path: PathBuf::new(),
                        offset: 0,
                        reason: format!(
                            "entries {}..={} are missing",
                            self.next_seq, self.last_seq
                        ),
                    });
                }
                continue;
            };
            let expected = current.seq;
            match check_entry_at(&current.bytes, current.offset, self.max_entry_bytes, |s| {
                s == expected
            }) {
                Ok((header, size)) => {
                    let payload_start = current.offset + crate::entry::ENTRY_HEADER_BYTES;
                    current.offset += size;
                    current.seq += 1;
                    if header.seq >= self.next_seq {
                        self.next_seq = header.seq + 1;
                        let payload = current.bytes
                            [payload_start..payload_start + header.payload_len as usize]
                            .to_vec();
                        return Ok(Some((header.seq, payload)));
                    }
                }
                Err(defect) => {
                    // The end of this segment's entries: the next segment must continue the chain.
                    let ended_at_seq = current.seq;
                    let (path, offset) = (current.path.clone(), current.offset);
                    self.current = None;
                    let continues = self
                        .segments
                        .as_slice()
                        .first()
                        .is_some_and(|next| next.first_seq == ended_at_seq);
                    if !continues {
                        return Err(WalError::Corrupt {
                            path,
                            offset: offset as u64,
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
