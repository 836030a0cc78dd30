//! A sealed partition's full vectors: in memory, or left in the segment file ("cold") and read
//! on demand, for a collection with `vectors_on_disk`.
//!
//! Cold vectors stay where `SealedSegment::encode` wrote them (the `f32` block of their
//! partition in the `.tseg` file; the format does not change). What stays in memory is the file
//! handle, the block's offset and a CRC32 of each slot's vector (4 bytes per slot), taken from
//! the bytes as written (or as read and checked against the file's trailer at open). A read is
//! one `pread` of the slot's `4 x dimension` bytes whose CRC is checked before the vector is
//! used: a damaged cold file is an [`IndexError::Corrupt`], never a wrong answer.
//!
//! Reads are `pread`, not a memory map: resident memory stays what the process allocated (the
//! page cache holding recently read vectors is the kernel's to drop), a truncated file is an
//! I/O error rather than a `SIGBUS`, and no `unsafe` is needed. The file is advised
//! `POSIX_FADV_RANDOM` so that a 1.5 KiB read does not pull in the kernel's readahead window.
//! Only partitions with a graph and quantized codes go cold: their graph walk reads the codes
//! and only the best `k x rescore` candidates are read here (`sealed.rs`).

use std::borrow::Cow;
use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{IndexError, Result};

/// An open segment file that cold vectors are read from.
#[derive(Debug)]
pub(crate) struct SegmentFile {
    file: File,
    path: PathBuf,
    /// Bytes asked of the file by cold reads since it was opened (what the page cache or the
    /// disk served; benchmarks read the disk's share from `/proc/self/io`).
    bytes_read: AtomicU64,
}

impl SegmentFile {
    /// Opens `path` for cold reads, advising the kernel that reads are random.
    pub(crate) fn open(path: &Path) -> Result<Arc<SegmentFile>> {
        let file =
            File::open(path).map_err(|e| IndexError::io("open segment for cold reads", path, e))?;
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random)
            .map_err(|e| IndexError::io("advise random reads", path, e.into()))?;
        Ok(Arc::new(SegmentFile {
            file,
            path: path.to_owned(),
            bytes_read: AtomicU64::new(0),
        }))
    }

    pub(crate) fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Asks the kernel to drop the file's pages from the page cache (`POSIX_FADV_DONTNEED`), so
    /// that the next reads go to the disk: how benchmarks measure cold searches.
    pub(crate) fn evict(&self) -> Result<()> {
        rustix::fs::fadvise(&self.file, 0, None, rustix::fs::Advice::DontNeed)
            .map_err(|e| IndexError::io("evict cold vectors", &self.path, e.into()))
    }

    pub(crate) fn read_exact_at(&self, buffer: &mut [u8], offset: u64) -> Result<()> {
        self.bytes_read
            .fetch_add(buffer.len() as u64, Ordering::Relaxed);
        self.file
            .read_exact_at(buffer, offset)
            .map_err(|e| IndexError::io("read cold vectors", &self.path, e))
    }

    pub(crate) fn corrupt(&self, reason: String) -> IndexError {
        IndexError::Corrupt {
            path: self.path.clone(),
            reason,
        }
    }
}

/// Where a partition's full vectors are.
#[derive(Debug)]
pub(crate) enum StoredVectors {
    /// `dimension` values per slot.
    Memory(Vec<f32>),
    Disk(ColdVectors),
}

/// A partition's vectors in its segment file: slot `s` at `offset + s * 4 * dimension`.
#[derive(Debug)]
pub(crate) struct ColdVectors {
    file: Arc<SegmentFile>,
    offset: u64,
    dimension: usize,
    /// CRC32 of each slot's `4 x dimension` little-endian bytes.
    crcs: Vec<u32>,
}

/// Per-thread buffers for cold reads: a search reads many vectors, one at a time.
#[derive(Debug, Default)]
pub(crate) struct ColdScratch {
    bytes: Vec<u8>,
    values: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<ColdScratch> = RefCell::new(ColdScratch::default());
}

impl StoredVectors {
    pub(crate) fn n_values(&self) -> usize {
        match self {
            StoredVectors::Memory(values) => values.len(),
            StoredVectors::Disk(cold) => cold.crcs.len() * cold.dimension,
        }
    }

    /// Bytes these vectors keep in memory.
    pub(crate) fn memory_bytes(&self) -> usize {
        match self {
            StoredVectors::Memory(values) => values.len() * 4,
            StoredVectors::Disk(cold) => cold.crcs.len() * 4,
        }
    }

    /// Bytes of vectors left in the file.
    pub(crate) fn cold_bytes(&self) -> usize {
        match self {
            StoredVectors::Memory(_) => 0,
            StoredVectors::Disk(cold) => cold.crcs.len() * cold.dimension * 4,
        }
    }

    pub(crate) fn is_cold(&self) -> bool {
        matches!(self, StoredVectors::Disk(_))
    }

