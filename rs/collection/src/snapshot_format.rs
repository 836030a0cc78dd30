//! The byte layout of a snapshot file (`.tsnap`, `docs/SNAPSHOT_FORMAT.md`): the constants and
//! encoders the snapshot writer uses, and [`SnapshotDecoder`], the one reader, fed bytes in any
//! chunking by both restore and verify.
//!
//! ```text
//! file header   "TARNSNP1", format version (u32), CRC32 of those 12 bytes
//! parts         kind (u8), name length (u8), name, body length (u64), body, CRC32 of all that
//!               1 header, 2 manifest, 3 segment file, 4 tombstone file, 5 WAL entries
//! end           kind 255, total file length (u64), CRC32 of every byte before it
//! ```
//!
//! The decoder trusts nothing: every length is checked against a per-kind bound and against
//! what the header declares is left before anything is buffered (and buffers grow with the
//! bytes that actually arrive), names are parsed against the exact patterns of a collection's
//! files, and the order and counts of parts are checked against the header and the manifest.
//! Errors name the part and the defect, never a path.

use std::collections::HashMap;

use crc32fast::Hasher;

use crate::config::CollectionConfig;
use crate::error::{CollectionError, Result};
use crate::manifest::{self, Manifest};
use crate::op;

pub(crate) const MAGIC: &[u8; 8] = b"TARNSNP1";
/// The version this tarn writes, and the newest it reads.
pub(crate) const FORMAT_VERSION: u32 = 1;
/// Magic, version, CRC32.
pub(crate) const FILE_HEADER_BYTES: u64 = 16;
/// Kind, total length, CRC32.
pub(crate) const END_BYTES: u64 = 13;

pub(crate) const HEADER_PART_NAME: &str = "header";
pub(crate) const WAL_PART_NAME: &str = "wal";

/// Fixed fields of the header part's body, before the config JSON.
const HEADER_FIXED_BYTES: usize = 52;
/// Largest header part body (the config JSON is a few hundred bytes).
const MAX_HEADER_BODY: u64 = 1 << 20;
/// Largest manifest part body (a manifest lists a handful of segments; 16 MiB is thousands).
const MAX_MANIFEST_BODY: u64 = 16 << 20;
/// Largest WAL entry payload: the WAL's own limit (`WalConfig::default().max_entry_bytes`,
/// which is what a collection's log runs with).
pub(crate) const MAX_WAL_PAYLOAD: u64 = 64 << 20;
/// Sequence number (u64) and payload length (u32) before each payload in a WAL part.
pub(crate) const WAL_RECORD_HEADER_BYTES: u64 = 12;
/// The writer closes a WAL part once it holds about this many bytes.
pub(crate) const WAL_PART_TARGET_BYTES: u64 = 4 << 20;
/// Largest WAL part body: the target, or one record of the largest payload.
const MAX_WAL_PART_BODY: u64 = if WAL_PART_TARGET_BYTES > WAL_RECORD_HEADER_BYTES + MAX_WAL_PAYLOAD
{
    WAL_PART_TARGET_BYTES
} else {
    WAL_RECORD_HEADER_BYTES + MAX_WAL_PAYLOAD
};

/// What a part holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartKind {
    Header = 1,
    Manifest = 2,
    Segment = 3,
    Tombstones = 4,
    WalEntries = 5,
}

/// The kind byte of the end marker.
pub(crate) const END_KIND: u8 = 255;

impl PartKind {
    fn from_byte(byte: u8) -> Option<PartKind> {
        Some(match byte {
            1 => PartKind::Header,
            2 => PartKind::Manifest,
            3 => PartKind::Segment,
            4 => PartKind::Tombstones,
            5 => PartKind::WalEntries,
            _ => return None,
        })
    }

    fn describe(self) -> &'static str {
        match self {
            PartKind::Header => "header",
            PartKind::Manifest => "manifest",
            PartKind::Segment => "segment file",
            PartKind::Tombstones => "tombstone file",
            PartKind::WalEntries => "WAL entries",
        }
    }
}

/// The header part: what the snapshot is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SnapshotHeader {
    /// The snapshot holds exactly the operations up to this sequence number.
    pub(crate) seq_no: u64,
    /// Operations up to here are in the segment files; the WAL entries follow it.
    pub(crate) checkpoint_seq: u64,
    /// 0 when the collection had no checkpoint (no manifest, no segment files).
    pub(crate) manifest_generation: u64,
    /// Length of the whole file.
    pub(crate) total_bytes: u64,
    /// `seq_no - checkpoint_seq`.
    pub(crate) n_wal_entries: u64,
    /// Segment and tombstone files (the manifest not counted).
    pub(crate) n_file_parts: u32,
    pub(crate) n_wal_parts: u32,
    pub(crate) config: CollectionConfig,
}

