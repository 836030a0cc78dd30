//! Taking a snapshot of a live collection: [`Snapshot`], the bytes of a `.tsnap` file
//! (`docs/SNAPSHOT_FORMAT.md`) produced as they are read.
//!
//! A snapshot at sequence number S is the newest manifest's files (manifest, segment and
//! tombstone files: immutable once written) plus the WAL entries from the manifest's
//! `checkpoint_seq + 1` through S. Taking one pins those files and that WAL (`retention.rs`)
//! first, and only then asks the WAL for its durable sequence number with a sync barrier: the
//! pinned manifest was written after its checkpoint's operations were durable, so its
//! checkpoint (and any later removal its files copied, see `checkpoint.rs`) is at or before S, and
//! replaying the WAL tail over its files gives exactly the operations up to S, as recovery does.
//! Writes, searches, checkpoints and merges go on meanwhile; the pins go when the snapshot is
//! dropped.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read};
use std::path::PathBuf;

use crc32fast::Hasher;
use tarn_wal::{Replay, Wal};

use crate::collection::Shared;
use crate::error::{CollectionError, Result};
use crate::manifest::Manifest;
use crate::retention::RetentionPin;
use crate::snapshot_format::{
    encode_file_header, encode_part_prefix, encode_wal_record_header, part_len, PartKind,
    SnapshotHeader, END_BYTES, END_KIND, FILE_HEADER_BYTES, HEADER_PART_NAME, WAL_PART_NAME,
    WAL_PART_TARGET_BYTES, WAL_RECORD_HEADER_BYTES,
};

/// Bytes read from a file per step.
const FILE_CHUNK_BYTES: u64 = 256 << 10;

/// A snapshot of a collection, consistent at one sequence number, read as the bytes of a
/// `.tsnap` file ([`std::io::Read`]). While it lives, the collection's checkpoints keep the
/// files and the WAL it reads; dropping it (finished or not) releases them.
///
/// Reading is blocking file I/O: from async code, read it on a blocking thread. An error
/// while reading is an `io::Error` whose inner error is a [`CollectionError`]
/// (`io::Error::get_ref` and `downcast_ref`); the bytes produced before it are not a valid
/// snapshot. The pins hold against this [`crate::Collection`]'s own checkpoints: keep the
/// collection open while a snapshot of it is read.
#[derive(Debug)]
pub struct Snapshot {
    seq_no: u64,
    checkpoint_seq: u64,
    total_bytes: u64,
    /// What is left to produce, in order.
    pieces: VecDeque<Piece>,
    /// The part whose body is being produced.
    active: Option<ActivePart>,
    /// Reads the WAL entries of the WAL parts, in order.
    replay: Replay,
    /// Bytes produced and not yet read out.
    out: Vec<u8>,
    out_read: usize,
    /// CRC32 of every byte produced, for the end marker.
    file_crc: Hasher,
    n_produced: u64,
    /// Every byte was produced (the end marker included).
    produced_all: bool,
    failed: Option<String>,
    _pin: RetentionPin,
}

#[derive(Debug)]
enum Piece {
    /// Bytes ready to go (the file header and the header part).
    Bytes(Vec<u8>),
    File {
        kind: PartKind,
        name: String,
        path: PathBuf,
        file: File,
        len: u64,
    },
    Wal {
        first_seq: u64,
        last_seq: u64,
        body_len: u64,
    },
    End,
}

#[derive(Debug)]
enum ActivePart {
    File {
        path: PathBuf,
        file: File,
        remaining: u64,
        crc: Hasher,
    },
    Wal {
        next_seq: u64,
        last_seq: u64,
        remaining: u64,
        crc: Hasher,
    },
}

