//! One logged operation = one WAL entry payload. Layout (little endian; `docs/WAL_FORMAT.md`):
//!
//! ```text
//! 0   1   operation: 1 = insert (upsert), 2 = remove, 3 = add fields
//! 1   1   format version: 1; 2 for an insert whose documents carry attributes
//! 2   2   zero
//! insert and remove:
//! 4   4   n_users (0 means the default tenant 0)
//! 8   4   n_docs
//! 12  4   dimension (insert) or 0 (remove)
//! 16  ..  n_users x u128 user ids, n_docs x u128 doc ids,
//!         then for inserts n_docs x dimension f32 (already normalised for cosine),
//!         then for an insert of version 2 n_docs attribute encodings, back to back
//!         (`Attributes::encode_into`; one per document, the same for every listed tenant)
//! add fields (version 1):
//! 4   ..  the added fields as a schema encoding (`Schema::encode`)
//! ```
//!
//! An insert without attributes is written in version 1, so logs that never use attributes
//! stay readable by a tarn that predates them.

use tarn_index::{Attributes, FieldSpec, Schema};

use crate::error::{CollectionError, Result};

const OP_INSERT: u8 = 1;
const OP_REMOVE: u8 = 2;
const OP_ADD_FIELDS: u8 = 3;
const FORMAT_VERSION: u8 = 1;
/// Inserts whose documents carry attributes.
const FORMAT_VERSION_ATTRIBUTES: u8 = 2;
const HEADER_BYTES: usize = 16;
const ADD_FIELDS_HEADER_BYTES: usize = 4;

/// A decoded operation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Operation {
    Insert {
        user_ids: Vec<u128>,
        doc_ids: Vec<u128>,
        dimension: usize,
        vectors: Vec<f32>,
        /// Empty, or one per document (for every listed tenant).
        attributes: Vec<Attributes>,
    },
    Remove {
        user_ids: Vec<u128>,
        doc_ids: Vec<u128>,
    },
    /// Fields appended to the collection's schema.
    AddFields { fields: Vec<FieldSpec> },
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

fn header(
    op: u8,
    version: u8,
    n_users: usize,
    n_docs: usize,
    dimension: usize,
    capacity: usize,
) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(capacity);
    bytes.extend_from_slice(&[op, version, 0, 0]);
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