impl SnapshotHeader {
    pub(crate) fn encode_body(&self) -> Vec<u8> {
        let config = serde_json::to_vec(&self.config).expect("the config always serialises");
        let mut body = Vec::with_capacity(HEADER_FIXED_BYTES + config.len());
        body.extend_from_slice(&self.seq_no.to_le_bytes());
        body.extend_from_slice(&self.checkpoint_seq.to_le_bytes());
        body.extend_from_slice(&self.manifest_generation.to_le_bytes());
        body.extend_from_slice(&self.total_bytes.to_le_bytes());
        body.extend_from_slice(&self.n_wal_entries.to_le_bytes());
        body.extend_from_slice(&self.n_file_parts.to_le_bytes());
        body.extend_from_slice(&self.n_wal_parts.to_le_bytes());
        body.extend_from_slice(&(config.len() as u32).to_le_bytes());
        body.extend_from_slice(&config);
        body
    }

    /// Length of the header part's body for `config` (the writer needs it to know the total).
    pub(crate) fn body_len(config: &CollectionConfig) -> u64 {
        let config = serde_json::to_vec(config).expect("the config always serialises");
        (HEADER_FIXED_BYTES + config.len()) as u64
    }

    fn decode_body(body: &[u8]) -> std::result::Result<SnapshotHeader, String> {
        if body.len() < HEADER_FIXED_BYTES {
            return Err(format!(
                "{} bytes, fewer than its {HEADER_FIXED_BYTES} fixed ones",
                body.len()
            ));
        }
        let u64_at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().expect("4 bytes"));
        let config_len = u32_at(48) as usize;
        if HEADER_FIXED_BYTES + config_len != body.len() {
            return Err(format!(
                "the config is said to be {config_len} bytes, but {} follow",
                body.len() - HEADER_FIXED_BYTES
            ));
        }
        let config: CollectionConfig = serde_json::from_slice(&body[HEADER_FIXED_BYTES..])
            .map_err(|e| format!("the collection config is unreadable: {e}"))?;
        config
            .validate()
            .map_err(|e| format!("the collection config is invalid: {e}"))?;
        let header = SnapshotHeader {
            seq_no: u64_at(0),
            checkpoint_seq: u64_at(8),
            manifest_generation: u64_at(16),
            total_bytes: u64_at(24),
            n_wal_entries: u64_at(32),
            n_file_parts: u32_at(40),
            n_wal_parts: u32_at(44),
            config,
        };
        header.check()?;
        Ok(header)
    }

    /// The fields agree with each other.
    fn check(&self) -> std::result::Result<(), String> {
        if self.checkpoint_seq > self.seq_no {
            return Err(format!(
                "checkpoint at {} is after the snapshot's sequence number {}",
                self.checkpoint_seq, self.seq_no
            ));
        }
        if self.n_wal_entries != self.seq_no - self.checkpoint_seq {
            return Err(format!(
                "{} WAL entries, but {} operations lie between the checkpoint at {} and \
                 sequence number {}",
                self.n_wal_entries,
                self.seq_no - self.checkpoint_seq,
                self.checkpoint_seq,
                self.seq_no
            ));
        }
        if (self.n_wal_parts == 0) != (self.n_wal_entries == 0)
            || u64::from(self.n_wal_parts) > self.n_wal_entries
        {
            return Err(format!(
                "{} WAL parts cannot hold {} entries",
                self.n_wal_parts, self.n_wal_entries
            ));
        }
        if self.manifest_generation == 0 && (self.checkpoint_seq != 0 || self.n_file_parts != 0) {
            return Err(format!(
                "no manifest, yet a checkpoint at {} and {} segment or tombstone files",
                self.checkpoint_seq, self.n_file_parts
            ));
        }
        Ok(())
    }
}

