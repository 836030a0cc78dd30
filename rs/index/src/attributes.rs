//! Typed document attributes: the field types a collection declares ([`Schema`] of
//! [`FieldSpec`]s), the values one document carries ([`Attributes`] of [`Value`]s), their
//! validation against the schema with user-facing errors ([`AttributeError`]), and the compact
//! byte encodings of one document's attributes (for WAL entries) and of a schema (for manifests
//! and sealed segments).
//!
//! Encodings are little endian; lengths and counts are LEB128 varints of at most 5 bytes (u32).
//!
//! ```text
//! attributes: u8 version (1), varint n_fields, then per field in increasing byte order of names:
//!             varint name_len, name (UTF-8), u8 kind, value:
//!               kind 1 keyword:  varint len, UTF-8 bytes
//!               kind 2 keywords: varint n_values, then n_values x (varint len, UTF-8 bytes)
//!               kind 3 number:   8 bytes, f64 bits
//!               kind 4 bool:     u8 0 (false) or 1 (true)
//!               kind 5 text:     varint len, UTF-8 bytes (version 2 only)
//!             version 2 (written only when a document has a text value or a payload) then
//!             ends with u8 0 (no payload) or 1 and the payload (varint len, UTF-8 JSON text)
//! schema:     u8 version (1 or 2), varint n_fields, then per field in declaration order:
//!             varint name_len, name, u8 field type (1 KEYWORD, 2 KEYWORDS, 3 NUMBER, 4 BOOL,
//!             5 TEXT); version 2 (written only when a TEXT field's analyzer is not the
//!             default) follows a TEXT field's type with u8 analyzer flags (bit 0 English
//!             stemmer, bit 1 English stop words)
//! ```
//!
//! TEXT values and the payload are *stored* values: kept with the document and returned on
//! request, never indexed for filters (a TEXT field is full-text indexed: `fulltext.rs`). A partition keeps them apart from its indexed columns
//! (`stored.rs`: by slot, in memory in the mutable segment, in the segment file once sealed).
//!
//! Decoding never panics: every length and count is checked against the bytes left before
//! anything is allocated, names must be strictly increasing (one canonical encoding per
//! document) and trailing bytes are refused. Decoding attributes checks structure only; the
//! schema's limits are checked by [`Schema::validate`] when the attributes arrive, before they are
//! logged.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::fulltext::TextAnalyzer;

/// Invalid attributes, schemas or filters, and malformed attribute bytes.
///
/// Every variant about user input names the field and the problem in a sentence a user can act
/// on (the server returns it as INVALID_ARGUMENT). [`AttributeError::Malformed`] is damage to
/// stored bytes, never user input: callers report it as corruption.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AttributeError {
    /// A field name that is empty, too long, or uses characters outside `[A-Za-z0-9_.-]`.
    #[error("schema: field name {field:?} {problem}")]
    InvalidFieldName {
        field: String,
        problem: &'static str,
    },
    /// A schema that declares a name twice, or adds a field that already exists.
    #[error("schema: field {field:?} is declared more than once")]
    DuplicateField { field: String },
    /// A schema with more than [`Schema::MAX_FIELDS`] fields.
    #[error("schema: {count} fields declared, at most {limit} allowed")]
    TooManySchemaFields { count: usize, limit: usize },
    /// A schema that does not extend the one it should (fields are only ever appended).
    #[error("schema: {problem}")]
    SchemaMismatch { problem: String },
    /// A document or filter naming a field the schema does not declare.
    #[error("{context}: field {field:?} is not declared")]
    UndeclaredField {
        context: &'static str,
        field: String,
    },
    /// A document value whose type is not the field's declared type.
    #[error("attributes: field {field:?} is declared {declared} but got {got}")]
    WrongType {
        field: String,
        declared: FieldType,
        got: &'static str,
    },
    /// A document number that is NaN or infinite.
    #[error("attributes: field {field:?} has a NaN or infinite number")]
    NotFinite { field: String },
    /// A document keyword longer than [`Value::MAX_KEYWORD_BYTES`].
    #[error("attributes: field {field:?} has a keyword of {bytes} bytes, at most {limit} allowed")]
    KeywordTooLong {
        field: String,
        bytes: usize,
        limit: usize,
    },
    /// A document keyword list longer than [`Value::MAX_KEYWORDS`].
    #[error("attributes: field {field:?} has {count} keywords, at most {limit} allowed")]
    TooManyValues {
        field: String,
        count: usize,
        limit: usize,
    },
    /// A document text or payload longer than [`Value::MAX_TEXT_BYTES`].
    #[error("attributes: {what} has {bytes} bytes, at most {limit} allowed")]
    TooLong {
        what: String,
        bytes: usize,
        limit: usize,
    },
    /// A filter on a TEXT field (text is stored and searched by full-text queries, not filtered).
    #[error("filter: field {field:?} is a TEXT field, which filters cannot use")]
    FilterOnText { field: String },
    /// A document with more than [`Attributes::MAX_FIELDS`] fields.
    #[error("attributes: a document has {count} fields, at most {limit} allowed")]
    TooManyDocumentFields { count: usize, limit: usize },
    /// A filter nested deeper than [`Filter::MAX_DEPTH`](crate::Filter::MAX_DEPTH).
    #[error("filter: nested deeper than {limit} levels")]
    FilterTooDeep { limit: usize },
    /// A filter with more than [`Filter::MAX_NODES`](crate::Filter::MAX_NODES) nodes.
    #[error("filter: more than {limit} nodes")]
    FilterTooLarge { limit: usize },
    /// A Match that does not fit its field's type or the limits.
    #[error("filter: Match on field {field:?} {problem}")]
    InvalidMatch { field: String, problem: String },
    /// A Range that does not fit its field's type, has no bound, or conflicting or bad bounds.
    #[error("filter: Range on field {field:?} {problem}")]
    InvalidRange { field: String, problem: String },
    /// A slot pushed into an attribute index out of order (a caller bug, not user input).
    #[error("attribute index: slot {slot} pushed after {n_slots} slots")]
    SlotOutOfOrder { slot: u32, n_slots: u32 },
    /// Stored attribute, schema or filter bytes that do not decode.
    #[error("malformed attribute data: {0}")]
    Malformed(String),
}

