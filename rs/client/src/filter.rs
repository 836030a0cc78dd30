//! [`Filter`]: a condition on documents' attributes for filtered search and remove by filter,
//! built with small builders and combined with `&`, `|` and `!`.
//!
//! ```
//! use tarn_client::Filter;
//! // section is python or libs, at least 100 kB installed, and not for every architecture
//! let filter = Filter::field("section").any_of(["python", "libs"])
//!     & Filter::range("installed_size_kb").gte(100.0)
//!     & !Filter::field("architecture").eq("all");
//! let either = Filter::field("essential").is(true) | Filter::exists("tags");
//! ```
//!
//! What each condition means (the server checks fields and types against the collection's
//! declared fields, INVALID_ARGUMENT naming the field otherwise):
//! - `Filter::field(f).any_of([..])` / `.eq(v)`: a KEYWORD field's value is one of them; a
//!   KEYWORDS field has one of them among its values.
//! - `Filter::field(f).is(b)`: a BOOL field equals `b`.
//! - `Filter::range(f).gt(x)`, `.gte(x)`, `.lt(x)`, `.lte(x)` (chainable): a NUMBER field within
//!   every bound given.
//! - `Filter::exists(f)`: the document has a value for `f`.
//! - `a & b`, `a | b`, `!a`; [`Filter::all`] and [`Filter::any`] of a list (an empty `all`
//!   matches every document, an empty `any` none).
//!
//! A document without a value for a field matches no condition on it, so `!cond` matches it.
//! Limits: 32 levels, 1,024 nodes, 1,024 values in `any_of`.

use std::ops::{BitAnd, BitOr, Not};

use tarn_proto::v1 as pb;

/// A condition on documents' attributes (see the module documentation for its meaning).
#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    node: Node,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    All(Vec<Filter>),
    Any(Vec<Filter>),
    Not(Box<Filter>),
    Match {
        field: String,
        any_of: Vec<String>,
        boolean: Option<bool>,
    },
    Range(Range),
    Exists(String),
}

/// The first half of a condition on one field: [`Filter::field`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    name: String,
}

impl Field {
    /// A KEYWORD field's value is one of `values`; a KEYWORDS field has one of them.
    pub fn any_of<S: Into<String>>(self, values: impl IntoIterator<Item = S>) -> Filter {
        Filter {
            node: Node::Match {
                field: self.name,
                any_of: values.into_iter().map(Into::into).collect(),
                boolean: None,
            },
        }
    }

    /// A KEYWORD field's value is `value`; a KEYWORDS field has it among its values.
    pub fn eq(self, value: impl Into<String>) -> Filter {
        self.any_of([value.into()])
    }

    /// A BOOL field equals `value`.
    pub fn is(self, value: bool) -> Filter {
        Filter {
            node: Node::Match {
                field: self.name,
                any_of: Vec::new(),
                boolean: Some(value),
            },
        }
    }

    /// The document has a value for the field.
    pub fn exists(self) -> Filter {
        Filter::exists(self.name)
    }
}

/// A NUMBER field within bounds: [`Filter::range`], then any of [`Range::gt`], [`Range::gte`],
/// [`Range::lt`], [`Range::lte`]. Usable wherever a [`Filter`] is (`Into<Filter>`, `&`, `|`,
/// `!`).
#[derive(Debug, Clone, PartialEq)]
pub struct Range {
    field: String,
    gt: Option<f64>,
    gte: Option<f64>,
    lt: Option<f64>,
    lte: Option<f64>,
}

impl Range {
    /// Above `bound`.
    pub fn gt(mut self, bound: f64) -> Range {
        self.gt = Some(bound);
        self
    }

    /// At least `bound`.
    pub fn gte(mut self, bound: f64) -> Range {
        self.gte = Some(bound);
        self
    }

    /// Below `bound`.
    pub fn lt(mut self, bound: f64) -> Range {
        self.lt = Some(bound);
        self
    }

    /// At most `bound`.
    pub fn lte(mut self, bound: f64) -> Range {
        self.lte = Some(bound);
        self
    }
}

impl From<Range> for Filter {
    fn from(range: Range) -> Filter {
        Filter {
            node: Node::Range(range),
        }
    }
}

impl Filter {
    /// A condition on the field `name`: [`Field::any_of`], [`Field::eq`], [`Field::is`],
    /// [`Field::exists`].
    pub fn field(name: impl Into<String>) -> Field {
        Field { name: name.into() }
    }

    /// The NUMBER field `name` within the bounds that follow (at least one).
    pub fn range(name: impl Into<String>) -> Range {
        Range {
            field: name.into(),
            gt: None,
            gte: None,
            lt: None,
            lte: None,
        }
    }

    /// The document has a value for the field `name`.
    pub fn exists(name: impl Into<String>) -> Filter {
        Filter {
            node: Node::Exists(name.into()),
        }
    }

    /// Every filter holds (none given: every document).
    pub fn all<F: Into<Filter>>(filters: impl IntoIterator<Item = F>) -> Filter {
        Filter {
            node: Node::All(filters.into_iter().map(Into::into).collect()),
        }
    }