/// The file header: magic, version, CRC32 of both.
pub(crate) fn encode_file_header() -> [u8; FILE_HEADER_BYTES as usize] {
    let mut bytes = [0u8; FILE_HEADER_BYTES as usize];
    bytes[0..8].copy_from_slice(MAGIC);
    bytes[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    let crc = crc32fast::hash(&bytes[0..12]);
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// A part's bytes before its body: kind, name length, name, body length.
pub(crate) fn encode_part_prefix(kind: PartKind, name: &str, body_len: u64) -> Vec<u8> {
    let name_len = u8::try_from(name.len()).expect("part names are short");
    let mut bytes = Vec::with_capacity(10 + name.len());
    bytes.push(kind as u8);
    bytes.push(name_len);
    bytes.extend_from_slice(name.as_bytes());
    bytes.extend_from_slice(&body_len.to_le_bytes());
    bytes
}

/// Length of a whole part with `name` and a body of `body_len` bytes.
pub(crate) fn part_len(name: &str, body_len: u64) -> u64 {
    1 + 1 + name.len() as u64 + 8 + body_len + 4
}

/// The bytes of one WAL record before its payload.
pub(crate) fn encode_wal_record_header(seq: u64, payload_len: u32) -> [u8; 12] {
    let mut bytes = [0u8; 12];
    bytes[0..8].copy_from_slice(&seq.to_le_bytes());
    bytes[8..12].copy_from_slice(&payload_len.to_le_bytes());
    bytes
}

/// What restore does with the parts the decoder has checked. Every call comes after the
/// checks that concern it: `file_end` after the part's checksum matched, `wal_entry` after its
/// WAL part's checksum matched and the entry decoded as an operation.
pub(crate) trait PartSink {
    fn header(&mut self, header: &SnapshotHeader) -> Result<()>;
    /// A manifest, segment or tombstone file of `len` bytes begins; `name` is a valid name for
    /// its kind.
    fn file_start(&mut self, kind: PartKind, name: &str, len: u64) -> Result<()>;
    fn file_bytes(&mut self, bytes: &[u8]) -> Result<()>;
    fn file_end(&mut self) -> Result<()>;
    fn wal_entry(&mut self, seq: u64, payload: &[u8]) -> Result<()>;
}

/// A sink that keeps nothing (verify).
#[derive(Debug, Default)]
pub(crate) struct DiscardSink;

impl PartSink for DiscardSink {
    fn header(&mut self, _: &SnapshotHeader) -> Result<()> {
        Ok(())
    }
    fn file_start(&mut self, _: PartKind, _: &str, _: u64) -> Result<()> {
        Ok(())
    }
    fn file_bytes(&mut self, _: &[u8]) -> Result<()> {
        Ok(())
    }
    fn file_end(&mut self) -> Result<()> {
        Ok(())
    }
    fn wal_entry(&mut self, _: u64, _: &[u8]) -> Result<()> {
        Ok(())
    }
}

/// What a complete, checked snapshot holds.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SnapshotInfo {
    /// The format version the file was written in.
    pub format_version: u32,
    /// The snapshot holds exactly the operations up to this sequence number; a collection
    /// restored from it gives its next write `seq_no + 1`.
    pub seq_no: u64,
    /// The checkpoint the segment files hold; WAL entries `checkpoint_seq + 1 ..= seq_no` follow.
    pub checkpoint_seq: u64,
    pub config: CollectionConfig,
    /// Length of the file.
    pub n_bytes: u64,
    pub n_segments: usize,
    pub n_tombstone_files: usize,
    pub n_wal_entries: u64,
}

/// Where the decoder is in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Magic,
    VersionAndCrc,
    PartKind,
    NameLen,
    Name(usize),
    BodyLen,
    Body,
    PartCrc,
    EndTotal,
    EndCrc,
    Done,
}

impl Stage {
    /// Bytes a fixed-size field of this stage takes (`Body` and `Done` have none).
    fn field_len(self) -> usize {
        match self {
            Stage::Magic => 8,
            Stage::VersionAndCrc => 8,
            Stage::PartKind | Stage::NameLen => 1,
            Stage::Name(n) => n,
            Stage::BodyLen | Stage::EndTotal => 8,
            Stage::PartCrc | Stage::EndCrc => 4,
            Stage::Body | Stage::Done => 0,
        }
    }
}

/// The part being read.
#[derive(Debug)]
struct Part {
    /// 1-based, in file order.
    number: u32,
    /// Byte offset of its kind byte.
    offset: u64,
    kind: PartKind,
    name: String,
    body_len: u64,
    body_read: u64,
    crc: Hasher,
    /// Header, manifest and WAL bodies are checked whole (bounded by their kind's maximum);
    /// segment and tombstone bodies go straight to the sink.
    buffer: Vec<u8>,
}

impl Part {
    fn describe(&self) -> String {
        match self.kind {
            PartKind::Header | PartKind::WalEntries => {
                format!("part {} ({})", self.number, self.kind.describe())
            }
            _ => format!(
                "part {} ({} {})",
                self.number,
                self.kind.describe(),
                self.name
            ),
        }
    }
}