/// A field name as error messages show it: verbatim up to 80 bytes, then cut (an undeclared name
/// can be arbitrarily long and ends up in a gRPC status header).
pub fn shown(name: &str) -> String {
    const SHOWN_BYTES: usize = 80;
    if name.len() <= SHOWN_BYTES {
        return name.to_string();
    }
    let mut end = SHOWN_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &name[..end])
}

/// The type of a declared field. The codes are the wire's `FieldType` numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FieldType {
    /// One string per document.
    Keyword,
    /// A list of strings per document (for example tags).
    Keywords,
    /// One f64 per document; integers are exact up to 2^53.
    Number,
    /// One boolean per document.
    Bool,
    /// A UTF-8 text per document, stored and returned on request (not filterable).
    Text,
}

impl FieldType {
    /// The name users see: `KEYWORD`, `KEYWORDS`, `NUMBER` or `BOOL`.
    pub fn as_str(self) -> &'static str {
        match self {
            FieldType::Keyword => "KEYWORD",
            FieldType::Keywords => "KEYWORDS",
            FieldType::Number => "NUMBER",
            FieldType::Bool => "BOOL",
            FieldType::Text => "TEXT",
        }
    }

    /// The wire code (1 to 5; 0 is the wire's unspecified value and has no field type).
    pub fn code(self) -> u8 {
        match self {
            FieldType::Keyword => 1,
            FieldType::Keywords => 2,
            FieldType::Number => 3,
            FieldType::Bool => 4,
            FieldType::Text => 5,
        }
    }

    /// True for the types kept in a partition's indexed columns (filters use them); TEXT is a
    /// stored value.
    pub fn is_indexed(self) -> bool {
        self != FieldType::Text
    }

    /// The field type of a wire code, or None for 0 and unknown codes.
    pub fn from_code(code: u8) -> Option<FieldType> {
        match code {
            1 => Some(FieldType::Keyword),
            2 => Some(FieldType::Keywords),
            3 => Some(FieldType::Number),
            4 => Some(FieldType::Bool),
            5 => Some(FieldType::Text),
            _ => None,
        }
    }
}

impl fmt::Display for FieldType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One declared field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldSpec {
    pub name: String,
    pub field_type: FieldType,
    /// How a TEXT field's values become terms (the default for every other type).
    pub analyzer: TextAnalyzer,
}

impl FieldSpec {
    /// The longest field name, in bytes.
    pub const MAX_NAME_BYTES: usize = 64;

    pub fn new(name: impl Into<String>, field_type: FieldType) -> FieldSpec {
        FieldSpec {
            name: name.into(),
            field_type,
            analyzer: TextAnalyzer::default(),
        }
    }

    /// A TEXT field analysed by `analyzer`.
    pub fn text(name: impl Into<String>, analyzer: TextAnalyzer) -> FieldSpec {
        FieldSpec {
            analyzer,
            ..FieldSpec::new(name, FieldType::Text)
        }
    }

    /// Checks the name: 1 to 64 bytes of `[A-Za-z0-9_.-]`.
    fn validate_name(name: &str) -> Result<(), AttributeError> {
        let problem = if name.is_empty() {
            "is empty"
        } else if name.len() > FieldSpec::MAX_NAME_BYTES {
            "is longer than 64 bytes"
        } else if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        {
            "may only contain A-Z, a-z, 0-9, '_', '.' and '-'"
        } else {
            return Ok(());
        };
        Err(AttributeError::InvalidFieldName {
            field: shown(name),
            problem,
        })
    }
}

/// The fields a collection declares, in declaration order. A field's index (its position, a
/// `u16`) never changes: fields are only ever appended ([`Schema::with_added`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schema {
    fields: Vec<FieldSpec>,
    index_by_name: HashMap<String, u16>,
}

impl Schema {
    /// The most fields one collection can declare.
    pub const MAX_FIELDS: usize = 256;

    const ENCODING_VERSION: u8 = 1;
    /// Adds each TEXT field's analyzer.
    const ENCODING_VERSION_ANALYZERS: u8 = 2;

