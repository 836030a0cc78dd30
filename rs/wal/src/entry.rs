//! Byte layout of one log entry (see `docs/WAL_FORMAT.md`).
//!
//! ```text
//! offset  size  field
//! 0       4     payload length in bytes (u32, little endian)
//! 4       4     CRC32 (crc32fast / IEEE) over bytes 8.. of the header and the payload
//! 8       8     sequence number (u64, little endian)
//! 16      len   payload (opaque bytes)
//! ```

/// Size of the fixed entry header.
pub const ENTRY_HEADER_BYTES: usize = 16;

/// Encodes the header of the entry `seq` carrying `payload`.
pub(crate) fn encode_header(seq: u64, payload: &[u8]) -> [u8; ENTRY_HEADER_BYTES] {
    let len = u32::try_from(payload.len()).expect("payload length is bounded by max_entry_bytes");
    let mut header = [0u8; ENTRY_HEADER_BYTES];
    header[0..4].copy_from_slice(&len.to_le_bytes());
    header[4..8].copy_from_slice(&entry_crc(seq, payload).to_le_bytes());
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    header
}

/// The checksum stored in an entry: CRC32 over the sequence number and the payload.
pub(crate) fn entry_crc(seq: u64, payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq.to_le_bytes());
    hasher.update(payload);
    hasher.finalize()
}

/// The fields of a header, not yet checked against anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EntryHeader {
    pub(crate) payload_len: u32,
    pub(crate) crc: u32,
    pub(crate) seq: u64,
}

pub(crate) fn decode_header(bytes: &[u8; ENTRY_HEADER_BYTES]) -> EntryHeader {
    let u32_at =
        |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let mut seq = [0u8; 8];
    seq.copy_from_slice(&bytes[8..16]);
    EntryHeader {
        payload_len: u32_at(0),
        crc: u32_at(4),
        seq: u64::from_le_bytes(seq),
    }
}

/// Why the bytes at an offset are not the expected entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryDefect {
    /// Fewer than a header's worth of bytes remain.
    ShortHeader,
    /// The header is all zeros: preallocated space that was never written.
    Zeroed,
    /// The length runs past the end of the file or over the configured maximum.
    BadLength,
    /// The sequence number is not the next one expected.
    WrongSequence,
    /// The payload is shorter than the header says.
    ShortPayload,
    /// The checksum does not match.
    BadChecksum,
}

impl EntryDefect {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            EntryDefect::ShortHeader => "entry header cut short",
            EntryDefect::Zeroed => "zeroed space where an entry was expected",
            EntryDefect::BadLength => "entry length out of range",
            EntryDefect::WrongSequence => "unexpected sequence number",
            EntryDefect::ShortPayload => "entry payload cut short",
            EntryDefect::BadChecksum => "entry checksum mismatch",
        }
    }
}

/// Checks whether `bytes[offset..]` starts with a valid entry whose sequence number satisfies
/// `seq_ok`. On success returns the header and the total entry size (header + payload).
pub(crate) fn check_entry_at(
    bytes: &[u8],
    offset: usize,
    max_entry_bytes: usize,
    seq_ok: impl Fn(u64) -> bool,
) -> Result<(EntryHeader, usize), EntryDefect> {
    let Some(header_bytes) = bytes.get(offset..offset + ENTRY_HEADER_BYTES) else {
        return Err(EntryDefect::ShortHeader);
    };
    let header_bytes: &[u8; ENTRY_HEADER_BYTES] =
        header_bytes.try_into().expect("slice has header length");
    if header_bytes.iter().all(|&b| b == 0) {
        return Err(EntryDefect::Zeroed);
    }
    let header = decode_header(header_bytes);
    if !seq_ok(header.seq) {
        return Err(EntryDefect::WrongSequence);
    }
    let payload_len = header.payload_len as usize;
    if payload_len > max_entry_bytes {
        return Err(EntryDefect::BadLength);
    }
    let payload_start = offset + ENTRY_HEADER_BYTES;
    let Some(payload) = bytes.get(payload_start..payload_start + payload_len) else {
        return Err(EntryDefect::ShortPayload);
    };
    if entry_crc(header.seq, payload) != header.crc {
        return Err(EntryDefect::BadChecksum);
    }
    Ok((header, ENTRY_HEADER_BYTES + payload_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(seq: u64, payload: &[u8]) -> Vec<u8> {
        let mut bytes = encode_header(seq, payload).to_vec();
        bytes.extend_from_slice(payload);
        bytes
    }

    #[test]
    fn round_trip_and_every_defect() {
        let bytes = encode(7, b"hello");
        let (header, size) = check_entry_at(&bytes, 0, 1 << 20, |s| s == 7).unwrap();
        assert_eq!((header.seq, header.payload_len, size), (7, 5, 21));

        assert_eq!(
            check_entry_at(&bytes, 0, 1 << 20, |s| s == 8),
            Err(EntryDefect::WrongSequence)
        );
        assert_eq!(
            check_entry_at(&bytes, 0, 4, |_| true),
            Err(EntryDefect::BadLength)
        );
        assert_eq!(
            check_entry_at(&bytes[..20], 0, 1 << 20, |_| true),
            Err(EntryDefect::ShortPayload)
        );
        assert_eq!(
            check_entry_at(&bytes[..15], 0, 1 << 20, |_| true),
            Err(EntryDefect::ShortHeader)
        );
        assert_eq!(
            check_entry_at(&[0u8; 32], 0, 1 << 20, |_| true),
            Err(EntryDefect::Zeroed)
        );
        for bit in 0..(bytes.len() * 8) {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(
                check_entry_at(&damaged, 0, 1 << 20, |s| s == 7).is_err(),
                "bit {bit}"
            );
        }
    }
}