/// Reads a snapshot pushed to it in chunks of any size, checks everything, and hands what it
/// checked to a [`PartSink`].
#[derive(Debug)]
pub(crate) struct SnapshotDecoder {
    stage: Stage,
    /// Bytes consumed so far.
    position: u64,
    /// CRC32 of every byte so far, up to the end marker's checksum.
    file_crc: Hasher,
    /// The fixed-size field being gathered.
    field: Vec<u8>,
    /// The raw kind byte just read (a part's kind, or the end marker's).
    kind_byte: u8,
    /// Byte offset of the latest kind byte.
    part_start: u64,
    name_len: usize,
    part: Option<Part>,
    /// The last complete part, for messages.
    last_part: Option<String>,
    n_parts: u32,
    version: u32,
    header: Option<SnapshotHeader>,
    /// The manifest's segment and tombstone files, with whether each has been seen.
    expected_files: HashMap<String, (PartKind, bool)>,
    manifest_seen: bool,
    n_file_parts: u32,
    n_wal_parts: u32,
    n_segments: usize,
    n_tombstone_files: usize,
    next_wal_seq: u64,
    /// Set by the first error: nothing more is accepted.
    failed: bool,
}

fn damaged(what: impl Into<String>) -> CollectionError {
    CollectionError::SnapshotDamaged { what: what.into() }
}

impl Default for SnapshotDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl SnapshotDecoder {
    pub(crate) fn new() -> Self {
        SnapshotDecoder {
            stage: Stage::Magic,
            position: 0,
            file_crc: Hasher::new(),
            field: Vec::with_capacity(16),
            kind_byte: 0,
            part_start: 0,
            name_len: 0,
            part: None,
            last_part: None,
            n_parts: 0,
            version: 0,
            header: None,
            expected_files: HashMap::new(),
            manifest_seen: false,
            n_file_parts: 0,
            n_wal_parts: 0,
            n_segments: 0,
            n_tombstone_files: 0,
            next_wal_seq: 0,
            failed: false,
        }
    }

    /// The header, once its part has been read and checked.
    pub(crate) fn header(&self) -> Option<&SnapshotHeader> {
        self.header.as_ref()
    }

    /// Takes the next bytes of the file. Fails at the first damage it can see.
    pub(crate) fn push(&mut self, input: &[u8], sink: &mut dyn PartSink) -> Result<()> {
        if self.failed {
            return Err(damaged("the snapshot was already refused"));
        }
        let result = self.push_inner(input, sink);
        if result.is_err() {
            self.failed = true;
        }
        result
    }

    fn push_inner(&mut self, mut input: &[u8], sink: &mut dyn PartSink) -> Result<()> {
        while !input.is_empty() {
            match self.stage {
                Stage::Done => {
                    return Err(damaged(format!(
                        "bytes follow the end of the snapshot at byte {}",
                        self.position
                    )));
                }
                Stage::Body => {
                    let part = self.part.as_mut().expect("a body belongs to a part");
                    let n = (part.body_len - part.body_read).min(input.len() as u64) as usize;
                    let (chunk, rest) = input.split_at(n);
                    input = rest;
                    self.file_crc.update(chunk);
                    part.crc.update(chunk);
                    part.body_read += n as u64;
                    self.position += n as u64;
                    match part.kind {
                        PartKind::Segment | PartKind::Tombstones => sink.file_bytes(chunk)?,
                        _ => part.buffer.extend_from_slice(chunk),
                    }
                    if part.body_read == part.body_len {
                        self.stage = Stage::PartCrc;
                    }
                }
                stage => {
                    let wanted = stage.field_len() - self.field.len();
                    let n = wanted.min(input.len());
                    let (chunk, rest) = input.split_at(n);
                    input = rest;
                    if stage != Stage::EndCrc {
                        self.file_crc.update(chunk);
                    }
                    self.field.extend_from_slice(chunk);
                    self.position += n as u64;
                    if stage == Stage::Magic && !MAGIC.starts_with(&self.field) {
                        return Err(self.not_a_snapshot());
                    }
                    if self.field.len() == stage.field_len() {
                        let field = std::mem::take(&mut self.field);
                        self.field_complete(stage, &field, sink)?;
                        self.field = field;
                        self.field.clear();
                    }
                }
            }
        }
        Ok(())
    }

    fn not_a_snapshot(&self) -> CollectionError {
        let hex: Vec<String> = self.field.iter().map(|b| format!("{b:02x}")).collect();
        damaged(format!(
            "not a tarn snapshot: it starts with bytes {}, not \"TARNSNP1\"",
            hex.join(" ")
        ))
    }

    /// The bytes left for parts and the end marker after `self.position`, as the header
    /// declares (unbounded before the header is read).
    fn declared_remaining(&self) -> u64 {
        self.header
            .as_ref()
            .map_or(u64::MAX, |h| h.total_bytes.saturating_sub(self.position))
    }