    /// A schema of these fields, refusing invalid names, duplicates and more than 256 fields.
    pub fn new(fields: Vec<FieldSpec>) -> Result<Schema, AttributeError> {
        if fields.len() > Schema::MAX_FIELDS {
            return Err(AttributeError::TooManySchemaFields {
                count: fields.len(),
                limit: Schema::MAX_FIELDS,
            });
        }
        let mut index_by_name = HashMap::with_capacity(fields.len());
        for (field_idx, spec) in fields.iter().enumerate() {
            FieldSpec::validate_name(&spec.name)?;
            if spec.field_type != FieldType::Text && !spec.analyzer.is_default() {
                return Err(AttributeError::SchemaMismatch {
                    problem: format!(
                        "field {:?} is a {} field: only a TEXT field has an analyzer",
                        spec.name, spec.field_type
                    ),
                });
            }
            // At most 256 fields, so the index fits a u16.
            let field_idx = field_idx as u16;
            if index_by_name.insert(spec.name.clone(), field_idx).is_some() {
                return Err(AttributeError::DuplicateField {
                    field: spec.name.clone(),
                });
            }
        }
        Ok(Schema {
            fields,
            index_by_name,
        })
    }

    /// This schema with `added` appended, refusing names that already exist (or repeat).
    pub fn with_added(&self, added: Vec<FieldSpec>) -> Result<Schema, AttributeError> {
        let mut fields = self.fields.clone();
        fields.extend(added);
        Schema::new(fields)
    }

    /// The declared fields, in declaration order.
    pub fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    pub fn len(&self) -> usize {
        self.fields.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// The field of this name, if declared.
    pub fn field(&self, name: &str) -> Option<&FieldSpec> {
        self.field_index(name)
            .map(|field_idx| &self.fields[field_idx as usize])
    }

    /// The declaration index of the field of this name, if declared.
    pub fn field_index(&self, name: &str) -> Option<u16> {
        self.index_by_name.get(name).copied()
    }

    /// The declared type of the field of this name, if declared.
    pub fn field_type(&self, name: &str) -> Option<FieldType> {
        self.field(name).map(|spec| spec.field_type)
    }

    /// True if this schema begins with every field of `older`, in the same order and with the
    /// same types (that is, `older` grew into this one by [`Schema::with_added`]).
    pub fn starts_with(&self, older: &Schema) -> bool {
        self.fields.starts_with(&older.fields)
    }

    /// Checks one document's attributes: every field declared, every value of its field's type,
    /// numbers finite, keywords at most 256 bytes, at most 1,024 keywords per list and at most
    /// 64 fields. The first problem found is returned.
    pub fn validate(&self, attributes: &Attributes) -> Result<(), AttributeError> {
        if attributes.len() > Attributes::MAX_FIELDS {
            return Err(AttributeError::TooManyDocumentFields {
                count: attributes.len(),
                limit: Attributes::MAX_FIELDS,
            });
        }
        for (name, value) in attributes.iter() {
            let Some(declared) = self.field_type(name) else {
                return Err(AttributeError::UndeclaredField {
                    context: "attributes",
                    field: shown(name),
                });
            };
            if value.field_type() != declared {
                return Err(AttributeError::WrongType {
                    field: name.to_string(),
                    declared,
                    got: value.kind_name(),
                });
            }
            match value {
                Value::Keyword(keyword) => check_document_keyword(name, keyword)?,
                Value::Keywords(keywords) => {
                    if keywords.len() > Value::MAX_KEYWORDS {
                        return Err(AttributeError::TooManyValues {
                            field: name.to_string(),
                            count: keywords.len(),
                            limit: Value::MAX_KEYWORDS,
                        });
                    }
                    for keyword in keywords {
                        check_document_keyword(name, keyword)?;
                    }
                }
                Value::Number(number) => {
                    if !number.is_finite() {
                        return Err(AttributeError::NotFinite {
                            field: name.to_string(),
                        });
                    }
                }
                Value::Bool(_) => {}
                Value::Text(text) => check_length(&format!("text field {name:?}"), text)?,
            }
        }
        if let Some(payload) = attributes.payload() {
            check_length("the payload", payload)?;
        }
        Ok(())
    }

    /// The schema's bytes (layout in the module documentation).
    pub fn encode(&self) -> Vec<u8> {
        let with_analyzers = self.fields.iter().any(|spec| !spec.analyzer.is_default());
        let version = match with_analyzers {
            true => Schema::ENCODING_VERSION_ANALYZERS,
            false => Schema::ENCODING_VERSION,
        };
        let mut out = vec![version];
        put_varint(&mut out, self.fields.len() as u32);
        for spec in &self.fields {
            put_string(&mut out, &spec.name);
            out.push(spec.field_type.code());
            if with_analyzers && spec.field_type == FieldType::Text {
                out.push(spec.analyzer.flags());
            }
        }
        out
    }

    /// Decodes [`Schema::encode`]'s bytes, refusing trailing bytes and anything
    /// [`Schema::new`] refuses.
    pub fn decode(bytes: &[u8]) -> Result<Schema, AttributeError> {
        let mut reader = CompactReader::new(bytes);
        let version = reader.u8("schema version")?;
        if version != Schema::ENCODING_VERSION && version != Schema::ENCODING_VERSION_ANALYZERS {
            return Err(malformed(format!("unknown schema version {version}")));
        }
        // Each field takes at least 2 bytes (an empty name's length and a type).
        let n_fields = reader.count(2, "schema field count")?;
        let mut fields = Vec::with_capacity(n_fields);
        for _ in 0..n_fields {
            let name = reader.string("schema field name")?;
            let code = reader.u8("schema field type")?;
            let field_type = FieldType::from_code(code)
                .ok_or_else(|| malformed(format!("unknown field type {code}")))?;
            let mut analyzer = TextAnalyzer::default();
            if version == Schema::ENCODING_VERSION_ANALYZERS && field_type == FieldType::Text {
                let flags = reader.u8("schema text analyzer")?;
                analyzer = TextAnalyzer::from_flags(flags)
                    .ok_or_else(|| malformed(format!("unknown text analyzer flags {flags:#x}")))?;
            }
            fields.push(FieldSpec {
                name,
                field_type,
                analyzer,
            });
        }
        reader.finish("schema")?;
        Schema::new(fields)
    }
}

fn check_length(what: &str, text: &str) -> Result<(), AttributeError> {
    if text.len() > Value::MAX_TEXT_BYTES {
        return Err(AttributeError::TooLong {
            what: what.to_string(),
            bytes: text.len(),
            limit: Value::MAX_TEXT_BYTES,
        });
    }
    Ok(())
}

fn check_document_keyword(field: &str, keyword: &str) -> Result<(), AttributeError> {
    if keyword.len() > Value::MAX_KEYWORD_BYTES {
        return Err(AttributeError::KeywordTooLong {
            field: field.to_string(),
            bytes: keyword.len(),
            limit: Value::MAX_KEYWORD_BYTES,
        });
    }
    Ok(())
}

/// One field's value in one document.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Keyword(String),
    /// A list of keywords, kept as given (order and repeats); an empty list is a value, so
    /// `Exists` is true for it while no `Match` is.
    Keywords(Vec<String>),
    Number(f64),
    Bool(bool),
    /// A TEXT field's value (stored, not indexed).
    Text(String),
}

