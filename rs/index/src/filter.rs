//! Filters over document attributes: the [`Filter`] tree, its validation against a [`Schema`]
//! (types, limits, depth and size), the naive evaluation against one document that is the
//! reference for the attribute index, and its byte encoding.
//!
//! Semantics, for any filter (validated or not):
//! - `All([])` matches every document and `Any([])` none; `Not(f)` is the complement of `f`.
//! - `Match` on a keyword value: the value is one of `any_of`; on a keyword list: any of the
//!   list's values is; on a boolean: it equals `boolean`; on a number: never.
//! - `Range` on a number: every bound given holds (`gt`: value > bound, `gte`: >=, `lt`: <,
//!   `lte`: <=); on any other value: never.
//! - `Exists`: the document has a value for the field (an empty keyword list is a value).
//! - A document without a value for the field matches neither `Match`, `Range` nor `Exists`,
//!   so `Not(Match ...)` matches it.
//!
//! Evaluation recurses, so it is meant for validated filters (at most 32 levels); validation
//! and decoding stop at level 33 and at node 1,025, whatever the input.
//!
//! Encoding: `u8 version (1)`, then the nodes in preorder, each a `u8` tag and its content:
//!
//! ```text
//! 1 All, 2 Any: varint n_children, then the children
//! 3 Not:        the child
//! 4 Match:      field (varint len, UTF-8), varint n_any_of, n_any_of x (varint len, UTF-8),
//!               u8 boolean: 0 unset, 1 false, 2 true
//! 5 Range:      field, u8 bounds present (bit 0 gt, 1 gte, 2 lt, 3 lte; others must be 0),
//!               then one f64 (8 bytes, little endian) per present bound in that order
//! 6 Exists:     field
//! ```

use crate::attributes::{
    malformed, put_string, put_varint, shown, AttributeError, Attributes, CompactReader, FieldType,
    Schema, Value,
};

/// A condition on a document's attributes (semantics in the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub enum Filter {
    /// Every child matches (`All([])` matches everything).
    All(Vec<Filter>),
    /// At least one child matches (`Any([])` matches nothing).
    Any(Vec<Filter>),
    /// The child does not match.
    Not(Box<Filter>),
    /// A KEYWORD or KEYWORDS field has a value in `any_of`, or a BOOL field equals `boolean`.
    Match {
        field: String,
        any_of: Vec<String>,
        boolean: Option<bool>,
    },
    /// A NUMBER field satisfies every bound given.
    Range {
        field: String,
        gt: Option<f64>,
        gte: Option<f64>,
        lt: Option<f64>,
        lte: Option<f64>,
    },
    /// The document has a value for the field.
    Exists(String),
}

impl Filter {
    /// The deepest nesting allowed; a filter without children has depth 1.
    pub const MAX_DEPTH: usize = 32;
    /// The most nodes (every variant counts as one) in one filter.
    pub const MAX_NODES: usize = 1024;
    /// The most values in one Match's `any_of`.
    pub const MAX_ANY_OF: usize = 1024;

    const ENCODING_VERSION: u8 = 1;
    const TAG_ALL: u8 = 1;
    const TAG_ANY: u8 = 2;
    const TAG_NOT: u8 = 3;
    const TAG_MATCH: u8 = 4;
    const TAG_RANGE: u8 = 5;
    const TAG_EXISTS: u8 = 6;

    /// Checks the filter against the schema: every field declared, Match only on KEYWORD,
    /// KEYWORDS (non-empty `any_of` of at most 1,024 keywords of at most 256 bytes, `boolean`
    /// unset) and BOOL fields (`boolean` set, `any_of` empty); Range only on NUMBER fields, with
    /// at least one bound, not both `gt` and `gte` nor both `lt` and `lte`, every bound finite;
    /// at most 32 levels and 1,024 nodes. Returns the first problem found, and never descends
    /// past level 33 or node 1,025.
    pub fn validate(&self, schema: &Schema) -> Result<(), AttributeError> {
        let mut n_nodes = 0;
        self.validate_node(schema, 1, &mut n_nodes)
    }