    fn field_complete(
        &mut self,
        stage: Stage,
        field: &[u8],
        sink: &mut dyn PartSink,
    ) -> Result<()> {
        let u64_of = |f: &[u8]| u64::from_le_bytes(f.try_into().expect("8 bytes"));
        let u32_of = |f: &[u8]| u32::from_le_bytes(f.try_into().expect("4 bytes"));
        match stage {
            Stage::Magic => self.stage = Stage::VersionAndCrc,
            Stage::VersionAndCrc => {
                let version = u32_of(&field[0..4]);
                let stored = u32_of(&field[4..8]);
                let mut crc = Hasher::new();
                crc.update(MAGIC);
                crc.update(&field[0..4]);
                let computed = crc.finalize();
                if stored != computed {
                    return Err(damaged(format!(
                        "the file header's checksum does not match (stored {stored:08x}, \
                         computed {computed:08x})"
                    )));
                }
                if version == 0 {
                    return Err(damaged("the file header names format version 0"));
                }
                if version > FORMAT_VERSION {
                    return Err(CollectionError::SnapshotVersion {
                        found: version,
                        supported: FORMAT_VERSION,
                    });
                }
                // Versions before FORMAT_VERSION would be dispatched to their readers here.
                self.version = version;
                self.stage = Stage::PartKind;
            }
            Stage::PartKind => {
                self.kind_byte = field[0];
                self.part_start = self.position - 1;
                self.stage = if self.kind_byte == END_KIND {
                    self.check_complete()?;
                    Stage::EndTotal
                } else if PartKind::from_byte(self.kind_byte).is_none() {
                    return Err(damaged(format!(
                        "part {} at byte {} has an unknown kind {}",
                        self.n_parts + 1,
                        self.part_start,
                        self.kind_byte
                    )));
                } else {
                    Stage::NameLen
                };
            }
            Stage::NameLen => {
                self.name_len = field[0] as usize;
                if self.name_len == 0 {
                    return Err(damaged(format!(
                        "part {} at byte {} has an empty name",
                        self.n_parts + 1,
                        self.part_start
                    )));
                }
                self.stage = Stage::Name(self.name_len);
            }
            Stage::Name(_) => self.start_part(field)?,
            Stage::BodyLen => {
                let body_len = u64_of(field);
                self.check_body_len(body_len)?;
                let part = self.part.as_mut().expect("a part is open");
                part.crc.update(field);
                part.body_len = body_len;
                if matches!(part.kind, PartKind::Segment | PartKind::Tombstones) {
                    sink.file_start(part.kind, &part.name, body_len)?;
                }
                self.stage = Stage::Body;
            }
            Stage::PartCrc => {
                let part = self.part.take().expect("a part is open");
                let stored = u32_of(field);
                let computed = part.crc.clone().finalize();
                if stored != computed {
                    return Err(damaged(format!(
                        "{} at byte {}: checksum mismatch (stored {stored:08x}, computed \
                         {computed:08x})",
                        part.describe(),
                        part.offset
                    )));
                }
                let description = part.describe();
                self.finish_part(part, sink)?;
                self.last_part = Some(description);
                self.stage = Stage::PartKind;
            }
            Stage::EndTotal => {
                let total = u64_of(field);
                let actual = self.position + 4;
                let declared = self.header.as_ref().map_or(0, |h| h.total_bytes);
                if total != actual || total != declared {
                    return Err(damaged(format!(
                        "the end marker says the file is {total} bytes long, but it ends at \
                         byte {actual} and the header declares {declared}"
                    )));
                }
                self.stage = Stage::EndCrc;
            }
            Stage::EndCrc => {
                let stored = u32_of(field);
                let computed = self.file_crc.clone().finalize();
                if stored != computed {
                    return Err(damaged(format!(
                        "the checksum over the whole file does not match (stored {stored:08x}, \
                         computed {computed:08x})"
                    )));
                }
                self.stage = Stage::Done;
            }
            Stage::Body | Stage::Done => unreachable!("not a fixed-size field"),
        }
        Ok(())
    }