    /// At least one filter holds (none given: no document).
    pub fn any<F: Into<Filter>>(filters: impl IntoIterator<Item = F>) -> Filter {
        Filter {
            node: Node::Any(filters.into_iter().map(Into::into).collect()),
        }
    }

    pub(crate) fn to_wire(&self) -> pb::Filter {
        use pb::filter::Kind;
        let list = |filters: &[Filter]| pb::FilterList {
            filters: filters.iter().map(Filter::to_wire).collect(),
        };
        let kind = match &self.node {
            Node::All(filters) => Kind::All(list(filters)),
            Node::Any(filters) => Kind::Any(list(filters)),
            Node::Not(filter) => Kind::Not(Box::new(filter.to_wire())),
            Node::Match {
                field,
                any_of,
                boolean,
            } => Kind::Match(pb::Match {
                field: field.clone(),
                any_of: any_of.clone(),
                boolean: *boolean,
            }),
            Node::Range(range) => Kind::Range(pb::Range {
                field: range.field.clone(),
                gt: range.gt,
                gte: range.gte,
                lt: range.lt,
                lte: range.lte,
            }),
            Node::Exists(field) => Kind::Exists(field.clone()),
        };
        pb::Filter { kind: Some(kind) }
    }
}

impl<F: Into<Filter>> BitAnd<F> for Filter {
    type Output = Filter;

    /// Both hold (`a & b & c` is one `all` of three).
    fn bitand(self, other: F) -> Filter {
        match self.node {
            Node::All(mut filters) => {
                filters.push(other.into());
                Filter {
                    node: Node::All(filters),
                }
            }
            node => Filter::all([Filter { node }, other.into()]),
        }
    }
}

impl<F: Into<Filter>> BitOr<F> for Filter {
    type Output = Filter;

    /// At least one holds (`a | b | c` is one `any` of three).
    fn bitor(self, other: F) -> Filter {
        match self.node {
            Node::Any(mut filters) => {
                filters.push(other.into());
                Filter {
                    node: Node::Any(filters),
                }
            }
            node => Filter::any([Filter { node }, other.into()]),
        }
    }
}

impl Not for Filter {
    type Output = Filter;

    /// The filter does not hold.
    fn not(self) -> Filter {
        Filter {
            node: Node::Not(Box::new(self)),
        }
    }
}

impl<F: Into<Filter>> BitAnd<F> for Range {
    type Output = Filter;

    fn bitand(self, other: F) -> Filter {
        Filter::from(self) & other
    }
}

impl<F: Into<Filter>> BitOr<F> for Range {
    type Output = Filter;

    fn bitor(self, other: F) -> Filter {
        Filter::from(self) | other
    }
}

impl Not for Range {
    type Output = Filter;

    fn not(self) -> Filter {
        !Filter::from(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::filter::Kind;

    fn kind(filter: impl Into<Filter>) -> Kind {
        filter.into().to_wire().kind.unwrap()
    }

    #[test]
    fn operators_build_flat_lists_and_the_wire_form() {
        let filter = Filter::field("section").any_of(["python", "libs"])
            & Filter::range("size").gte(100.0).lt(200.0)
            & !Filter::field("architecture").eq("all");
        let Kind::All(list) = kind(filter) else {
            panic!("not an all")
        };
        assert_eq!(list.filters.len(), 3, "a & b & c is one list");
        assert_eq!(
            list.filters[0].kind,
            Some(Kind::Match(pb::Match {
                field: "section".into(),
                any_of: vec!["python".into(), "libs".into()],
                boolean: None,
            }))
        );
        assert_eq!(
            list.filters[1].kind,
            Some(Kind::Range(pb::Range {
                field: "size".into(),
                gt: None,
                gte: Some(100.0),
                lt: Some(200.0),
                lte: None,
            }))
        );
        let Some(Kind::Not(inner)) = &list.filters[2].kind else {
            panic!("not a not")
        };
        assert!(matches!(&inner.kind, Some(Kind::Match(m)) if m.any_of == ["all"]));

        let Kind::Any(list) = kind(
            Filter::field("essential").is(true)
                | Filter::exists("tags")
                | Filter::range("x").gt(1.0),
        ) else {
            panic!("not an any")
        };
        assert_eq!(list.filters.len(), 3);
        assert_eq!(
            list.filters[0].kind,
            Some(Kind::Match(pb::Match {
                field: "essential".into(),
                any_of: Vec::new(),
                boolean: Some(true),
            }))
        );
        assert_eq!(list.filters[1].kind, Some(Kind::Exists("tags".into())));
        // Ranges combine from either side.
        assert!(matches!(
            kind(Filter::range("x").lte(3.0) & Filter::exists("y")),
            Kind::All(l) if l.filters.len() == 2
        ));
        assert!(matches!(kind(!Filter::range("x").lte(3.0)), Kind::Not(_)));
        assert_eq!(
            kind(Filter::all(Vec::<Filter>::new())),
            Kind::All(pb::FilterList::default())
        );
    }
}