    fn validate_node(
        &self,
        schema: &Schema,
        depth: usize,
        n_nodes: &mut usize,
    ) -> Result<(), AttributeError> {
        count_node(depth, n_nodes)?;
        match self {
            Filter::All(children) | Filter::Any(children) => {
                for child in children {
                    child.validate_node(schema, depth + 1, n_nodes)?;
                }
                Ok(())
            }
            Filter::Not(child) => child.validate_node(schema, depth + 1, n_nodes),
            Filter::Match {
                field,
                any_of,
                boolean,
            } => validate_match(schema, field, any_of, *boolean),
            Filter::Range {
                field,
                gt,
                gte,
                lt,
                lte,
            } => validate_range(schema, field, [*gt, *gte, *lt, *lte]),
            Filter::Exists(field) => declared_type(schema, field).map(|_| ()),
        }
    }

    /// Whether one document's attributes match (the reference evaluator; the attribute index
    /// must agree with it on every slot).
    pub fn matches(&self, attributes: &Attributes) -> bool {
        match self {
            Filter::All(children) => children.iter().all(|child| child.matches(attributes)),
            Filter::Any(children) => children.iter().any(|child| child.matches(attributes)),
            Filter::Not(child) => !child.matches(attributes),
            Filter::Match {
                field,
                any_of,
                boolean,
            } => attributes
                .get(field)
                .is_some_and(|value| value_matches(value, any_of, *boolean)),
            Filter::Range {
                field,
                gt,
                gte,
                lt,
                lte,
            } => match attributes.get(field) {
                Some(Value::Number(number)) => range_holds(*number, *gt, *gte, *lt, *lte),
                _ => false,
            },
            // TEXT values are not indexed (validation refuses filters on them).
            Filter::Exists(field) => attributes
                .get(field)
                .is_some_and(|value| !matches!(value, Value::Text(_))),
        }
    }

    /// The filter's bytes (layout in the module documentation). Encode validated filters:
    /// [`Filter::decode`] refuses what [`Filter::validate`] would for depth and size.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![Filter::ENCODING_VERSION];
        self.encode_node(&mut out);
        out
    }

    fn encode_node(&self, out: &mut Vec<u8>) {
        match self {
            Filter::All(children) | Filter::Any(children) => {
                out.push(if matches!(self, Filter::All(_)) {
                    Filter::TAG_ALL
                } else {
                    Filter::TAG_ANY
                });
                put_varint(out, children.len() as u32);
                for child in children {
                    child.encode_node(out);
                }
            }
            Filter::Not(child) => {
                out.push(Filter::TAG_NOT);
                child.encode_node(out);
            }
            Filter::Match {
                field,
                any_of,
                boolean,
            } => {
                out.push(Filter::TAG_MATCH);
                put_string(out, field);
                put_varint(out, any_of.len() as u32);
                for keyword in any_of {
                    put_string(out, keyword);
                }
                out.push(match boolean {
                    None => 0,
                    Some(false) => 1,
                    Some(true) => 2,
                });
            }
            Filter::Range {
                field,
                gt,
                gte,
                lt,
                lte,
            } => {
                out.push(Filter::TAG_RANGE);
                put_string(out, field);
                let bounds = [*gt, *gte, *lt, *lte];
                let mut present = 0u8;
                for (bound_idx, bound) in bounds.iter().enumerate() {
                    if bound.is_some() {
                        present |= 1 << bound_idx;
                    }
                }
                out.push(present);
                for bound in bounds.into_iter().flatten() {
                    out.extend_from_slice(&bound.to_bits().to_le_bytes());
                }
            }
            Filter::Exists(field) => {
                out.push(Filter::TAG_EXISTS);
                put_string(out, field);
            }
        }
    }

    /// Decodes [`Filter::encode`]'s bytes: refuses trailing bytes, more than 32 levels and more
    /// than 1,024 nodes (recursion stops at level 33). Field names and values are not checked
    /// against a schema: call [`Filter::validate`] for that.
    pub fn decode(bytes: &[u8]) -> Result<Filter, AttributeError> {
        let mut reader = CompactReader::new(bytes);
        let version = reader.u8("filter version")?;
        if version != Filter::ENCODING_VERSION {
            return Err(malformed(format!("unknown filter version {version}")));
        }
        let mut n_nodes = 0;
        let filter = Filter::decode_node(&mut reader, 1, &mut n_nodes)?;
        reader.finish("filter")?;
        Ok(filter)
    }

    fn decode_node(
        reader: &mut CompactReader<'_>,
        depth: usize,
        n_nodes: &mut usize,
    ) -> Result<Filter, AttributeError> {
        count_node(depth, n_nodes)?;
        let tag = reader.u8("filter node tag")?;
        match tag {
            Filter::TAG_ALL | Filter::TAG_ANY => {
                // Each child takes at least 1 byte.
                let n_children = reader.count(1, "filter child count")?;
                let mut children = Vec::with_capacity(n_children.min(Filter::MAX_NODES));
                for _ in 0..n_children {
                    children.push(Filter::decode_node(reader, depth + 1, n_nodes)?);
                }
                Ok(if tag == Filter::TAG_ALL {
                    Filter::All(children)
                } else {
                    Filter::Any(children)
                })
            }
            Filter::TAG_NOT => Ok(Filter::Not(Box::new(Filter::decode_node(
                reader,
                depth + 1,
                n_nodes,
            )?))),
            Filter::TAG_MATCH => {
                let field = reader.string("match field")?;
                let n_any_of = reader.count(1, "match value count")?;
                let mut any_of = Vec::with_capacity(n_any_of);
                for _ in 0..n_any_of {
                    any_of.push(reader.string("match value")?);
                }
                let boolean = match reader.u8("match boolean")? {
                    0 => None,
                    1 => Some(false),
                    2 => Some(true),
                    other => return Err(malformed(format!("match boolean byte {other}"))),
                };
                Ok(Filter::Match {
                    field,
                    any_of,
                    boolean,
                })
            }
            Filter::TAG_RANGE => {
                let field = reader.string("range field")?;
                let present = reader.u8("range bounds")?;
                if present & !0x0f != 0 {
                    return Err(malformed(format!("range bound bits {present:#x}")));
                }
                let mut bounds = [None; 4];
                for (bound_idx, bound) in bounds.iter_mut().enumerate() {
                    if present & (1 << bound_idx) != 0 {
                        *bound = Some(reader.f64("range bound")?);
                    }
                }
                let [gt, gte, lt, lte] = bounds;
                Ok(Filter::Range {
                    field,
                    gt,
                    gte,
                    lt,
                    lte,
                })
            }
            Filter::TAG_EXISTS => Ok(Filter::Exists(reader.string("exists field")?)),
            other => Err(malformed(format!("unknown filter node tag {other}"))),
        }
    }
}

