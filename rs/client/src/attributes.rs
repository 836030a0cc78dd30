//! Document attributes on the client side: the field types a collection declares
//! ([`FieldSpec`], [`FieldType`]) and the values a document carries ([`Attributes`] of
//! [`Value`]s), with their conversions to and from the wire.

use std::collections::BTreeMap;

use tarn_proto::v1 as pb;

use crate::error::{Error, Result};

/// The type of a declared attribute field. KEYWORD, KEYWORDS, NUMBER and BOOL fields are
/// indexed for filters; a TEXT field is stored and returned on request (`output_fields`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FieldType {
    /// One string per document (at most 256 bytes), e.g. a section.
    Keyword,
    /// A list of strings per document (at most 1,024), e.g. tags.
    Keywords,
    /// One number per document (an `f64`; integers are exact up to 2^53).
    Number,
    /// One boolean per document.
    Bool,
    /// A UTF-8 text per document (at most 1 MiB), stored and returned on request; no filter
    /// uses it.
    Text,
}

impl FieldType {
    /// `keyword`, `keywords`, `number`, `bool` or `text`.
    pub fn as_str(self) -> &'static str {
        match self {
            FieldType::Keyword => "keyword",
            FieldType::Keywords => "keywords",
            FieldType::Number => "number",
            FieldType::Bool => "bool",
            FieldType::Text => "text",
        }
    }

    pub(crate) fn to_wire(self) -> i32 {
        let field_type = match self {
            FieldType::Keyword => pb::FieldType::Keyword,
            FieldType::Keywords => pb::FieldType::Keywords,
            FieldType::Number => pb::FieldType::Number,
            FieldType::Bool => pb::FieldType::Bool,
            FieldType::Text => pb::FieldType::Text,
        };
        field_type as i32
    }

    fn from_wire(value: i32) -> Option<FieldType> {
        match pb::FieldType::try_from(value) {
            Ok(pb::FieldType::Keyword) => Some(FieldType::Keyword),
            Ok(pb::FieldType::Keywords) => Some(FieldType::Keywords),
            Ok(pb::FieldType::Number) => Some(FieldType::Number),
            Ok(pb::FieldType::Bool) => Some(FieldType::Bool),
            Ok(pb::FieldType::Text) => Some(FieldType::Text),
            _ => None,
        }
    }
}

impl std::str::FromStr for FieldType {
    type Err = Error;

    /// `keyword`, `keywords`, `number`, `bool` (also `boolean`) or `text`, in any case.
    fn from_str(name: &str) -> Result<FieldType> {
        match name.to_ascii_lowercase().as_str() {
            "keyword" => Ok(FieldType::Keyword),
            "keywords" => Ok(FieldType::Keywords),
            "number" => Ok(FieldType::Number),
            "bool" | "boolean" => Ok(FieldType::Bool),
            "text" => Ok(FieldType::Text),
            _ => Err(Error::invalid(
                "fields",
                format!("unknown field type {name:?} (keyword, keywords, number, bool or text)"),
            )),
        }
    }
}

impl std::fmt::Display for FieldType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A declared attribute field: its name (`[A-Za-z0-9_.-]{1,64}`) and type.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct FieldSpec {
    /// The field's name.
    pub name: String,
    /// The field's type.
    pub field_type: FieldType,
    /// A TEXT field's analyzer options (Unicode words, lowercasing and ASCII folding always).
    pub analyzer: TextAnalyzer,
}

/// What a TEXT field's analyzer adds to Unicode word segmentation, lowercasing and ASCII
/// folding (the server's full-text index and its queries use it alike).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TextAnalyzer {
    /// Snowball's English stemmer ("indexing" and "indexes" match "index").
    pub english_stemmer: bool,
    /// Drops Lucene's 33 English stop words ("the", "of", ...).
    pub english_stop_words: bool,
}

impl TextAnalyzer {
    /// English: the stemmer and the stop words.
    pub fn english() -> TextAnalyzer {
        TextAnalyzer {
            english_stemmer: true,
            english_stop_words: true,
        }
    }
}

impl FieldSpec {
    /// The field `name` of type `field_type`.
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