impl Snapshot {
    /// Pins the newest manifest and the WAL after it, then takes the WAL's durable sequence
    /// number with a sync barrier (see the module documentation for why in this order).
    pub(crate) fn take(shared: &Shared, wal: &Wal) -> Result<Snapshot> {
        let (manifest, pin) = shared.retention.pin_current();
        // The fields as of the pinned manifest or later (pinned first: its checkpoint is
        // applied) and none added after `seq_no` (read before the barrier that gives it).
        let config = shared.current_config();
        // A replicated copy's snapshot holds what it knows committed, no more (a replica or
        // moved copy made from it must not hold entries a failover may cut).
        let visible = shared
            .visible
            .load(std::sync::atomic::Ordering::Acquire)
            .max(*shared.applied.borrow());
        let seq_no = wal.sync().wait()?.min(visible);
        let checkpoint_seq = manifest.checkpoint_seq;
        if seq_no < checkpoint_seq {
            return Err(CollectionError::Corrupt(format!(
                "the WAL is durable up to {seq_no}, before the checkpoint at {checkpoint_seq}"
            )));
        }
        debug_assert_eq!(pin.wal_from(), checkpoint_seq + 1);

        let mut files: Vec<(PartKind, String)> = Vec::new();
        for entry in &manifest.segments {
            files.push((PartKind::Segment, entry.file.clone()));
            if let Some(tombstones) = &entry.tombstones {
                files.push((PartKind::Tombstones, tombstones.clone()));
            }
        }
        let n_file_parts = files.len() as u32;
        if manifest.generation > 0 {
            files.insert(
                0,
                (PartKind::Manifest, Manifest::file_name(manifest.generation)),
            );
        }
        let mut file_pieces = Vec::with_capacity(files.len());
        for (kind, name) in files {
            let path = shared.dir.join(&name);
            let file = File::open(&path)
                .map_err(|e| CollectionError::io("open for a snapshot", &path, e))?;
            let len = file
                .metadata()
                .map_err(|e| CollectionError::io("stat for a snapshot", &path, e))?
                .len();
            file_pieces.push(Piece::File {
                kind,
                name,
                path,
                file,
                len,
            });
        }

        // The WAL parts' (first_seq, last_seq, body_len), from a first pass over the entries:
        // each part's length comes before its body, and the file's total is in the header.
        let mut wal_parts: Vec<(u64, u64, u64)> = Vec::new();
        let mut body_len = 0u64;
        let mut first_seq = checkpoint_seq + 1;
        let mut last_seq = checkpoint_seq;
        // WAL read errors keep their own variant: `From<WalError>` would call an I/O error
        // `Unavailable` (for writes), which a read is not.
        for entry in wal
            .replay_range(checkpoint_seq + 1, seq_no)
            .map_err(CollectionError::Wal)?
        {
            let (seq, payload) = entry.map_err(CollectionError::Wal)?;
            let record_len = WAL_RECORD_HEADER_BYTES + payload.len() as u64;
            if body_len > 0 && body_len + record_len > WAL_PART_TARGET_BYTES {
                wal_parts.push((first_seq, last_seq, body_len));
                body_len = 0;
                first_seq = seq;
            }
            body_len += record_len;
            last_seq = seq;
        }
        if body_len > 0 {
            wal_parts.push((first_seq, last_seq, body_len));
        }
        if last_seq != seq_no {
            return Err(CollectionError::Corrupt(format!(
                "the WAL replay for a snapshot ended at {last_seq}, not at {seq_no}"
            )));
        }
        let replay = wal
            .replay_range(checkpoint_seq + 1, seq_no)
            .map_err(CollectionError::Wal)?;

        let header_body_len = SnapshotHeader::body_len(&config);
        let mut total_bytes =
            FILE_HEADER_BYTES + part_len(HEADER_PART_NAME, header_body_len) + END_BYTES;
        for piece in &file_pieces {
            if let Piece::File { name, len, .. } = piece {
                total_bytes += part_len(name, *len);
            }
        }
        for (_, _, body_len) in &wal_parts {
            total_bytes += part_len(WAL_PART_NAME, *body_len);
        }
        let header = SnapshotHeader {
            seq_no,
            checkpoint_seq,
            manifest_generation: manifest.generation,
            total_bytes,
            n_wal_entries: seq_no - checkpoint_seq,
            n_file_parts,
            n_wal_parts: wal_parts.len() as u32,
            config,
        };
        let header_body = header.encode_body();
        debug_assert_eq!(header_body.len() as u64, header_body_len);
        let mut first = encode_file_header().to_vec();
        let header_start = first.len();
        first.extend_from_slice(&encode_part_prefix(
            PartKind::Header,
            HEADER_PART_NAME,
            header_body.len() as u64,
        ));
        first.extend_from_slice(&header_body);
        let crc = crc32fast::hash(&first[header_start..]);
        first.extend_from_slice(&crc.to_le_bytes());

        let mut pieces = VecDeque::with_capacity(file_pieces.len() + wal_parts.len() + 2);
        pieces.push_back(Piece::Bytes(first));
        pieces.extend(file_pieces);
        pieces.extend(
            wal_parts
                .into_iter()
                .map(|(first_seq, last_seq, body_len)| Piece::Wal {
                    first_seq,
                    last_seq,
                    body_len,
                }),
        );
        pieces.push_back(Piece::End);
        tracing::info!(
            dir = %shared.dir.display(),
            seq_no,
            checkpoint_seq,
            total_bytes,
            "snapshot started"
        );
        Ok(Snapshot {
            seq_no,
            checkpoint_seq,
            total_bytes,
            pieces,
            active: None,
            replay,
            out: Vec::new(),
            out_read: 0,
            file_crc: Hasher::new(),
            n_produced: 0,
            produced_all: false,
            failed: None,
            _pin: pin,
        })
    }