/// Counts one node at `depth`, refusing the 33rd level and the 1,025th node.
fn count_node(depth: usize, n_nodes: &mut usize) -> Result<(), AttributeError> {
    if depth > Filter::MAX_DEPTH {
        return Err(AttributeError::FilterTooDeep {
            limit: Filter::MAX_DEPTH,
        });
    }
    *n_nodes += 1;
    if *n_nodes > Filter::MAX_NODES {
        return Err(AttributeError::FilterTooLarge {
            limit: Filter::MAX_NODES,
        });
    }
    Ok(())
}

/// The field's declared type; an error for an undeclared field and for a TEXT field (stored,
/// not indexed: no filter applies to it).
fn declared_type(schema: &Schema, field: &str) -> Result<FieldType, AttributeError> {
    match schema.field_type(field) {
        Some(FieldType::Text) => Err(AttributeError::FilterOnText {
            field: shown(field),
        }),
        Some(field_type) => Ok(field_type),
        None => Err(AttributeError::UndeclaredField {
            context: "filter",
            field: shown(field),
        }),
    }
}

fn validate_match(
    schema: &Schema,
    field: &str,
    any_of: &[String],
    boolean: Option<bool>,
) -> Result<(), AttributeError> {
    let field_type = declared_type(schema, field)?;
    let problem = |problem: String| AttributeError::InvalidMatch {
        field: field.to_string(),
        problem,
    };
    match field_type {
        FieldType::Keyword | FieldType::Keywords => {
            if boolean.is_some() {
                return Err(problem(format!(
                    "sets boolean, but the field is {field_type}: list keywords in any_of"
                )));
            }
            if any_of.is_empty() {
                return Err(problem("has an empty any_of".to_string()));
            }
            if any_of.len() > Filter::MAX_ANY_OF {
                return Err(problem(format!(
                    "lists {} values in any_of, at most {} allowed",
                    any_of.len(),
                    Filter::MAX_ANY_OF
                )));
            }
            if let Some(long) = any_of
                .iter()
                .find(|keyword| keyword.len() > Value::MAX_KEYWORD_BYTES)
            {
                return Err(problem(format!(
                    "has a keyword of {} bytes in any_of, at most {} allowed",
                    long.len(),
                    Value::MAX_KEYWORD_BYTES
                )));
            }
            Ok(())
        }
        FieldType::Bool => {
            if !any_of.is_empty() {
                return Err(problem(
                    "lists values in any_of, but the field is BOOL: set boolean instead"
                        .to_string(),
                ));
            }
            if boolean.is_none() {
                return Err(problem(
                    "does not set boolean, which a BOOL field needs".to_string(),
                ));
            }
            Ok(())
        }
        FieldType::Number => Err(problem(
            "is not possible: the field is NUMBER, use Range".to_string(),
        )),
        FieldType::Text => Err(AttributeError::FilterOnText {
            field: shown(field),
        }),
    }
}