    pub(crate) fn file(&self) -> Option<&Arc<SegmentFile>> {
        match self {
            StoredVectors::Memory(_) => None,
            StoredVectors::Disk(cold) => Some(&cold.file),
        }
    }

    /// The vectors in memory (`None` when cold).
    pub(crate) fn in_memory(&self) -> Option<&[f32]> {
        match self {
            StoredVectors::Memory(values) => Some(values),
            StoredVectors::Disk(_) => None,
        }
    }

    /// Calls `f` with slot `slot`'s vector (`dimension` values), read from the file and checked
    /// when cold.
    #[inline]
    pub(crate) fn with<R>(
        &self,
        slot: u32,
        dimension: usize,
        f: impl FnOnce(&[f32]) -> R,
    ) -> Result<R> {
        match self {
            StoredVectors::Memory(values) => {
                Ok(f(&values[slot as usize * dimension..][..dimension]))
            }
            StoredVectors::Disk(cold) => SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                let ColdScratch { bytes, values } = &mut *scratch;
                cold.read(slot, bytes, values)?;
                Ok(f(values))
            }),
        }
    }

    /// Every slot's vector, in slot order: borrowed when in memory, read whole (and every slot
    /// checked) when cold. For rebuilds and merges, which need them all.
    pub(crate) fn all(&self) -> Result<Cow<'_, [f32]>> {
        match self {
            StoredVectors::Memory(values) => Ok(Cow::Borrowed(values)),
            StoredVectors::Disk(cold) => cold.read_all().map(Cow::Owned),
        }
    }

    /// Leaves these vectors (which must be in memory) in `file` at `offset`, where they were
    /// just written, keeping a CRC per slot.
    pub(crate) fn make_cold(&mut self, dimension: usize, file: Arc<SegmentFile>, offset: u64) {
        let StoredVectors::Memory(values) = self else {
            return;
        };
        let mut bytes = Vec::with_capacity(dimension * 4);
        let crcs = values
            .chunks_exact(dimension)
            .map(|vector| {
                bytes.clear();
                vector
                    .iter()
                    .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                crc32fast::hash(&bytes)
            })
            .collect();
        *self = StoredVectors::Disk(ColdVectors {
            file,
            offset,
            dimension,
            crcs,
        });
    }

    /// Cold vectors of `n_slots` slots whose bytes `block` (already checked by the file's
    /// trailer) are at `offset` of `file`.
    pub(crate) fn cold_from_bytes(
        block: &[u8],
        dimension: usize,
        file: Arc<SegmentFile>,
        offset: u64,
    ) -> StoredVectors {
        let crcs = if dimension == 0 {
            Vec::new()
        } else {
            block
                .chunks_exact(dimension * 4)
                .map(crc32fast::hash)
                .collect()
        };
        StoredVectors::Disk(ColdVectors {
            file,
            offset,
            dimension,
            crcs,
        })
    }
}

impl ColdVectors {
    fn read(&self, slot: u32, bytes: &mut Vec<u8>, values: &mut Vec<f32>) -> Result<()> {
        let slot = slot as usize;
        let Some(&expected) = self.crcs.get(slot) else {
            return Err(self
                .file
                .corrupt(format!("cold read of slot {slot} past the last slot")));
        };
        let len = self.dimension * 4;
        bytes.resize(len, 0);
        self.file
            .read_exact_at(bytes, self.offset + (slot * len) as u64)?;
        if crc32fast::hash(bytes) != expected {
            return Err(self.file.corrupt(format!(
                "the vector of slot {slot} at byte {} does not match its checksum",
                self.offset + (slot * len) as u64
            )));
        }
        values.clear();
        values.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        Ok(())
    }

    fn read_all(&self) -> Result<Vec<f32>> {
        let len = self.dimension * 4;
        let mut bytes = vec![0u8; self.crcs.len() * len];
        self.file.read_exact_at(&mut bytes, self.offset)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        for (slot, (vector, expected)) in bytes.chunks_exact(len).zip(&self.crcs).enumerate() {
            if crc32fast::hash(vector) != *expected {
                return Err(self.file.corrupt(format!(
                    "the vector of slot {slot} at byte {} does not match its checksum",
                    self.offset + (slot * len) as u64
                )));
            }
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

/// The first error of the cold reads inside a search's distance closures, which cannot return
/// one: a failed read counts as infinitely far, and the search reports the error when it ends
/// instead of its answer.
#[derive(Debug, Default)]
pub(crate) struct FirstError(RefCell<Option<IndexError>>);

impl FirstError {
    /// The distance, or `f32::INFINITY` with the error kept (the first one).
    #[inline]
    pub(crate) fn distance(&self, distance: Result<f32>) -> f32 {
        match distance {
            Ok(distance) => distance,
            Err(error) => {
                self.0.borrow_mut().get_or_insert(error);
                f32::INFINITY
            }
        }
    }

    /// `value`, unless a read failed.
    pub(crate) fn into_result<T>(self, value: T) -> Result<T> {
        match self.0.into_inner() {
            Some(error) => Err(error),
            None => Ok(value),
        }
    }
}
