//! A partition's stored values by slot: each slot's TEXT values and payload, encoded as one
//! blob (an [`Attributes`](crate::Attributes) encoding holding only those), kept apart from the
//! indexed columns of its [`AttributeIndex`](crate::AttributeIndex).
//!
//! In the mutable segment and in a sealed partition that was never written, the blobs are in
//! memory (shared `Arc`s: cloning a column for a seal copies pointers, not texts). Once a sealed
//! partition is written or opened from a file, its blobs stay in the segment file: what stays in
//! memory is the file handle, each slot's offset and a CRC32 of its bytes (12 bytes per slot),
//! and a read is one `pread` whose CRC is checked before the bytes are decoded, so a damaged
//! file is an [`IndexError::Corrupt`], never a wrong answer (as `cold.rs` does for vectors).
//!
//! Section layout (kind 4 of a partition's section table, `docs/SEGMENT_FORMAT.md`):
//!
//! ```text
//! 1      version (1)
//! 4      n: slots recorded (at most the partition's; later slots have no stored values)
//! (n + 1) x 8   offsets into the data: slot i's blob is data[offsets[i]..offsets[i + 1]]
//!               (offsets[0] = 0, never decreasing, offsets[n] = the data's length; an empty
//!               range is a slot without stored values)
//! n x 4  CRC32 of each slot's blob (0 for an empty one)
//! the data
//! ```

use std::sync::Arc;

use crate::cold::SegmentFile;
use crate::error::{IndexError, Result};

/// The stored blobs of one partition, by slot.
#[derive(Debug, Clone)]
pub(crate) enum StoredColumn {
    /// Slot `i`'s blob is `blobs[i]` (slots past the end have none).
    Memory(Vec<Option<Arc<[u8]>>>),
    /// In a segment file.
    File(Arc<FileStored>),
}

/// Blobs left in a segment file.
#[derive(Debug)]
pub(crate) struct FileStored {
    file: Arc<SegmentFile>,
    /// Where the data starts in the file.
    data_offset: u64,
    /// `n + 1` offsets into the data.
    offsets: Vec<u64>,
    crcs: Vec<u32>,
}

impl Default for StoredColumn {
    fn default() -> Self {
        StoredColumn::Memory(Vec::new())
    }
}

const SECTION_VERSION: u8 = 1;

impl StoredColumn {
    /// Sets `slot`'s blob (slots between the last one set and `slot` get none). Only an
    /// in-memory column takes blobs; a column in a file is never written to.
    pub(crate) fn push(&mut self, slot: u32, blob: Arc<[u8]>) {
        match self {
            StoredColumn::Memory(blobs) => {
                let slot = slot as usize;
                if blobs.len() <= slot {
                    blobs.resize(slot + 1, None);
                }
                blobs[slot] = Some(blob);
            }
            StoredColumn::File(_) => {
                debug_assert!(false, "a stored column in a file takes no blobs");
            }
        }
    }

    /// True when no slot has a blob.
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            StoredColumn::Memory(blobs) => blobs.iter().all(Option::is_none),
            StoredColumn::File(stored) => stored.offsets.last().copied().unwrap_or(0) == 0,
        }
    }

    /// Slot `slot`'s blob, if it has one; an error when a blob in a file cannot be read or
    /// fails its checksum.
    pub(crate) fn get(&self, slot: u32) -> Result<Option<Arc<[u8]>>> {
        match self {
            StoredColumn::Memory(blobs) => Ok(blobs.get(slot as usize).cloned().flatten()),
            StoredColumn::File(stored) => stored.get(slot as usize),
        }
    }

    /// Bytes of memory held (blobs in memory, or the offsets and checksums of a file's).
    pub(crate) fn memory_bytes(&self) -> usize {
        match self {
            StoredColumn::Memory(blobs) => {
                blobs.len() * std::mem::size_of::<Option<Arc<[u8]>>>()
                    + blobs.iter().flatten().map(|b| b.len() + 16).sum::<usize>()
            }
            StoredColumn::File(stored) => stored.offsets.len() * 8 + stored.crcs.len() * 4,
        }
    }

    /// The column as a section of `n_slots` slots (layout in the module documentation); an
    /// error when a blob in a file cannot be read.
    pub(crate) fn encode_section(&self, n_slots: u32) -> Result<Vec<u8>> {
        let n = n_slots as usize;
        let mut blobs = Vec::with_capacity(n);
        for slot in 0..n_slots {
            blobs.push(self.get(slot)?);
        }
        let data_len: usize = blobs.iter().flatten().map(|b| b.len()).sum();
        let mut out = Vec::with_capacity(5 + (n + 1) * 8 + n * 4 + data_len);
        out.push(SECTION_VERSION);
        out.extend_from_slice(&n_slots.to_le_bytes());
        let mut offset = 0u64;
        out.extend_from_slice(&offset.to_le_bytes());
        for blob in &blobs {
            offset += blob.as_ref().map_or(0, |b| b.len() as u64);
            out.extend_from_slice(&offset.to_le_bytes());
        }
        for blob in &blobs {
            let crc = blob.as_ref().map_or(0, |b| crc32fast::hash(b));
            out.extend_from_slice(&crc.to_le_bytes());
        }
        for blob in blobs.iter().flatten() {
            out.extend_from_slice(blob);
        }
        Ok(out)
    }

    /// Decodes [`StoredColumn::encode_section`]'s bytes for a partition of `n_slots` slots.
    /// With `file` (the segment file and the section's offset in it), the blobs stay in the
    /// file; without, they are copied into memory (after their checksums are checked). Every
    /// count and offset is checked against the bytes; damage is an [`IndexError::Format`].
    pub(crate) fn decode_section(
        bytes: &[u8],
        n_slots: u32,
        file: Option<(&Arc<SegmentFile>, u64)>,
    ) -> Result<StoredColumn> {
        let bad = |reason: String| IndexError::Format(format!("stored section: {reason}"));
        let (&version, rest) = bytes
            .split_first()
            .ok_or_else(|| bad("empty".to_string()))?;
        if version != SECTION_VERSION {
            return Err(bad(format!("unknown version {version}")));
        }
        let (n_raw, rest) = split(rest, 4).ok_or_else(|| bad("no slot count".to_string()))?;
        let n = u32::from_le_bytes(n_raw.try_into().expect("4 bytes"));
        if n > n_slots {
            return Err(bad(format!("holds {n} slots, the partition {n_slots}")));
        }
        let n = n as usize;
        let (offset_bytes, rest) =
            split(rest, (n + 1) * 8).ok_or_else(|| bad("offsets cut short".to_string()))?;
        let (crc_bytes, data) =
            split(rest, n * 4).ok_or_else(|| bad("checksums cut short".to_string()))?;
        let offsets: Vec<u64> = offset_bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let crcs: Vec<u32> = crc_bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        if offsets[0] != 0
            || offsets.windows(2).any(|w| w[0] > w[1])
            || offsets[n] != data.len() as u64
        {
            return Err(bad(
                "offsets do not run from 0 to the data's length".to_string()
            ));
        }
        match file {
            Some((file, section_offset)) => {
                let data_offset = section_offset + (bytes.len() - data.len()) as u64;
                Ok(StoredColumn::File(Arc::new(FileStored {
                    file: Arc::clone(file),
                    data_offset,
                    offsets,
                    crcs,
                })))
            }
            None => {
                let mut blobs = Vec::with_capacity(n);
                for slot in 0..n {
                    let blob = &data[offsets[slot] as usize..offsets[slot + 1] as usize];
                    if blob.is_empty() {
                        blobs.push(None);
                        continue;
                    }
                    if crc32fast::hash(blob) != crcs[slot] {
                        return Err(bad(format!("slot {slot} fails its checksum")));
                    }
                    blobs.push(Some(Arc::from(blob)));
                }
                Ok(StoredColumn::Memory(blobs))
            }
        }
    }
}