fn validate_range(
    schema: &Schema,
    field: &str,
    bounds: [Option<f64>; 4],
) -> Result<(), AttributeError> {
    let field_type = declared_type(schema, field)?;
    let problem = |problem: &str| AttributeError::InvalidRange {
        field: field.to_string(),
        problem: problem.to_string(),
    };
    let [gt, gte, lt, lte] = bounds;
    if field_type != FieldType::Number {
        return Err(AttributeError::InvalidRange {
            field: field.to_string(),
            problem: format!("is not possible: the field is {field_type}, not NUMBER"),
        });
    }
    if bounds.iter().all(Option::is_none) {
        return Err(problem(
            "has no bound: set at least one of gt, gte, lt, lte",
        ));
    }
    if gt.is_some() && gte.is_some() {
        return Err(problem("sets both gt and gte"));
    }
    if lt.is_some() && lte.is_some() {
        return Err(problem("sets both lt and lte"));
    }
    if bounds.iter().flatten().any(|bound| !bound.is_finite()) {
        return Err(problem("has a NaN or infinite bound"));
    }
    Ok(())
}

/// Whether one value matches a Match's `any_of` and `boolean` (the attribute index's columns
/// follow the same rules).
fn value_matches(value: &Value, any_of: &[String], boolean: Option<bool>) -> bool {
    match value {
        Value::Keyword(keyword) => any_of.contains(keyword),
        Value::Keywords(keywords) => keywords.iter().any(|keyword| any_of.contains(keyword)),
        Value::Bool(value) => boolean == Some(*value),
        Value::Number(_) | Value::Text(_) => false,
    }
}