    pub(crate) fn to_wire(&self) -> pb::FieldSpec {
        pb::FieldSpec {
            name: self.name.clone(),
            r#type: self.field_type.to_wire(),
            analyzer: (self.analyzer != TextAnalyzer::default()).then_some(pb::TextAnalyzer {
                english_stemmer: self.analyzer.english_stemmer,
                english_stop_words: self.analyzer.english_stop_words,
            }),
        }
    }

    /// The fields a server reports; a type this client does not know (a newer server's) is
    /// left out.
    pub(crate) fn list_from_wire(fields: Vec<pb::FieldSpec>) -> Vec<FieldSpec> {
        fields
            .into_iter()
            .filter_map(|spec| {
                FieldType::from_wire(spec.r#type).map(|field_type| FieldSpec {
                    name: spec.name,
                    field_type,
                    analyzer: spec
                        .analyzer
                        .map_or_else(TextAnalyzer::default, |a| TextAnalyzer {
                            english_stemmer: a.english_stemmer,
                            english_stop_words: a.english_stop_words,
                        }),
                })
            })
            .collect()
    }
}

/// One document's value for one field; its kind must be the field's declared type.
///
/// ```
/// use tarn_client::Value;
/// assert_eq!(Value::from("python"), Value::Keyword("python".into()));
/// assert_eq!(Value::from(120), Value::Number(120.0));
/// assert_eq!(Value::from(["a", "b"]), Value::Keywords(vec!["a".into(), "b".into()]));
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Value {
    /// For a KEYWORD field.
    Keyword(String),
    /// For a KEYWORDS field (an empty list is a value: `exists` holds, no match does).
    Keywords(Vec<String>),
    /// For a NUMBER field: finite.
    Number(f64),
    /// For a BOOL field.
    Bool(bool),
    /// For a TEXT field (`Value::text("...")`; a `&str` converts to a keyword).
    Text(String),
}

impl From<&str> for Value {
    fn from(keyword: &str) -> Value {
        Value::Keyword(keyword.to_owned())
    }
}

impl From<String> for Value {
    fn from(keyword: String) -> Value {
        Value::Keyword(keyword)
    }
}

impl From<f64> for Value {
    fn from(number: f64) -> Value {
        Value::Number(number)
    }
}

impl From<i32> for Value {
    fn from(number: i32) -> Value {
        Value::Number(f64::from(number))
    }
}

impl From<u32> for Value {
    fn from(number: u32) -> Value {
        Value::Number(f64::from(number))
    }
}

impl From<bool> for Value {
    fn from(boolean: bool) -> Value {
        Value::Bool(boolean)
    }
}

impl From<Vec<String>> for Value {
    fn from(keywords: Vec<String>) -> Value {
        Value::Keywords(keywords)
    }
}

impl From<Vec<&str>> for Value {
    fn from(keywords: Vec<&str>) -> Value {
        Value::Keywords(keywords.into_iter().map(str::to_owned).collect())
    }
}

impl<const N: usize> From<[&str; N]> for Value {
    fn from(keywords: [&str; N]) -> Value {
        Value::Keywords(keywords.into_iter().map(str::to_owned).collect())
    }
}

impl Value {
    /// A TEXT field's value.
    pub fn text(text: impl Into<String>) -> Value {
        Value::Text(text.into())
    }

    fn to_wire(&self) -> pb::Value {
        let kind = match self {
            Value::Keyword(keyword) => pb::value::Kind::Keyword(keyword.clone()),
            Value::Keywords(keywords) => pb::value::Kind::Keywords(pb::KeywordList {
                values: keywords.clone(),
            }),
            Value::Number(number) => pb::value::Kind::Number(*number),
            Value::Bool(boolean) => pb::value::Kind::Boolean(*boolean),
            Value::Text(text) => pb::value::Kind::Text(text.clone()),
        };
        pb::Value { kind: Some(kind) }
    }