    /// The sequence number the snapshot is consistent at: it holds exactly the operations up
    /// to it.
    /// Gives up the snapshot's reading state and keeps its pin (the WAL from its checkpoint on),
    /// for a reader of the entries after it ([`crate::WalTail`]).
    pub(crate) fn into_pin(self) -> RetentionPin {
        self._pin
    }

    pub fn seq_no(&self) -> u64 {
        self.seq_no
    }

    /// The checkpoint whose segment files the snapshot holds (WAL entries follow it).
    pub fn checkpoint_seq(&self) -> u64 {
        self.checkpoint_seq
    }

    /// The exact length of the file the snapshot produces.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Appends produced bytes to the output, counting them into the whole-file checksum.
    fn emit(&mut self, bytes: &[u8]) {
        self.file_crc.update(bytes);
        self.n_produced += bytes.len() as u64;
        self.out.extend_from_slice(bytes);
    }

    /// Produces the next bytes into `out`; returns false when everything was produced.
    fn produce(&mut self) -> Result<bool> {
        match self.active.take() {
            Some(ActivePart::File {
                path,
                mut file,
                remaining,
                mut crc,
            }) => {
                let n = remaining.min(FILE_CHUNK_BYTES) as usize;
                let mut chunk = vec![0u8; n];
                file.read_exact(&mut chunk)
                    .map_err(|e| CollectionError::io("read for a snapshot", &path, e))?;
                crc.update(&chunk);
                self.emit(&chunk);
                let remaining = remaining - n as u64;
                if remaining == 0 {
                    self.emit(&crc.finalize().to_le_bytes());
                } else {
                    self.active = Some(ActivePart::File {
                        path,
                        file,
                        remaining,
                        crc,
                    });
                }
            }
            Some(ActivePart::Wal {
                next_seq,
                last_seq,
                remaining,
                mut crc,
            }) => {
                let (seq, payload) = match self.replay.next() {
                    Some(entry) => entry.map_err(CollectionError::Wal)?,
                    None => {
                        return Err(CollectionError::Corrupt(format!(
                            "the WAL ended at entry {} while a snapshot read it",
                            next_seq - 1
                        )))
                    }
                };
                let record_len = WAL_RECORD_HEADER_BYTES + payload.len() as u64;
                if seq != next_seq || record_len > remaining {
                    return Err(CollectionError::Corrupt(format!(
                        "the WAL changed while a snapshot read it: entry {seq} ({} bytes) where \
                         {next_seq} ({remaining} bytes left in the part) was expected",
                        payload.len()
                    )));
                }
                let record_header = encode_wal_record_header(seq, payload.len() as u32);
                crc.update(&record_header);
                crc.update(&payload);
                self.emit(&record_header);
                self.emit(&payload);
                let remaining = remaining - record_len;
                if seq == last_seq {
                    if remaining != 0 {
                        return Err(CollectionError::Corrupt(format!(
                            "the WAL changed while a snapshot read it: entries up to {seq} are \
                             {remaining} bytes shorter than before"
                        )));
                    }
                    self.emit(&crc.finalize().to_le_bytes());
                } else {
                    self.active = Some(ActivePart::Wal {
                        next_seq: seq + 1,
                        last_seq,
                        remaining,
                        crc,
                    });
                }
            }
            None => match self.pieces.pop_front() {
                None => return Ok(false),
                Some(Piece::Bytes(bytes)) => self.emit(&bytes),
                Some(Piece::File {
                    kind,
                    name,
                    path,
                    file,
                    len,
                }) => {
                    let prefix = encode_part_prefix(kind, &name, len);
                    let mut crc = Hasher::new();
                    crc.update(&prefix);
                    self.emit(&prefix);
                    self.active = Some(ActivePart::File {
                        path,
                        file,
                        remaining: len,
                        crc,
                    });
                }
                Some(Piece::Wal {
                    first_seq,
                    last_seq,
                    body_len,
                }) => {
                    let prefix = encode_part_prefix(PartKind::WalEntries, WAL_PART_NAME, body_len);
                    let mut crc = Hasher::new();
                    crc.update(&prefix);
                    self.emit(&prefix);
                    self.active = Some(ActivePart::Wal {
                        next_seq: first_seq,
                        last_seq,
                        remaining: body_len,
                        crc,
                    });
                }
                Some(Piece::End) => {
                    let mut end = vec![END_KIND];
                    end.extend_from_slice(&self.total_bytes.to_le_bytes());
                    self.emit(&end);
                    let crc = self.file_crc.clone().finalize();
                    self.out.extend_from_slice(&crc.to_le_bytes());
                    self.n_produced += 4;
                    if self.n_produced != self.total_bytes {
                        return Err(CollectionError::Corrupt(format!(
                            "a snapshot came to {} bytes, not the {} its header declares",
                            self.n_produced, self.total_bytes
                        )));
                    }
                }
            },
        }
        Ok(true)
    }
}

impl Read for Snapshot {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(error) = &self.failed {
            return Err(io::Error::other(CollectionError::Corrupt(format!(
                "the snapshot already failed: {error}"
            ))));
        }
        // Produce until the caller's buffer can be filled (WAL records are produced one at a
        // time and may be small), dropping what was already read out first.
        if self.out.len() - self.out_read < buf.len() && self.out_read > 0 {
            self.out.drain(..self.out_read);
            self.out_read = 0;
        }
        while self.out.len() - self.out_read < buf.len() && !self.produced_all {
            match self.produce() {
                Ok(true) => {}
                Ok(false) => self.produced_all = true,
                Err(error) => {
                    tracing::error!(%error, seq_no = self.seq_no, "snapshot failed");
                    self.failed = Some(error.to_string());
                    return Err(io::Error::other(error));
                }
            }
        }
        let n = buf.len().min(self.out.len() - self.out_read);
        buf[..n].copy_from_slice(&self.out[self.out_read..self.out_read + n]);
        self.out_read += n;
        Ok(n)
    }
}