/// An insert; `attributes` is empty (version 1) or holds one per document (version 2).
pub(crate) fn encode_insert(
    user_ids: &[u128],
    doc_ids: &[u128],
    dimension: usize,
    vectors: &[f32],
    attributes: &[Attributes],
) -> Vec<u8> {
    debug_assert!(attributes.is_empty() || attributes.len() == doc_ids.len());
    let version = if attributes.is_empty() {
        FORMAT_VERSION
    } else {
        FORMAT_VERSION_ATTRIBUTES
    };
    let size = HEADER_BYTES + (user_ids.len() + doc_ids.len()) * 16 + vectors.len() * 4;
    let mut bytes = header(
        OP_INSERT,
        version,
        user_ids.len(),
        doc_ids.len(),
        dimension,
        size,
    );
    ids(&mut bytes, user_ids);
    ids(&mut bytes, doc_ids);
    for v in vectors {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    for document in attributes {
        document.encode_into(&mut bytes);
    }
    bytes
}

pub(crate) fn encode_remove(user_ids: &[u128], doc_ids: &[u128]) -> Vec<u8> {
    let size = HEADER_BYTES + (user_ids.len() + doc_ids.len()) * 16;
    let mut bytes = header(
        OP_REMOVE,
        FORMAT_VERSION,
        user_ids.len(),
        doc_ids.len(),
        0,
        size,
    );
    ids(&mut bytes, user_ids);
    ids(&mut bytes, doc_ids);
    bytes
}

/// Fields appended to the schema (`added` is a schema of the new fields only).
pub(crate) fn encode_add_fields(added: &Schema) -> Vec<u8> {
    let mut bytes = vec![OP_ADD_FIELDS, FORMAT_VERSION, 0, 0];
    bytes.extend_from_slice(&added.encode());
    bytes
}

/// Decodes a payload of a collection of dimension `expected_dimension`; never panics on
/// malformed bytes.
pub(crate) fn decode(bytes: &[u8], expected_dimension: usize) -> Result<Operation> {
    let bad = |why: &str| CollectionError::Corrupt(format!("undecodable WAL operation: {why}"));
    if bytes.len() < ADD_FIELDS_HEADER_BYTES {
        return Err(bad("shorter than its header"));
    }
    let (op, version) = (bytes[0], bytes[1]);
    match (op, version) {
        (OP_INSERT, FORMAT_VERSION | FORMAT_VERSION_ATTRIBUTES)
        | (OP_REMOVE | OP_ADD_FIELDS, FORMAT_VERSION) => {}
        (OP_INSERT | OP_REMOVE | OP_ADD_FIELDS, _) => return Err(bad("unknown format version")),
        _ => return Err(bad("unknown operation")),
    }
    if op == OP_ADD_FIELDS {
        let added = Schema::decode(&bytes[ADD_FIELDS_HEADER_BYTES..])
            .map_err(|e| bad(&format!("added fields: {e}")))?;
        return Ok(Operation::AddFields {
            fields: added.fields().to_vec(),
        });
    }
    if bytes.len() < HEADER_BYTES {
        return Err(bad("shorter than its header"));
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
    if op == OP_REMOVE {
        if ids_end != bytes.len() {
            return Err(bad("trailing bytes after a remove"));
        }
        return Ok(Operation::Remove { user_ids, doc_ids });
    }
    if dimension != expected_dimension {
        return Err(bad("vector dimension differs from the collection's"));
    }
    let vectors_end = n_docs
        .checked_mul(dimension)
        .and_then(|n| n.checked_mul(4))
        .and_then(|n| n.checked_add(ids_end))
        .ok_or_else(|| bad("vector count overflows"))?;
    let vectors_fit = if version == FORMAT_VERSION {
        vectors_end == bytes.len()
    } else {
        vectors_end <= bytes.len()
    };
    if !vectors_fit {
        return Err(bad("vector data does not match its counts"));
    }
    let vectors = bytes[ids_end..vectors_end]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let mut attributes = Vec::new();
    if version == FORMAT_VERSION_ATTRIBUTES {
        // n_docs is bounded by the ids read above, so this allocation is too.
        attributes.reserve(n_docs);
        let mut offset = vectors_end;
        for doc_idx in 0..n_docs {
            let (document, n_bytes) = Attributes::decode_prefix(&bytes[offset..])
                .map_err(|e| bad(&format!("attributes of document {doc_idx}: {e}")))?;
            attributes.push(document);
            offset += n_bytes;
        }
        if offset != bytes.len() {
            return Err(bad("trailing bytes after the attributes"));
        }
    }
    Ok(Operation::Insert {
        user_ids,
        doc_ids,
        dimension,
        vectors,
        attributes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tarn_index::{FieldType, Value};

    #[test]
    fn round_trips_and_malformed_bytes_are_errors() {
        let insert = encode_insert(&[1, 2], &[10, 11, 12], 2, &[0.5; 6], &[]);
        assert_eq!(insert[1], 1, "no attributes: version 1");
        assert!(decode(&insert, 3).is_err(), "wrong dimension");
        assert_eq!(
            decode(&insert, 2).unwrap(),
            Operation::Insert {
                user_ids: vec![1, 2],
                doc_ids: vec![10, 11, 12],
                dimension: 2,
                vectors: vec![0.5; 6],
                attributes: vec![],
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

    /// Version 1 bytes written by hand, as tarn wrote them before attributes existed.
    #[test]
    fn version_1_entries_written_before_attributes_still_decode() {
        let mut insert = vec![1u8, 1, 0, 0];
        insert.extend_from_slice(&1u32.to_le_bytes()); // n_users
        insert.extend_from_slice(&2u32.to_le_bytes()); // n_docs
        insert.extend_from_slice(&1u32.to_le_bytes()); // dimension
        insert.extend_from_slice(&7u128.to_le_bytes());
        insert.extend_from_slice(&100u128.to_le_bytes());
        insert.extend_from_slice(&101u128.to_le_bytes());
        insert.extend_from_slice(&0.25f32.to_le_bytes());
        insert.extend_from_slice(&(-1.5f32).to_le_bytes());
        assert_eq!(
            decode(&insert, 1).unwrap(),
            Operation::Insert {
                user_ids: vec![7],
                doc_ids: vec![100, 101],
                dimension: 1,
                vectors: vec![0.25, -1.5],
                attributes: vec![],
            }
        );
        let mut remove = vec![2u8, 1, 0, 0];
        remove.extend_from_slice(&0u32.to_le_bytes());
        remove.extend_from_slice(&1u32.to_le_bytes());
        remove.extend_from_slice(&0u32.to_le_bytes());
        remove.extend_from_slice(&100u128.to_le_bytes());
        assert_eq!(
            decode(&remove, 1).unwrap(),
            Operation::Remove {
                user_ids: vec![],
                doc_ids: vec![100]
            }
        );
        // A version 1 insert with bytes after its vectors is damaged, not attributes.
        let mut trailing = insert.clone();
        trailing.extend_from_slice(&[1, 0]);
        assert!(decode(&trailing, 1).is_err());
    }

    fn attributes(section: &str, size: f64) -> Attributes {
        let mut attributes = Attributes::new();
        attributes.insert("section", Value::Keyword(section.to_string()));
        attributes.insert("size", Value::Number(size));
        attributes
    }

    #[test]
    fn inserts_with_attributes_and_added_fields_round_trip_and_damage_is_refused() {
        let documents = vec![attributes("python", 1.0), Attributes::new()];
        let insert = encode_insert(&[3], &[10, 11], 2, &[0.5; 4], &documents);
        assert_eq!(insert[1], 2);
        let decoded = decode(&insert, 2).unwrap();
        assert_eq!(
            decoded,
            Operation::Insert {
                user_ids: vec![3],
                doc_ids: vec![10, 11],
                dimension: 2,
                vectors: vec![0.5; 4],
                attributes: documents,
            }
        );
        for cut in 0..insert.len() {
            assert!(decode(&insert[..cut], 2).is_err(), "cut at {cut}");
        }
        let mut trailing = insert.clone();
        trailing.push(0);
        assert!(decode(&trailing, 2).is_err());

        let added = Schema::new(vec![
            FieldSpec::new("section", FieldType::Keyword),
            FieldSpec::new("tags", FieldType::Keywords),
        ])
        .unwrap();
        let add = encode_add_fields(&added);
        assert_eq!(
            decode(&add, 2).unwrap(),
            Operation::AddFields {
                fields: added.fields().to_vec()
            }
        );
        for cut in 0..add.len() {
            assert!(decode(&add[..cut], 2).is_err(), "cut at {cut}");
        }
        let mut bad_version = add.clone();
        bad_version[1] = 2;
        assert!(decode(&bad_version, 2).is_err());
        let mut remove_v2 = encode_remove(&[], &[1]);
        remove_v2[1] = 2;
        assert!(decode(&remove_v2, 2).is_err());
    }
}
