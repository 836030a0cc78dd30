//! One logged operation = one WAL entry payload. Layout (little endian; `docs/WAL_FORMAT.md`):
//!
//! ```text
//! 0   1   operation: 1 = insert (upsert), 2 = remove
//! 1   1   format version (1)
//! 2   2   zero
//! 4   4   n_users (0 means the default tenant 0)
//! 8   4   n_docs
//! 12  4   dimension (insert) or 0 (remove)
//! 16  ..  n_users x u128 user ids, n_docs x u128 doc ids,
//!         then for inserts n_docs x dimension f32 (already normalised for cosine)
//! ```

use crate::error::{CollectionError, Result};

const OP_INSERT: u8 = 1;
const OP_REMOVE: u8 = 2;
const FORMAT_VERSION: u8 = 1;
const HEADER_BYTES: usize = 16;

/// A decoded operation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Operation {
    Insert {
        user_ids: Vec<u128>,
        doc_ids: Vec<u128>,
        dimension: usize,
        vectors: Vec<f32>,
    },
    Remove {
        user_ids: Vec<u128>,
        doc_ids: Vec<u128>,
    },
}

impl Operation {
    /// The tenants an operation applies to: the listed ones, or the default tenant 0.
    pub(crate) fn tenants(user_ids: &[u128]) -> &[u128] {
        if user_ids.is_empty() {
            &[0]
        } else {
            user_ids
        }
    }
}

fn header(op: u8, n_users: usize, n_docs: usize, dimension: usize, capacity: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(capacity);
    bytes.extend_from_slice(&[op, FORMAT_VERSION, 0, 0]);
    bytes.extend_from_slice(&(n_users as u32).to_le_bytes());
    bytes.extend_from_slice(&(n_docs as u32).to_le_bytes());
    bytes.extend_from_slice(&(dimension as u32).to_le_bytes());
    bytes
}

fn ids(bytes: &mut Vec<u8>, ids: &[u128]) {
    for id in ids {
        bytes.extend_from_slice(&id.to_le_bytes());
    }
}

pub(crate) fn encode_insert(
    user_ids: &[u128],
    doc_ids: &[u128],
    dimension: usize,
    vectors: &[f32],
) -> Vec<u8> {
    let size = HEADER_BYTES + (user_ids.len() + doc_ids.len()) * 16 + vectors.len() * 4;
    let mut bytes = header(OP_INSERT, user_ids.len(), doc_ids.len(), dimension, size);
    ids(&mut bytes, user_ids);
    ids(&mut bytes, doc_ids);
    for v in vectors {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    bytes
}

pub(crate) fn encode_remove(user_ids: &[u128], doc_ids: &[u128]) -> Vec<u8> {
    let size = HEADER_BYTES + (user_ids.len() + doc_ids.len()) * 16;
    let mut bytes = header(OP_REMOVE, user_ids.len(), doc_ids.len(), 0, size);
    ids(&mut bytes, user_ids);
    ids(&mut bytes, doc_ids);
    bytes
}

/// Decodes a payload of a collection of dimension `expected_dimension`; never panics on
/// malformed bytes.
pub(crate) fn decode(bytes: &[u8], expected_dimension: usize) -> Result<Operation> {
    let bad = |why: &str| CollectionError::Corrupt(format!("undecodable WAL operation: {why}"));
    if bytes.len() < HEADER_BYTES {
        return Err(bad("shorter than its header"));
    }
    if bytes[1] != FORMAT_VERSION {
        return Err(bad("unknown format version"));
    }
    let u32_at =
        |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes")) as usize;
    let (n_users, n_docs, dimension) = (u32_at(4), u32_at(8), u32_at(12));
    let n_ids = n_users
        .checked_add(n_docs)
        .ok_or_else(|| bad("id count overflows"))?;
    let ids_end = n_ids
        .checked_mul(16)
        .and_then(|n| n.checked_add(HEADER_BYTES))
        .ok_or_else(|| bad("id count overflows"))?;
    if ids_end > bytes.len() {
        return Err(bad("ids run past the end"));
    }
    let read_ids = |from: usize, n: usize| -> Vec<u128> {
        bytes[from..from + n * 16]
            .chunks_exact(16)
            .map(|c| u128::from_le_bytes(c.try_into().expect("16 bytes")))
            .collect()
    };
    let user_ids = read_ids(HEADER_BYTES, n_users);
    let doc_ids = read_ids(HEADER_BYTES + n_users * 16, n_docs);
    match bytes[0] {
        OP_INSERT => {
            if dimension != expected_dimension {
                return Err(bad("vector dimension differs from the collection's"));
            }
            let n_values = n_docs
                .checked_mul(dimension)
                .ok_or_else(|| bad("vector count overflows"))?;
            if n_values.checked_mul(4).and_then(|n| n.checked_add(ids_end)) != Some(bytes.len()) {
                return Err(bad("vector data does not match its counts"));
            }
            let vectors = bytes[ids_end..]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            Ok(Operation::Insert {
                user_ids,
                doc_ids,
                dimension,
                vectors,
            })
        }
        OP_REMOVE if ids_end == bytes.len() => Ok(Operation::Remove { user_ids, doc_ids }),
        OP_REMOVE => Err(bad("trailing bytes after a remove")),
        _ => Err(bad("unknown operation")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_malformed_bytes_are_errors() {
        let insert = encode_insert(&[1, 2], &[10, 11, 12], 2, &[0.5; 6]);
        assert!(decode(&insert, 3).is_err(), "wrong dimension");
        assert_eq!(
            decode(&insert, 2).unwrap(),
            Operation::Insert {
                user_ids: vec![1, 2],
                doc_ids: vec![10, 11, 12],
                dimension: 2,
                vectors: vec![0.5; 6]
            }
        );
        let remove = encode_remove(&[], &[5]);
        assert_eq!(
            decode(&remove, 2).unwrap(),
            Operation::Remove {
                user_ids: vec![],
                doc_ids: vec![5]
            }
        );
        for cut in 0..insert.len() {
            assert!(decode(&insert[..cut], 2).is_err(), "cut at {cut}");
        }
        let mut huge = remove.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&huge, 2).is_err());
        let mut unknown = remove;
        unknown[0] = 9;
        assert!(decode(&unknown, 2).is_err());
    }
}
