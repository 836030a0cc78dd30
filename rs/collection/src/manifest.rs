//! Checkpoint manifests and the collection's config file: small JSON documents followed by a
//! CRC32 (little endian) of the JSON bytes, written durably (temp file, fsync, rename, dir fsync).
//!
//! `MANIFEST-<generation>` names the sealed segments (and their tombstone files) that, with the
//! WAL after `checkpoint_seq`, make up the collection. The newest valid manifest wins; the one
//! before it is kept (with its files and the WAL after its `checkpoint_seq`) as a fallback.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{CollectionError, Result};

pub(crate) const MANIFEST_PREFIX: &str = "MANIFEST-";
pub(crate) const CONFIG_FILE: &str = "collection.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) format: u32,
    pub(crate) generation: u64,
    /// Every operation up to this sequence number is in the segments below.
    pub(crate) checkpoint_seq: u64,
    pub(crate) next_segment_id: u64,
    /// Newest first.
    pub(crate) segments: Vec<SegmentEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SegmentEntry {
    pub(crate) id: u64,
    pub(crate) file: String,
    /// Tombstones set after sealing, as of `checkpoint_seq`.
    pub(crate) tombstones: Option<String>,
}

impl Manifest {
    pub(crate) fn empty() -> Self {
        Manifest {
            format: 1,
            generation: 0,
            checkpoint_seq: 0,
            next_segment_id: 1,
            segments: Vec::new(),
        }
    }

    pub(crate) fn file_name(generation: u64) -> String {
        format!("{MANIFEST_PREFIX}{generation:020}")
    }

    /// Files this manifest needs.
    pub(crate) fn files(&self) -> impl Iterator<Item = &str> {
        self.segments
            .iter()
            .flat_map(|s| std::iter::once(s.file.as_str()).chain(s.tombstones.as_deref()))
    }
}

pub(crate) fn segment_file_name(id: u64) -> String {
    format!("seg-{id:012}.tseg")
}

pub(crate) fn tombstone_file_name(id: u64, generation: u64) -> String {
    format!("seg-{id:012}-{generation:020}.tomb")
}

/// The segment id of a `.tseg` file name, if `name` is exactly one (`seg-<12 digits>.tseg`).
pub(crate) fn parse_segment_file_name(name: &str) -> Option<u64> {
    let id = parse_digits(name.strip_prefix("seg-")?.strip_suffix(".tseg")?, 12)?;
    (segment_file_name(id) == name).then_some(id)
}

/// The segment id and generation of a `.tomb` file name, if `name` is exactly one
/// (`seg-<12 digits>-<20 digits>.tomb`).
pub(crate) fn parse_tombstone_file_name(name: &str) -> Option<(u64, u64)> {
    let (id, generation) = name
        .strip_prefix("seg-")?
        .strip_suffix(".tomb")?
        .split_once('-')?;
    let (id, generation) = (parse_digits(id, 12)?, parse_digits(generation, 20)?);
    (tombstone_file_name(id, generation) == name).then_some((id, generation))
}

/// The generation of a manifest file name, if `name` is exactly one (`MANIFEST-<20 digits>`).
pub(crate) fn parse_manifest_file_name(name: &str) -> Option<u64> {
    let generation = parse_digits(name.strip_prefix(MANIFEST_PREFIX)?, 20)?;
    (Manifest::file_name(generation) == name).then_some(generation)
}

fn parse_digits(digits: &str, n_digits: usize) -> Option<u64> {
    if digits.len() != n_digits || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Manifest generations present in `dir`, newest first.
pub(crate) fn list_manifests(dir: &Path) -> Result<Vec<u64>> {
    let mut generations = Vec::new();
    for entry in
        std::fs::read_dir(dir).map_err(|e| CollectionError::io("list directory", dir, e))?
    {
        let entry = entry.map_err(|e| CollectionError::io("list directory", dir, e))?;
        let name = entry.file_name();
        let Some(generation) = name.to_str().and_then(|n| n.strip_prefix(MANIFEST_PREFIX)) else {
            continue;
        };
        if let Ok(generation) = generation.parse::<u64>() {
            generations.push(generation);
        }
    }
    generations.sort_unstable_by(|a, b| b.cmp(a));
    Ok(generations)
}

pub(crate) fn encode_checked<T: Serialize>(value: &T) -> Vec<u8> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("manifest types always serialise");
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    bytes
}

pub(crate) fn read_checked<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes = std::fs::read(path).map_err(|e| CollectionError::io("read", path, e))?;
    decode_checked(&bytes)
        .map_err(|reason| CollectionError::Corrupt(format!("{}: {reason}", path.display())))
}

pub(crate) fn decode_checked<T: DeserializeOwned>(bytes: &[u8]) -> std::result::Result<T, String> {
    if bytes.len() < 4 {
        return Err("shorter than its checksum".into());
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err("checksum mismatch".into());
    }
    serde_json::from_slice(body).map_err(|e| format!("unreadable: {e}"))
}

pub(crate) fn write_checked<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    tarn_index::fsutil::write_durably(path, &encode_checked(value))
        .map_err(|e| CollectionError::io("write", path, e))
}

pub(crate) fn manifest_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(Manifest::file_name(generation))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_round_trip_and_strangers_are_refused() {
        assert_eq!(parse_segment_file_name(&segment_file_name(7)), Some(7));
        assert_eq!(
            parse_tombstone_file_name(&tombstone_file_name(7, 12)),
            Some((7, 12))
        );
        assert_eq!(parse_manifest_file_name(&Manifest::file_name(3)), Some(3));
        for stranger in [
            "",
            "seg-7.tseg",
            "seg-000000000007.tseg.tmp",
            "../seg-000000000007.tseg",
            "seg-00000000000+.tseg",
            "seg-000000000007-00000000000000000012.tseg",
            "seg-000000000007.tomb",
            "MANIFEST-3",
            "MANIFEST-0000000000000000000/",
            "collection.json",
        ] {
            assert_eq!(parse_segment_file_name(stranger), None, "{stranger}");
            assert_eq!(parse_tombstone_file_name(stranger), None, "{stranger}");
            assert_eq!(parse_manifest_file_name(stranger), None, "{stranger}");
        }
    }
}