/// Whether a number satisfies every bound given (a NaN bound never holds).
pub(crate) fn range_holds(
    number: f64,
    gt: Option<f64>,
    gte: Option<f64>,
    lt: Option<f64>,
    lte: Option<f64>,
) -> bool {
    gt.is_none_or(|bound| number > bound)
        && gte.is_none_or(|bound| number >= bound)
        && lt.is_none_or(|bound| number < bound)
        && lte.is_none_or(|bound| number <= bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attributes::FieldSpec;
    use rand::{Rng, SeedableRng};

    fn schema() -> Schema {
        Schema::new(vec![
            FieldSpec::new("section", FieldType::Keyword),
            FieldSpec::new("tags", FieldType::Keywords),
            FieldSpec::new("size", FieldType::Number),
            FieldSpec::new("essential", FieldType::Bool),
        ])
        .unwrap()
    }

    fn any_of(field: &str, values: &[&str]) -> Filter {
        Filter::Match {
            field: field.to_string(),
            any_of: values.iter().map(|value| value.to_string()).collect(),
            boolean: None,
        }
    }

    fn is(field: &str, boolean: bool) -> Filter {
        Filter::Match {
            field: field.to_string(),
            any_of: Vec::new(),
            boolean: Some(boolean),
        }
    }

    fn range(field: &str, bounds: [Option<f64>; 4]) -> Filter {
        let [gt, gte, lt, lte] = bounds;
        Filter::Range {
            field: field.to_string(),
            gt,
            gte,
            lt,
            lte,
        }
    }

    fn example_filter() -> Filter {
        Filter::All(vec![
            any_of("section", &["python", "libs"]),
            Filter::Any(vec![
                range("size", [Some(1.5), None, None, Some(1e9)]),
                Filter::Not(Box::new(is("essential", false))),
                Filter::Exists("tags".to_string()),
                Filter::All(Vec::new()),
                Filter::Any(Vec::new()),
            ]),
            any_of("tags", &["", "role::program"]),
        ])
    }

    fn chain(depth: usize) -> Filter {
        let mut filter = Filter::Exists("size".to_string());
        for _ in 1..depth {
            filter = Filter::Not(Box::new(filter));
        }
        filter
    }

    #[test]
    fn matches_follows_the_documented_semantics() {
        let mut document = Attributes::new();
        document.insert("section", Value::Keyword("python".to_string()));
        document.insert(
            "tags",
            Value::Keywords(vec!["a".to_string(), "b".to_string()]),
        );
        document.insert("size", Value::Number(10.0));
        document.insert("essential", Value::Bool(false));
        let empty = Attributes::new();

        assert!(Filter::All(Vec::new()).matches(&document));
        assert!(Filter::All(Vec::new()).matches(&empty));
        assert!(!Filter::Any(Vec::new()).matches(&document));
        assert!(any_of("section", &["libs", "python"]).matches(&document));
        assert!(!any_of("section", &["libs"]).matches(&document));
        assert!(any_of("tags", &["b", "z"]).matches(&document));
        assert!(!any_of("tags", &["z"]).matches(&document));
        assert!(is("essential", false).matches(&document));
        assert!(!is("essential", true).matches(&document));
        assert!(range("size", [None, Some(10.0), None, Some(10.0)]).matches(&document));
        assert!(!range("size", [Some(10.0), None, None, None]).matches(&document));
        assert!(!range("size", [None, None, Some(10.0), None]).matches(&document));
        assert!(range("size", [Some(9.0), None, Some(11.0), None]).matches(&document));
        assert!(Filter::Exists("tags".to_string()).matches(&document));

        // A document without the field: Match, Range and Exists are false, so Not(Match) is
        // true.
        assert!(!any_of("section", &["python"]).matches(&empty));
        assert!(!range("size", [None, Some(0.0), None, None]).matches(&empty));
        assert!(!Filter::Exists("size".to_string()).matches(&empty));
        assert!(Filter::Not(Box::new(any_of("section", &["python"]))).matches(&empty));
        assert!(Filter::Not(Box::new(is("essential", true))).matches(&empty));

        // An empty keyword list is a value that no Match matches.
        let mut no_tags = Attributes::new();
        no_tags.insert("tags", Value::Keywords(Vec::new()));
        assert!(Filter::Exists("tags".to_string()).matches(&no_tags));
        assert!(!any_of("tags", &["a"]).matches(&no_tags));

        assert!(example_filter().matches(&{
            let mut d = document.clone();
            d.insert("tags", Value::Keywords(vec!["role::program".to_string()]));
            d
        }));
    }

    #[test]
    fn validate_refuses_every_filter_limit_with_the_field_named() {
        let schema = schema();
        assert_eq!(example_filter().validate(&schema), Ok(()));
        let refused = |filter: Filter| filter.validate(&schema).unwrap_err().to_string();

        assert_eq!(
            refused(any_of("colour", &["red"])),
            "filter: field \"colour\" is not declared"
        );
        assert_eq!(
            refused(Filter::Exists("colour".to_string())),
            "filter: field \"colour\" is not declared"
        );
        assert_eq!(
            refused(range("colour", [Some(1.0), None, None, None])),
            "filter: field \"colour\" is not declared"
        );
        assert_eq!(
            refused(any_of("section", &[])),
            "filter: Match on field \"section\" has an empty any_of"
        );
        assert_eq!(
            refused(Filter::Match {
                field: "tags".to_string(),
                any_of: vec!["a".to_string()],
                boolean: Some(true),
            }),
            "filter: Match on field \"tags\" sets boolean, but the field is KEYWORDS: list \
             keywords in any_of"
        );
        assert_eq!(
            refused(Filter::Match {
                field: "essential".to_string(),
                any_of: vec!["true".to_string()],
                boolean: Some(true),
            }),
            "filter: Match on field \"essential\" lists values in any_of, but the field is BOOL: \
             set boolean instead"
        );
        assert_eq!(
            refused(any_of("essential", &[])),
            "filter: Match on field \"essential\" does not set boolean, which a BOOL field needs"
        );
        assert_eq!(
            refused(is("size", true)),
            "filter: Match on field \"size\" is not possible: the field is NUMBER, use Range"
        );
        let long = "x".repeat(257);
        assert_eq!(
            refused(any_of("section", &["ok", &long])),
            "filter: Match on field \"section\" has a keyword of 257 bytes in any_of, at most \
             256 allowed"
        );
        let many: Vec<String> = (0..1025).map(|i| i.to_string()).collect();
        let many_refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(
            refused(any_of("tags", &many_refs)),
            "filter: Match on field \"tags\" lists 1025 values in any_of, at most 1024 allowed"
        );
        assert_eq!(any_of("tags", &many_refs[..1024]).validate(&schema), Ok(()));

        assert_eq!(
            refused(range("size", [None; 4])),
            "filter: Range on field \"size\" has no bound: set at least one of gt, gte, lt, lte"
        );
        assert_eq!(
            refused(range("size", [Some(1.0), Some(1.0), None, None])),
            "filter: Range on field \"size\" sets both gt and gte"
        );
        assert_eq!(
            refused(range("size", [None, None, Some(1.0), Some(1.0)])),
            "filter: Range on field \"size\" sets both lt and lte"
        );
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                refused(range("size", [None, None, None, Some(bad)])),
                "filter: Range on field \"size\" has a NaN or infinite bound"
            );
        }
        assert_eq!(
            refused(range("section", [Some(1.0), None, None, None])),
            "filter: Range on field \"section\" is not possible: the field is KEYWORD, not \
             NUMBER"
        );
        // A problem deep inside is found.
        assert_eq!(
            refused(Filter::Any(vec![
                Filter::All(Vec::new()),
                Filter::Not(Box::new(any_of("nope", &["x"])))
            ])),
            "filter: field \"nope\" is not declared"
        );
    }

    #[test]
    fn deep_and_wide_filters_are_refused() {
        let schema = schema();
        assert_eq!(chain(32).validate(&schema), Ok(()));
        assert_eq!(
            chain(33).validate(&schema).unwrap_err().to_string(),
            "filter: nested deeper than 32 levels"
        );
        assert!(chain(300).validate(&schema).is_err());

        let wide =
            |n_children: usize| Filter::Any(vec![Filter::Exists("size".to_string()); n_children]);
        assert_eq!(wide(1023).validate(&schema), Ok(()));
        assert_eq!(
            wide(1024).validate(&schema).unwrap_err().to_string(),
            "filter: more than 1024 nodes"
        );
    }

    #[test]
    fn filters_round_trip_through_bytes() {
        let filters = [
            example_filter(),
            Filter::All(Vec::new()),
            Filter::Any(Vec::new()),
            chain(32),
            range("size", [Some(-0.0), None, Some(2f64.powi(53)), None]),
            range("size", [None, Some(-1.0), None, Some(1.0)]),
            is("essential", true),
            Filter::Any(vec![Filter::Exists("size".to_string()); 1023]),
            any_of("tags", &[&"k".repeat(256), "é", ""]),
        ];
        for filter in filters {
            let bytes = filter.encode();
            assert_eq!(Filter::decode(&bytes).unwrap(), filter);
        }
    }

    #[test]
    fn decode_refuses_filters_too_deep_or_too_large() {
        assert_eq!(
            Filter::decode(&chain(33).encode()).unwrap_err(),
            AttributeError::FilterTooDeep { limit: 32 }
        );
        let wide = Filter::Any(vec![Filter::Exists("size".to_string()); 1024]);
        assert_eq!(
            Filter::decode(&wide.encode()).unwrap_err(),
            AttributeError::FilterTooLarge { limit: 1024 }
        );
        // Hand-made hostile bytes: a million Not tags, and a huge child count.
        let mut nots = vec![1u8];
        nots.extend(std::iter::repeat_n(Filter::TAG_NOT, 1_000_000));
        assert!(Filter::decode(&nots).is_err());
        let huge_count = [1u8, Filter::TAG_ALL, 0xff, 0xff, 0xff, 0xff, 0x0f];
        assert!(Filter::decode(&huge_count).is_err());
        // Unknown bound bits and boolean bytes.
        let mut bytes = range("size", [Some(1.0), None, None, None]).encode();
        let bits_at = bytes.len() - 9;
        bytes[bits_at] |= 0x10;
        assert!(Filter::decode(&bytes).is_err());
    }

    #[test]
    fn damaged_filter_bytes_are_errors_never_panics() {
        let bytes = example_filter().encode();
        for end in 0..bytes.len() {
            assert!(Filter::decode(&bytes[..end]).is_err(), "{end}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(2828);
        for _ in 0..500 {
            let mut damaged = bytes.clone();
            let byte = rng.random_range(0..damaged.len());
            damaged[byte] ^= 1 << rng.random_range(0..8);
            if let Ok(decoded) = Filter::decode(&damaged) {
                // Compared as bytes: a flipped bound can be NaN, which is not equal to itself.
                let again = Filter::decode(&decoded.encode()).unwrap();
                assert_eq!(again.encode(), decoded.encode());
            }
        }
        for _ in 0..500 {
            let n_bytes = rng.random_range(0..40);
            let garbage: Vec<u8> = (0..n_bytes).map(|_| rng.random()).collect();
            let _ = Filter::decode(&garbage);
        }
    }
}