    /// A part's name is complete: check kind, order and name, and open the part.
    fn start_part(&mut self, name_bytes: &[u8]) -> Result<()> {
        let number = self.n_parts + 1;
        let offset = self.part_start;
        let printable = String::from_utf8_lossy(name_bytes).into_owned();
        let kind = PartKind::from_byte(self.kind_byte).expect("checked when read");
        let name = match std::str::from_utf8(name_bytes) {
            Ok(name) if name.bytes().all(|b| b.is_ascii_graphic()) => name.to_owned(),
            _ => {
                return Err(damaged(format!(
                    "part {number} ({}) at byte {offset} has a name that is not printable \
                     ASCII: {printable:?}",
                    kind.describe()
                )))
            }
        };
        let order_error = |what: &str| {
            damaged(format!(
                "part {number} ({} {name}) at byte {offset} {what}",
                kind.describe()
            ))
        };
        let header = self.header.as_ref();
        match kind {
            PartKind::Header if self.n_parts > 0 => {
                return Err(order_error("repeats the header"));
            }
            PartKind::Header => {
                if name != HEADER_PART_NAME {
                    return Err(order_error("should be named \"header\""));
                }
            }
            _ if header.is_none() => {
                return Err(order_error("comes before the header"));
            }
            PartKind::Manifest => {
                let header = header.expect("checked above");
                if self.manifest_seen || self.n_file_parts > 0 || self.n_wal_parts > 0 {
                    return Err(order_error(
                        "is out of place: the manifest comes right after the header, once",
                    ));
                }
                let expected = Manifest::file_name(header.manifest_generation);
                if header.manifest_generation == 0 {
                    return Err(order_error("is there, but the header says there is none"));
                }
                if manifest::parse_manifest_file_name(&name).is_none() {
                    return Err(order_error("does not have a manifest file name"));
                }
                if name != expected {
                    return Err(order_error(&format!(
                        "should be {expected}, the generation the header names"
                    )));
                }
            }
            PartKind::Segment | PartKind::Tombstones => {
                let header = header.expect("checked above");
                let valid = match kind {
                    PartKind::Segment => manifest::parse_segment_file_name(&name).is_some(),
                    _ => manifest::parse_tombstone_file_name(&name).is_some(),
                };
                if !valid {
                    return Err(order_error(&format!(
                        "does not have a {} name",
                        kind.describe()
                    )));
                }
                if header.manifest_generation > 0 && !self.manifest_seen {
                    return Err(order_error("comes before the manifest"));
                }
                if self.n_wal_parts > 0 {
                    return Err(order_error("comes after the WAL entries"));
                }
                match self.expected_files.get_mut(&name) {
                    Some((expected_kind, seen)) if *expected_kind == kind && !*seen => {
                        *seen = true;
                    }
                    Some((_, true)) => return Err(order_error("repeats a file")),
                    _ => return Err(order_error("is not a file the manifest lists")),
                }
            }
            PartKind::WalEntries => {
                let header = header.expect("checked above");
                if name != WAL_PART_NAME {
                    return Err(order_error("should be named \"wal\""));
                }
                if self.n_wal_parts >= header.n_wal_parts {
                    return Err(order_error(&format!(
                        "is one more than the {} WAL parts the header declares",
                        header.n_wal_parts
                    )));
                }
                if header.manifest_generation > 0 && !self.manifest_seen {
                    return Err(order_error("comes before the manifest"));
                }
                if self.n_file_parts < header.n_file_parts {
                    return Err(order_error(&format!(
                        "comes after {} of the manifest's {} segment and tombstone files; \
                         missing: {}",
                        self.n_file_parts,
                        header.n_file_parts,
                        self.missing_files()
                    )));
                }
            }
        }
        let mut crc = Hasher::new();
        crc.update(&[self.kind_byte, name_bytes.len() as u8]);
        crc.update(name_bytes);
        self.n_parts = number;
        self.part = Some(Part {
            number,
            offset,
            kind,
            name,
            body_len: 0,
            body_read: 0,
            crc,
            buffer: Vec::new(),
        });
        self.stage = Stage::BodyLen;
        Ok(())
    }

    fn check_body_len(&self, body_len: u64) -> Result<()> {
        let part = self.part.as_ref().expect("a part is open");
        let max = match part.kind {
            PartKind::Header => MAX_HEADER_BODY,
            PartKind::Manifest => MAX_MANIFEST_BODY,
            PartKind::WalEntries => MAX_WAL_PART_BODY,
            PartKind::Segment | PartKind::Tombstones => u64::MAX,
        };
        // The body, its checksum and the end marker must fit in what the header declares.
        let room = self.declared_remaining().saturating_sub(4 + END_BYTES);
        if body_len == 0 || body_len > max || body_len > room {
            let limit = if room < max {
                format!("{room} bytes left of the {} the header declares", {
                    self.header.as_ref().map_or(0, |h| h.total_bytes)
                })
            } else {
                format!("at most {max}")
            };
            return Err(damaged(format!(
                "{} at byte {}: body length {body_len} is out of range (1 to {limit})",
                part.describe(),
                part.offset
            )));
        }
        Ok(())
    }