impl Value {
    /// The longest text value, and the longest payload, in bytes.
    pub const MAX_TEXT_BYTES: usize = 1 << 20;

    /// The longest keyword, in bytes (in documents and in a filter's `any_of`).
    pub const MAX_KEYWORD_BYTES: usize = 256;
    /// The most keywords in one KEYWORDS value.
    pub const MAX_KEYWORDS: usize = 1024;

    /// The field type this value belongs to.
    pub fn field_type(&self) -> FieldType {
        match self {
            Value::Keyword(_) => FieldType::Keyword,
            Value::Keywords(_) => FieldType::Keywords,
            Value::Number(_) => FieldType::Number,
            Value::Bool(_) => FieldType::Bool,
            Value::Text(_) => FieldType::Text,
        }
    }

    /// What the value is, for error messages ("a keyword").
    pub fn kind_name(&self) -> &'static str {
        match self {
            Value::Keyword(_) => "a keyword",
            Value::Keywords(_) => "a keyword list",
            Value::Number(_) => "a number",
            Value::Bool(_) => "a boolean",
            Value::Text(_) => "a text",
        }
    }
}

/// One document's attributes: field name to value, at most one value per field, in name order,
/// and the document's payload (a JSON text, stored and returned on request, never indexed).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attributes {
    values: BTreeMap<String, Value>,
    payload: Option<String>,
}

impl Attributes {
    /// The most fields one document can carry.
    pub const MAX_FIELDS: usize = 64;

    const ENCODING_VERSION: u8 = 1;
    /// Documents with a text value or a payload.
    const ENCODING_VERSION_STORED: u8 = 2;
    const KIND_KEYWORD: u8 = 1;
    const KIND_KEYWORDS: u8 = 2;
    const KIND_NUMBER: u8 = 3;
    const KIND_BOOL: u8 = 4;
    const KIND_TEXT: u8 = 5;

    pub fn new() -> Attributes {
        Attributes::default()
    }

    /// Sets a field's value, returning the value it replaces.
    pub fn insert(&mut self, field: impl Into<String>, value: Value) -> Option<Value> {
        self.values.insert(field.into(), value)
    }

    /// The value of a field, if the document has one.
    pub fn get(&self, field: &str) -> Option<&Value> {
        self.values.get(field)
    }