impl FileStored {
    fn get(&self, slot: usize) -> Result<Option<Arc<[u8]>>> {
        if slot + 1 >= self.offsets.len() {
            return Ok(None);
        }
        let (start, end) = (self.offsets[slot], self.offsets[slot + 1]);
        if start == end {
            return Ok(None);
        }
        let mut blob = vec![0u8; (end - start) as usize];
        self.file
            .read_exact_at(&mut blob, self.data_offset + start)?;
        if crc32fast::hash(&blob) != self.crcs[slot] {
            return Err(self.file.corrupt(format!(
                "the stored values of slot {slot} fail their checksum"
            )));
        }
        Ok(Some(Arc::from(blob)))
    }
}

fn split(bytes: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
    (bytes.len() >= n).then(|| bytes.split_at(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(blobs: &[Option<&[u8]>]) -> StoredColumn {
        let mut column = StoredColumn::default();
        for (slot, blob) in blobs.iter().enumerate() {
            if let Some(blob) = blob {
                column.push(slot as u32, Arc::from(*blob));
            }
        }
        column
    }

    #[test]
    fn a_section_decodes_to_the_same_blobs_in_memory_and_from_a_file() {
        let original = column(&[Some(b"one"), None, Some(b"three"), None]);
        let section = original.encode_section(5).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let mut file_bytes = b"header..".to_vec();
        let at = file_bytes.len() as u64;
        file_bytes.extend_from_slice(&section);
        std::fs::write(&path, &file_bytes).unwrap();
        let file = SegmentFile::open(&path).unwrap();
        for decoded in [
            StoredColumn::decode_section(&section, 5, None).unwrap(),
            StoredColumn::decode_section(&section, 5, Some((&file, at))).unwrap(),
        ] {
            let got: Vec<Option<Vec<u8>>> = (0..6)
                .map(|slot| decoded.get(slot).unwrap().map(|b| b.to_vec()))
                .collect();
            assert_eq!(
                got,
                vec![
                    Some(b"one".to_vec()),
                    None,
                    Some(b"three".to_vec()),
                    None,
                    None,
                    None
                ]
            );
            assert!(!decoded.is_empty());
        }
        assert!(StoredColumn::default().is_empty());
    }

    #[test]
    fn damaged_sections_and_files_are_refused_not_misread() {
        let section = column(&[Some(b"alpha"), Some(b"beta")])
            .encode_section(2)
            .unwrap();
        // Every truncation is a format error, never a panic.
        for len in 0..section.len() {
            assert!(StoredColumn::decode_section(&section[..len], 2, None).is_err());
        }
        // More slots than the partition has.
        assert!(StoredColumn::decode_section(&section, 1, None).is_err());
        // A flipped data byte fails the slot's checksum (in memory at decoding, from a file
        // at the read).
        let mut damaged = section.clone();
        let last = damaged.len() - 1;
        damaged[last] ^= 1;
        assert!(StoredColumn::decode_section(&damaged, 2, None).is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        std::fs::write(&path, &damaged).unwrap();
        let file = SegmentFile::open(&path).unwrap();
        let cold = StoredColumn::decode_section(&damaged, 2, Some((&file, 0))).unwrap();
        assert_eq!(cold.get(0).unwrap().as_deref(), Some(&b"alpha"[..]));
        assert!(matches!(cold.get(1), Err(IndexError::Corrupt { .. })));
    }
}