    /// A part's checksum matched: check its contents and hand them on.
    fn finish_part(&mut self, part: Part, sink: &mut dyn PartSink) -> Result<()> {
        let what = || format!("{} at byte {}", part.describe(), part.offset);
        match part.kind {
            PartKind::Header => {
                let header = SnapshotHeader::decode_body(&part.buffer)
                    .map_err(|reason| damaged(format!("{}: {reason}", what())))?;
                if header.total_bytes < self.position + END_BYTES {
                    return Err(damaged(format!(
                        "{}: the header declares a file of {} bytes, shorter than the {} \
                         read so far",
                        what(),
                        header.total_bytes,
                        self.position
                    )));
                }
                self.next_wal_seq = header.checkpoint_seq + 1;
                sink.header(&header)?;
                self.header = Some(header);
            }
            PartKind::Manifest => {
                let header = self.header.as_ref().expect("checked at the part's start");
                let manifest: Manifest = manifest::decode_checked(&part.buffer)
                    .map_err(|reason| damaged(format!("{}: {reason}", what())))?;
                if manifest.generation != header.manifest_generation
                    || manifest.checkpoint_seq != header.checkpoint_seq
                {
                    return Err(damaged(format!(
                        "{}: generation {} and checkpoint {} differ from the header's {} and {}",
                        what(),
                        manifest.generation,
                        manifest.checkpoint_seq,
                        header.manifest_generation,
                        header.checkpoint_seq
                    )));
                }
                let mut expected = HashMap::new();
                for entry in &manifest.segments {
                    if manifest::parse_segment_file_name(&entry.file) != Some(entry.id) {
                        return Err(damaged(format!(
                            "{}: segment {} is listed with the file name {:?}",
                            what(),
                            entry.id,
                            entry.file
                        )));
                    }
                    expected.insert(entry.file.clone(), (PartKind::Segment, false));
                    if let Some(tombstones) = &entry.tombstones {
                        match manifest::parse_tombstone_file_name(tombstones) {
                            Some((id, _)) if id == entry.id => {}
                            _ => {
                                return Err(damaged(format!(
                                    "{}: segment {} is listed with the tombstone file {:?}",
                                    what(),
                                    entry.id,
                                    tombstones
                                )))
                            }
                        }
                        expected.insert(tombstones.clone(), (PartKind::Tombstones, false));
                    }
                }
                if expected.len() != header.n_file_parts as usize {
                    return Err(damaged(format!(
                        "{}: it lists {} segment and tombstone files, the header {}",
                        what(),
                        expected.len(),
                        header.n_file_parts
                    )));
                }
                self.expected_files = expected;
                self.manifest_seen = true;
                sink.file_start(PartKind::Manifest, &part.name, part.body_len)?;
                sink.file_bytes(&part.buffer)?;
                sink.file_end()?;
            }
            PartKind::Segment | PartKind::Tombstones => {
                self.n_file_parts += 1;
                if part.kind == PartKind::Segment {
                    self.n_segments += 1;
                } else {
                    self.n_tombstone_files += 1;
                }
                sink.file_end()?;
            }
            PartKind::WalEntries => {
                self.n_wal_parts += 1;
                self.finish_wal_part(&part, sink)?;
            }
        }
        Ok(())
    }