    /// The fields and values, in increasing byte order of names.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.values
            .iter()
            .map(|(name, value)| (name.as_str(), value))
    }

    /// The number of fields with a value (the payload is not a field).
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// True when the document has no field value and no payload.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty() && self.payload.is_none()
    }

    /// The document's payload (a JSON text), if it has one.
    pub fn payload(&self) -> Option<&str> {
        self.payload.as_deref()
    }

    /// Sets (or with `None` clears) the document's payload; the caller checks it is JSON.
    pub fn set_payload(&mut self, payload: Option<String>) {
        self.payload = payload;
    }

    /// True when the document has a stored value: a TEXT value or a payload.
    pub fn has_stored(&self) -> bool {
        self.payload.is_some() || self.values.values().any(|v| matches!(v, Value::Text(_)))
    }

    /// The document split into what an attribute index keeps in its columns (every value but
    /// TEXT ones) and its stored values (TEXT values and the payload).
    pub fn split_stored(&self) -> (Attributes, Attributes) {
        let mut indexed = Attributes::new();
        let mut stored = Attributes {
            values: BTreeMap::new(),
            payload: self.payload.clone(),
        };
        for (name, value) in &self.values {
            let side = match value {
                Value::Text(_) => &mut stored,
                _ => &mut indexed,
            };
            side.values.insert(name.clone(), value.clone());
        }
        (indexed, stored)
    }

    /// Adds `other`'s values (and its payload, if it has one) to this document's.
    pub fn merge(&mut self, other: Attributes) {
        self.values.extend(other.values);
        if other.payload.is_some() {
            self.payload = other.payload;
        }
    }

    /// Keeps only the fields `keep` accepts, and the payload only with `keep_payload`.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool, keep_payload: bool) {
        self.values.retain(|name, _| keep(name));
        if !keep_payload {
            self.payload = None;
        }
    }

    /// The document's bytes (layout in the module documentation).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    /// Appends the document's bytes to `out` (several documents can follow each other; read
    /// them back with [`Attributes::decode_prefix`]).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let stored = self.has_stored();
        out.push(if stored {
            Attributes::ENCODING_VERSION_STORED
        } else {
            Attributes::ENCODING_VERSION
        });
        put_varint(out, self.values.len() as u32);
        for (name, value) in &self.values {
            put_string(out, name);
            match value {
                Value::Keyword(keyword) => {
                    out.push(Attributes::KIND_KEYWORD);
                    put_string(out, keyword);
                }
                Value::Keywords(keywords) => {
                    out.push(Attributes::KIND_KEYWORDS);
                    put_varint(out, keywords.len() as u32);
                    for keyword in keywords {
                        put_string(out, keyword);
                    }
                }
                Value::Number(number) => {
                    out.push(Attributes::KIND_NUMBER);
                    out.extend_from_slice(&number.to_bits().to_le_bytes());
                }
                Value::Bool(boolean) => {
                    out.push(Attributes::KIND_BOOL);
                    out.push(u8::from(*boolean));
                }
                Value::Text(text) => {
                    out.push(Attributes::KIND_TEXT);
                    put_string(out, text);
                }
            }
        }
        if stored {
            match &self.payload {
                Some(payload) => {
                    out.push(1);
                    put_string(out, payload);
                }
                None => out.push(0),
            }
        }
    }

    /// Decodes exactly one document's bytes, refusing trailing bytes.
    pub fn decode(bytes: &[u8]) -> Result<Attributes, AttributeError> {
        let mut reader = CompactReader::new(bytes);
        let attributes = Attributes::read(&mut reader)?;
        reader.finish("attributes")?;
        Ok(attributes)
    }

    /// Decodes the document at the start of `bytes`; returns it and the number of bytes it took.
    pub fn decode_prefix(bytes: &[u8]) -> Result<(Attributes, usize), AttributeError> {
        let mut reader = CompactReader::new(bytes);
        let attributes = Attributes::read(&mut reader)?;
        Ok((attributes, reader.offset()))
    }

    fn read(reader: &mut CompactReader<'_>) -> Result<Attributes, AttributeError> {
        let version = reader.u8("attributes version")?;
        if version != Attributes::ENCODING_VERSION && version != Attributes::ENCODING_VERSION_STORED
        {
            return Err(malformed(format!("unknown attributes version {version}")));
        }
        // Each field takes at least 3 bytes: name length, kind, and a value of 1 byte or more.
        let n_fields = reader.count(3, "attribute field count")?;
        let mut values = BTreeMap::new();
        let mut previous_name: Option<String> = None;
        for _ in 0..n_fields {
            let name = reader.string("attribute field name")?;
            if previous_name
                .as_ref()
                .is_some_and(|previous| *previous >= name)
            {
                return Err(malformed(
                    "attribute field names are not in increasing order".to_string(),
                ));
            }
            let kind = reader.u8("attribute value kind")?;
            let value = match kind {
                Attributes::KIND_KEYWORD => Value::Keyword(reader.string("keyword")?),
                Attributes::KIND_KEYWORDS => {
                    let n_keywords = reader.count(1, "keyword count")?;
                    let mut keywords = Vec::with_capacity(n_keywords);
                    for _ in 0..n_keywords {
                        keywords.push(reader.string("keyword")?);
                    }
                    Value::Keywords(keywords)
                }
                Attributes::KIND_NUMBER => Value::Number(reader.f64("number")?),
                Attributes::KIND_BOOL => match reader.u8("boolean")? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    other => return Err(malformed(format!("boolean byte {other}"))),
                },
                Attributes::KIND_TEXT if version == Attributes::ENCODING_VERSION_STORED => {
                    Value::Text(reader.string("text")?)
                }
                other => return Err(malformed(format!("unknown attribute value kind {other}"))),
            };
            values.insert(name.clone(), value);
            previous_name = Some(name);
        }
        let payload = match version {
            Attributes::ENCODING_VERSION_STORED => match reader.u8("payload flag")? {
                0 => None,
                1 => Some(reader.string("payload")?),
                other => return Err(malformed(format!("payload flag {other}"))),
            },
            _ => None,
        };
        Ok(Attributes { values, payload })
    }
}

impl FromIterator<(String, Value)> for Attributes {
    /// Collects fields and values; a repeated field keeps its last value.
    fn from_iter<I: IntoIterator<Item = (String, Value)>>(iter: I) -> Attributes {
        Attributes {
            values: iter.into_iter().collect(),
            payload: None,
        }
    }
}

pub(crate) fn malformed(reason: String) -> AttributeError {
    AttributeError::Malformed(reason)
}