    fn from_wire(value: pb::Value) -> Option<Value> {
        Some(match value.kind? {
            pb::value::Kind::Keyword(keyword) => Value::Keyword(keyword),
            pb::value::Kind::Keywords(list) => Value::Keywords(list.values),
            pb::value::Kind::Number(number) => Value::Number(number),
            pb::value::Kind::Boolean(boolean) => Value::Bool(boolean),
            pb::value::Kind::Text(text) => Value::Text(text),
        })
    }
}

/// One document's attributes: field name to value (at most 64 fields, each declared by the
/// collection), and its payload: any JSON text (at most 1 MiB), stored with it and returned on
/// request, never indexed.
///
/// ```
/// use tarn_client::{Attributes, Value};
/// let attributes = Attributes::new()
///     .with("section", "python")
///     .with("tags", ["devel::lang:python", "role::program"])
///     .with("installed_size_kb", 120)
///     .with("essential", false);
/// assert_eq!(attributes.get("installed_size_kb"), Some(&Value::Number(120.0)));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attributes {
    values: BTreeMap<String, Value>,
    payload: Option<String>,
}

impl Attributes {
    /// No attributes.
    pub fn new() -> Attributes {
        Attributes::default()
    }

    /// These attributes with `field` set to `value`.
    pub fn with(mut self, field: impl Into<String>, value: impl Into<Value>) -> Attributes {
        self.insert(field, value);
        self
    }

    /// Sets a field's value, returning the value it replaces.
    pub fn insert(&mut self, field: impl Into<String>, value: impl Into<Value>) -> Option<Value> {
        self.values.insert(field.into(), value.into())
    }

    /// The value of a field, if the document has one.
    pub fn get(&self, field: &str) -> Option<&Value> {
        self.values.get(field)
    }

    /// The fields and values, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.values
            .iter()
            .map(|(name, value)| (name.as_str(), value))
    }

    /// These attributes with `payload` (a JSON text) as the document's payload.
    pub fn with_payload(mut self, payload: impl Into<String>) -> Attributes {
        self.payload = Some(payload.into());
        self
    }

    /// The document's payload (a JSON text), if it has one (and it was asked for).
    pub fn payload(&self) -> Option<&str> {
        self.payload.as_deref()
    }

    /// How many fields have a value.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether no field has a value and there is no payload.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty() && self.payload.is_none()
    }

    pub(crate) fn to_wire(&self) -> pb::Attributes {
        pb::Attributes {
            values: self
                .values
                .iter()
                .map(|(name, value)| (name.clone(), value.to_wire()))
                .collect(),
            payload: self.payload.clone().unwrap_or_default(),
        }
    }

    pub(crate) fn from_wire(attributes: Option<pb::Attributes>) -> Attributes {
        let attributes = attributes.unwrap_or_default();
        let values = attributes
            .values
            .into_iter()
            .filter_map(|(name, value)| Value::from_wire(value).map(|value| (name, value)))
            .collect();
        let payload = Some(attributes.payload).filter(|payload| !payload.is_empty());
        Attributes { values, payload }
    }
}

impl<K: Into<String>, V: Into<Value>> FromIterator<(K, V)> for Attributes {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Attributes {
        let mut attributes = Attributes::new();
        for (field, value) in pairs {
            attributes.insert(field, value);
        }
        attributes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_round_trip_through_the_wire_form() {
        let attributes = Attributes::new()
            .with("section", "python")
            .with("tags", vec!["a", "b"])
            .with("size", 12.5)
            .with("essential", true);
        assert_eq!(
            Attributes::from_wire(Some(attributes.to_wire())),
            attributes
        );
        assert!(Attributes::from_wire(None).is_empty());
    }

    #[test]
    fn field_types_parse_and_unknown_ones_name_the_field() {
        assert_eq!("KEYWORDS".parse::<FieldType>(), Ok(FieldType::Keywords));
        assert_eq!("boolean".parse::<FieldType>(), Ok(FieldType::Bool));
        let error = "date".parse::<FieldType>().unwrap_err();
        assert!(error.message().starts_with("fields:"), "{error}");
        for field_type in [
            FieldType::Keyword,
            FieldType::Keywords,
            FieldType::Number,
            FieldType::Bool,
        ] {
            assert_eq!(FieldType::from_wire(field_type.to_wire()), Some(field_type));
        }
    }
}