    fn finish_wal_part(&mut self, part: &Part, sink: &mut dyn PartSink) -> Result<()> {
        let header = self.header.as_ref().expect("checked at the part's start");
        let (seq_no, dimension) = (header.seq_no, header.config.dimension);
        let what = || format!("{} at byte {}", part.describe(), part.offset);
        let mut body = &part.buffer[..];
        while !body.is_empty() {
            if (body.len() as u64) < WAL_RECORD_HEADER_BYTES {
                return Err(damaged(format!(
                    "{}: {} stray bytes after its last entry",
                    what(),
                    body.len()
                )));
            }
            let seq = u64::from_le_bytes(body[0..8].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes")) as u64;
            let expected = self.next_wal_seq;
            if seq != expected || seq > seq_no {
                return Err(damaged(format!(
                    "{}: WAL entry {seq} where {expected} was expected (the snapshot ends at \
                     {seq_no})",
                    what()
                )));
            }
            let rest = &body[WAL_RECORD_HEADER_BYTES as usize..];
            if len > MAX_WAL_PAYLOAD || len > rest.len() as u64 {
                return Err(damaged(format!(
                    "{}: WAL entry {seq} claims {len} bytes; {} are left in the part",
                    what(),
                    rest.len()
                )));
            }
            let (payload, rest) = rest.split_at(len as usize);
            if let Err(error) = op::decode(payload, dimension) {
                let reason = match error {
                    CollectionError::Corrupt(reason) => reason,
                    other => other.to_string(),
                };
                return Err(damaged(format!(
                    "{}: WAL entry {seq} is not a valid operation ({reason})",
                    what()
                )));
            }
            sink.wal_entry(seq, payload)?;
            self.next_wal_seq += 1;
            body = rest;
        }
        Ok(())
    }

    /// The end marker was reached: everything the header promised must have come.
    fn check_complete(&self) -> Result<()> {
        let at = self.position - 1;
        let Some(header) = &self.header else {
            return Err(damaged(format!(
                "the end marker at byte {at} comes before any header"
            )));
        };
        let missing = if header.manifest_generation > 0 && !self.manifest_seen {
            Some("the manifest is missing".to_owned())
        } else if self.n_file_parts < header.n_file_parts {
            Some(format!(
                "files the manifest lists are missing: {}",
                self.missing_files()
            ))
        } else if self.n_wal_parts != header.n_wal_parts || self.next_wal_seq != header.seq_no + 1 {
            Some(format!(
                "WAL entries from {} on are missing ({} of {} WAL parts present)",
                self.next_wal_seq, self.n_wal_parts, header.n_wal_parts
            ))
        } else {
            None
        };
        match missing {
            Some(what) => Err(damaged(format!("end marker at byte {at}, but {what}"))),
            None => Ok(()),
        }
    }

    /// The manifest's files not seen yet, sorted, comma-separated.
    fn missing_files(&self) -> String {
        let mut names: Vec<&str> = self
            .expected_files
            .iter()
            .filter(|(_, (_, seen))| !seen)
            .map(|(name, _)| name.as_str())
            .collect();
        names.sort_unstable();
        names.join(", ")
    }

    /// The file ended: it must have ended exactly after the end marker.
    pub(crate) fn finish(&self) -> Result<SnapshotInfo> {
        if self.failed {
            return Err(damaged("the snapshot was already refused"));
        }
        if self.stage != Stage::Done {
            let declared = match &self.header {
                Some(header) => format!(" of the {} the header declares", header.total_bytes),
                None => String::new(),
            };
            let inside = match (&self.part, self.stage) {
                (_, Stage::Magic | Stage::VersionAndCrc) => "inside the file header".to_owned(),
                (Some(part), _) => format!(
                    "inside {} (which starts at byte {}{})",
                    part.describe(),
                    part.offset,
                    if self.stage == Stage::Body {
                        format!(
                            ", {} of its body bytes missing",
                            part.body_len - part.body_read
                        )
                    } else {
                        String::new()
                    }
                ),
                (None, Stage::EndTotal | Stage::EndCrc) => "inside the end marker".to_owned(),
                (None, Stage::NameLen | Stage::Name(_)) => format!(
                    "inside the framing of part {} (which starts at byte {})",
                    self.n_parts + 1,
                    self.part_start
                ),
                (None, _) => match &self.last_part {
                    Some(last) => format!("after {last}, where a part or the end marker was due"),
                    None => "before the first part".to_owned(),
                },
            };
            return Err(damaged(format!(
                "truncated: the file ends after {} bytes{declared}, {inside}",
                self.position
            )));
        }
        let header = self
            .header
            .as_ref()
            .expect("a finished snapshot has a header");
        Ok(SnapshotInfo {
            format_version: self.version,
            seq_no: header.seq_no,
            checkpoint_seq: header.checkpoint_seq,
            config: header.config.clone(),
            n_bytes: self.position,
            n_segments: self.n_segments,
            n_tombstone_files: self.n_tombstone_files,
            n_wal_entries: header.n_wal_entries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_wal_payload_is_the_wals_own_limit() {
        assert_eq!(
            MAX_WAL_PAYLOAD,
            tarn_wal::WalConfig::default().max_entry_bytes as u64
        );
    }

    #[test]
    fn header_bodies_round_trip_and_inconsistent_ones_are_refused() {
        let header = SnapshotHeader {
            seq_no: 30,
            checkpoint_seq: 20,
            manifest_generation: 2,
            total_bytes: 1000,
            n_wal_entries: 10,
            n_file_parts: 3,
            n_wal_parts: 1,
            config: CollectionConfig::new(8, crate::config::MetricName::L2),
        };
        let body = header.encode_body();
        assert_eq!(body.len() as u64, SnapshotHeader::body_len(&header.config));
        assert_eq!(SnapshotHeader::decode_body(&body).unwrap(), header);
        for cut in 0..body.len() {
            assert!(SnapshotHeader::decode_body(&body[..cut]).is_err(), "{cut}");
        }
        let bad = |change: fn(&mut SnapshotHeader)| {
            let mut h = header.clone();
            change(&mut h);
            SnapshotHeader::decode_body(&h.encode_body()).unwrap_err()
        };
        assert!(bad(|h| h.checkpoint_seq = 31).contains("after"));
        assert!(bad(|h| h.n_wal_entries = 9).contains("WAL entries"));
        assert!(bad(|h| h.n_wal_parts = 0).contains("WAL parts"));
        assert!(bad(|h| h.n_wal_parts = 11).contains("WAL parts"));
        assert!(bad(|h| h.manifest_generation = 0).contains("no manifest"));
        assert!(bad(|h| h.config.dimension = 0).contains("config is invalid"));
    }
}