/// Appends a LEB128 varint.
pub(crate) fn put_varint(out: &mut Vec<u8>, mut value: u32) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Appends a string as a varint length and its UTF-8 bytes.
pub(crate) fn put_string(out: &mut Vec<u8>, text: &str) {
    put_varint(out, text.len() as u32);
    out.extend_from_slice(text.as_bytes());
}

/// A bounds-checked reader of the compact encodings (varints, strings, f64s). Every read that
/// runs past the end is an [`AttributeError::Malformed`], never a panic.
#[derive(Debug)]
pub(crate) struct CompactReader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> CompactReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> CompactReader<'a> {
        CompactReader { bytes, offset: 0 }
    }

    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.offset
    }

    pub(crate) fn take(&mut self, n_bytes: usize, what: &str) -> Result<&'a [u8], AttributeError> {
        if n_bytes > self.remaining() {
            return Err(malformed(format!(
                "{what}: needs {n_bytes} bytes at offset {}, {} left",
                self.offset,
                self.remaining()
            )));
        }
        let slice = &self.bytes[self.offset..self.offset + n_bytes];
        self.offset += n_bytes;
        Ok(slice)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, AttributeError> {
        Ok(self.take(1, what)?[0])
    }

    pub(crate) fn f64(&mut self, what: &str) -> Result<f64, AttributeError> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8, what)?);
        Ok(f64::from_bits(u64::from_le_bytes(raw)))
    }

    /// A LEB128 varint of at most 5 bytes that fits a u32.
    pub(crate) fn varint(&mut self, what: &str) -> Result<u32, AttributeError> {
        let mut value: u32 = 0;
        for byte_idx in 0..5 {
            let byte = self.u8(what)?;
            if byte_idx == 4 && byte > 0x0f {
                return Err(malformed(format!("{what}: varint overflows 32 bits")));
            }
            value |= u32::from(byte & 0x7f) << (7 * byte_idx);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(malformed(format!("{what}: varint longer than 5 bytes")))
    }

    /// A count of items that take at least `min_item_bytes` each, refused if the bytes left
    /// cannot hold that many (so callers can allocate for it).
    pub(crate) fn count(
        &mut self,
        min_item_bytes: usize,
        what: &str,
    ) -> Result<usize, AttributeError> {
        let count = self.varint(what)? as usize;
        if count.saturating_mul(min_item_bytes) > self.remaining() {
            return Err(malformed(format!(
                "{what}: {count} items cannot fit in the {} bytes left",
                self.remaining()
            )));
        }
        Ok(count)
    }

    /// A varint length and that many bytes of UTF-8.
    pub(crate) fn string(&mut self, what: &str) -> Result<String, AttributeError> {
        let n_bytes = self.varint(what)? as usize;
        let raw = self.take(n_bytes, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| malformed(format!("{what}: not UTF-8")))
    }

    /// Refuses bytes left over after a complete value.
    pub(crate) fn finish(&self, what: &str) -> Result<(), AttributeError> {
        if self.remaining() != 0 {
            return Err(malformed(format!(
                "{what}: {} trailing bytes",
                self.remaining()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::Filter;
    use rand::{Rng, SeedableRng};

    fn keyword(text: &str) -> Value {
        Value::Keyword(text.to_string())
    }

    fn keywords(texts: &[&str]) -> Value {
        Value::Keywords(texts.iter().map(|text| text.to_string()).collect())
    }

    fn example_schema() -> Schema {
        Schema::new(vec![
            FieldSpec::new("section", FieldType::Keyword),
            FieldSpec::new("tags", FieldType::Keywords),
            FieldSpec::new("size", FieldType::Number),
            FieldSpec::new("essential", FieldType::Bool),
        ])
        .unwrap()
    }

    #[test]
    fn text_values_and_payloads_encode_validate_and_split() {
        let schema = example_schema()
            .with_added(vec![FieldSpec::new("body", FieldType::Text)])
            .unwrap();
        let mut document = example_attributes();
        // Without a text or a payload, the encoding stays version 1 (older readers read it).
        assert_eq!(document.encode()[0], 1);
        document.insert("body", Value::Text("Grüße, world".to_string()));
        document.set_payload(Some(r#"{"url": "https://example.org"}"#.to_string()));
        schema.validate(&document).unwrap();
        let bytes = document.encode();
        assert_eq!(bytes[0], 2);
        assert_eq!(Attributes::decode(&bytes).unwrap(), document);
        for len in 0..bytes.len() {
            assert!(Attributes::decode(&bytes[..len]).is_err());
        }
        // A payload alone is a stored value too.
        let mut payload_only = Attributes::new();
        payload_only.set_payload(Some("null".to_string()));
        assert!(!payload_only.is_empty() && payload_only.has_stored());
        assert_eq!(
            Attributes::decode(&payload_only.encode()).unwrap(),
            payload_only
        );

        let (indexed, stored) = document.split_stored();
        assert_eq!(indexed, example_attributes());
        assert_eq!(stored.len(), 1);
        assert_eq!(stored.payload(), document.payload());
        let mut joined = indexed.clone();
        joined.merge(stored);
        assert_eq!(joined, document);

        // Wrong types both ways, and the length limits, each naming what is wrong.
        let mut wrong = Attributes::new();
        wrong.insert("body", keyword("not text"));
        assert_eq!(
            schema.validate(&wrong).unwrap_err().to_string(),
            "attributes: field \"body\" is declared TEXT but got a keyword"
        );
        let mut wrong = Attributes::new();
        wrong.insert("section", Value::Text("text".to_string()));
        assert_eq!(
            schema.validate(&wrong).unwrap_err().to_string(),
            "attributes: field \"section\" is declared KEYWORD but got a text"
        );
        let mut long = Attributes::new();
        long.insert("body", Value::Text("x".repeat(Value::MAX_TEXT_BYTES + 1)));
        assert_eq!(
            schema.validate(&long).unwrap_err().to_string(),
            "attributes: text field \"body\" has 1048577 bytes, at most 1048576 allowed"
        );
        let mut long = Attributes::new();
        long.set_payload(Some("1".repeat(Value::MAX_TEXT_BYTES + 1)));
        assert_eq!(
            schema.validate(&long).unwrap_err().to_string(),
            "attributes: the payload has 1048577 bytes, at most 1048576 allowed"
        );
        // Filters cannot use a TEXT field.
        let error = Filter::Exists("body".to_string())
            .validate(&schema)
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "filter: field \"body\" is a TEXT field, which filters cannot use"
        );
    }

    fn example_attributes() -> Attributes {
        let mut attributes = Attributes::new();
        attributes.insert("section", keyword("python"));
        attributes.insert(
            "tags",
            keywords(&["role::program", "", "role::program", "é"]),
        );
        attributes.insert("size", Value::Number(-0.0));
        attributes.insert("essential", Value::Bool(true));
        attributes
    }

    #[test]
    fn schema_refuses_bad_names_duplicates_and_too_many_fields() {
        let bad_names = [
            ("", "is empty"),
            (&*"a".repeat(65), "longer than 64 bytes"),
            ("has space", "may only contain"),
            ("ü", "may only contain"),
        ];
        for (name, problem) in bad_names {
            let error = Schema::new(vec![FieldSpec::new(name, FieldType::Bool)]).unwrap_err();
            let message = error.to_string();
            assert!(message.contains(problem), "{message}");
            assert!(message.starts_with("schema: field name"), "{message}");
        }
        assert!(Schema::new(vec![FieldSpec::new("a".repeat(64), FieldType::Bool)]).is_ok());
        assert!(Schema::new(vec![FieldSpec::new("A-z_0.9", FieldType::Bool)]).is_ok());

        let error = Schema::new(vec![
            FieldSpec::new("size", FieldType::Number),
            FieldSpec::new("size", FieldType::Keyword),
        ])
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "schema: field \"size\" is declared more than once"
        );

        let fields = |n: usize| {
            (0..n)
                .map(|i| FieldSpec::new(format!("f{i}"), FieldType::Number))
                .collect::<Vec<_>>()
        };
        assert_eq!(Schema::new(fields(256)).unwrap().len(), 256);
        let error = Schema::new(fields(257)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "schema: 257 fields declared, at most 256 allowed"
        );
    }

    #[test]
    fn with_added_refuses_existing_names_and_keeps_indexes() {
        let schema = example_schema();
        let grown = schema
            .with_added(vec![FieldSpec::new("arch", FieldType::Keyword)])
            .unwrap();
        assert!(grown.starts_with(&schema));
        assert!(!schema.starts_with(&grown));
        assert_eq!(grown.field_index("section"), Some(0));
        assert_eq!(grown.field_index("essential"), Some(3));
        assert_eq!(grown.field_index("arch"), Some(4));
        assert_eq!(grown.field_type("arch"), Some(FieldType::Keyword));
        assert_eq!(grown.field("nope"), None);

        let error = schema
            .with_added(vec![FieldSpec::new("tags", FieldType::Keyword)])
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "schema: field \"tags\" is declared more than once"
        );
    }

    #[test]
    fn validate_refuses_every_limit_with_the_field_named() {
        let schema = example_schema();
        assert_eq!(schema.validate(&example_attributes()), Ok(()));
        assert_eq!(schema.validate(&Attributes::new()), Ok(()));

        let one = |field: &str, value: Value| {
            let mut attributes = Attributes::new();
            attributes.insert(field, value);
            schema.validate(&attributes).unwrap_err().to_string()
        };
        assert_eq!(
            one("colour", keyword("red")),
            "attributes: field \"colour\" is not declared"
        );
        assert_eq!(
            one("size", keyword("big")),
            "attributes: field \"size\" is declared NUMBER but got a keyword"
        );
        assert_eq!(
            one("tags", keyword("one")),
            "attributes: field \"tags\" is declared KEYWORDS but got a keyword"
        );
        assert_eq!(
            one("section", Value::Bool(true)),
            "attributes: field \"section\" is declared KEYWORD but got a boolean"
        );
        assert_eq!(
            one("essential", Value::Number(1.0)),
            "attributes: field \"essential\" is declared BOOL but got a number"
        );
        assert_eq!(
            one("section", keywords(&["a"])),
            "attributes: field \"section\" is declared KEYWORD but got a keyword list"
        );
        for number in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                one("size", Value::Number(number)),
                "attributes: field \"size\" has a NaN or infinite number"
            );
        }
        assert_eq!(
            one("section", keyword(&"x".repeat(257))),
            "attributes: field \"section\" has a keyword of 257 bytes, at most 256 allowed"
        );
        assert_eq!(
            one("tags", keywords(&["ok", &"x".repeat(300)])),
            "attributes: field \"tags\" has a keyword of 300 bytes, at most 256 allowed"
        );
        let mut ok = Attributes::new();
        ok.insert("section", keyword(&"x".repeat(256)));
        ok.insert("tags", Value::Keywords(vec!["t".to_string(); 1024]));
        assert_eq!(schema.validate(&ok), Ok(()));
        assert_eq!(
            one("tags", Value::Keywords(vec!["t".to_string(); 1025])),
            "attributes: field \"tags\" has 1025 keywords, at most 1024 allowed"
        );

        let wide_schema = Schema::new(
            (0..100)
                .map(|i| FieldSpec::new(format!("f{i}"), FieldType::Bool))
                .collect(),
        )
        .unwrap();
        let wide = |n: usize| -> Attributes {
            (0..n)
                .map(|i| (format!("f{i}"), Value::Bool(true)))
                .collect()
        };
        assert_eq!(wide_schema.validate(&wide(64)), Ok(()));
        assert_eq!(
            wide_schema.validate(&wide(65)).unwrap_err().to_string(),
            "attributes: a document has 65 fields, at most 64 allowed"
        );

        // A hostile undeclared name is cut in the message.
        let message = one(&"n".repeat(10_000), Value::Bool(true));
        assert!(message.len() < 200, "{message}");
    }

    #[test]
    fn attributes_round_trip_through_bytes() {
        for attributes in [Attributes::new(), example_attributes()] {
            let bytes = attributes.encode();
            assert_eq!(Attributes::decode(&bytes).unwrap(), attributes);
        }
        // A number keeps its exact bits, and 2^53 stays exact.
        let mut exact = Attributes::new();
        exact.insert("size", Value::Number(9_007_199_254_740_993.0));
        exact.insert("tags", Value::Keywords(Vec::new()));
        let back = Attributes::decode(&exact.encode()).unwrap();
        assert_eq!(back, exact);
        // Long strings need multi-byte varints.
        let mut long = Attributes::new();
        long.insert("k", keyword(&"z".repeat(300)));
        assert_eq!(Attributes::decode(&long.encode()).unwrap(), long);
    }

    #[test]
    fn decode_prefix_reads_consecutive_documents() {
        let documents = [
            example_attributes(),
            Attributes::new(),
            example_attributes(),
        ];
        let mut bytes = Vec::new();
        for document in &documents {
            document.encode_into(&mut bytes);
        }
        let mut offset = 0;
        for document in &documents {
            let (decoded, n_bytes) = Attributes::decode_prefix(&bytes[offset..]).unwrap();
            assert_eq!(&decoded, document);
            offset += n_bytes;
        }
        assert_eq!(offset, bytes.len());
        assert!(Attributes::decode(&bytes).is_err(), "trailing bytes");
    }

    #[test]
    fn schema_round_trips_through_bytes() {
        for schema in [Schema::default(), example_schema()] {
            assert_eq!(Schema::decode(&schema.encode()).unwrap(), schema);
        }
    }

    #[test]
    fn refuses_unordered_names_and_bad_varints() {
        // Two fields "b" then "a": not in increasing order.
        let bytes = [1, 2, 1, b'b', 4, 1, 1, b'a', 4, 0];
        assert!(Attributes::decode(&bytes).is_err());
        // A repeated name.
        let bytes = [1, 2, 1, b'a', 4, 1, 1, b'a', 4, 0];
        assert!(Attributes::decode(&bytes).is_err());
        // Varints: too long, and overflowing 32 bits.
        let mut reader = CompactReader::new(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x01]);
        assert!(reader.varint("x").is_err());
        let mut reader = CompactReader::new(&[0xff, 0xff, 0xff, 0xff, 0x1f]);
        assert!(reader.varint("x").is_err());
        let mut reader = CompactReader::new(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert_eq!(reader.varint("x").unwrap(), u32::MAX);
    }

    #[test]
    fn damaged_attribute_and_schema_bytes_are_errors_never_panics() {
        let attribute_bytes = example_attributes().encode();
        let schema_bytes = example_schema().encode();
        for end in 0..attribute_bytes.len() {
            assert!(
                Attributes::decode(&attribute_bytes[..end]).is_err(),
                "{end}"
            );
        }
        for end in 0..schema_bytes.len() {
            assert!(Schema::decode(&schema_bytes[..end]).is_err(), "{end}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(28);
        for _ in 0..500 {
            let mut damaged = attribute_bytes.clone();
            let byte = rng.random_range(0..damaged.len());
            damaged[byte] ^= 1 << rng.random_range(0..8);
            if let Ok(decoded) = Attributes::decode(&damaged) {
                let again = Attributes::decode(&decoded.encode()).unwrap();
                assert_eq!(again.encode(), decoded.encode());
            }
            let mut damaged = schema_bytes.clone();
            let byte = rng.random_range(0..damaged.len());
            damaged[byte] ^= 1 << rng.random_range(0..8);
            if let Ok(decoded) = Schema::decode(&damaged) {
                let again = Schema::decode(&decoded.encode()).unwrap();
                assert_eq!(again, decoded);
            }
        }
        // Random garbage, including huge counts.
        for _ in 0..500 {
            let n_bytes = rng.random_range(0..40);
            let garbage: Vec<u8> = (0..n_bytes).map(|_| rng.random()).collect();
            let _ = Attributes::decode(&garbage);
            let _ = Schema::decode(&garbage);
        }
    }
}
