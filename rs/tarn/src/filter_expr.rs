//! The CLI's filter language (`tarn search --filter`, `tarn remove --filter`): a small
//! hand-written parser from text to a [`tarn_client::Filter`], typed by the collection's
//! declared fields.
//!
//! ```text
//! filter    := or
//! or        := and ("or" and)*
//! and       := unary ("and" unary)*
//! unary     := "not" unary | "(" filter ")" | condition
//! condition := FIELD "in" "(" value ("," value)* ")"
//!            | FIELD ("=" | "!=") value
//!            | FIELD ("<" | "<=" | ">" | ">=") number
//!            | FIELD "exists"
//! value     := number | word | quoted
//! ```
//!
//! `not` binds tightest, then `and`, then `or`; the words `and`, `or`, `not`, `in`, `exists`
//! are in any case. A word is a run of letters, digits and `_ . - : + / @` (Debian tags such
//! as `devel::lang:python` are words); a quoted string uses `'` or `"` with `\` escaping the
//! next character. What `=` means follows the field's type: a KEYWORD field's value, or one of
//! a KEYWORDS field's values, is the word; a BOOL field equals `true` or `false`; a NUMBER
//! field equals the number. `!=` is `not (... = ...)`, so a document without the field
//! matches it. Comparisons need NUMBER fields.
//!
//! Example: `section in (python, libs) and installed_size_kb >= 100 and not architecture = all`.

use tarn_client::{FieldType, Filter};

/// A parse error: what is wrong and where (a byte offset into the text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterSyntaxError {
    pub message: String,
    pub offset: usize,
}

impl FilterSyntaxError {
    /// The message, the text, and a caret under the place.
    pub fn show(&self, text: &str) -> String {
        let column = text[..self.offset.min(text.len())].chars().count();
        format!(
            "{} (at column {})\n  {text}\n  {}^",
            self.message,
            column + 1,
            " ".repeat(column)
        )
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// A bare word (field names, keywords, numbers, `and`/`or`/...).
    Word(String),
    /// A quoted string (never a keyword of the language).
    Quoted(String),
    Open,
    Close,
    Comma,
    Eq,
    NotEq,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Token {
    fn describe(&self) -> String {
        match self {
            Token::Word(word) => format!("'{word}'"),
            Token::Quoted(text) => format!("{text:?}"),
            Token::Open => "'('".into(),
            Token::Close => "')'".into(),
            Token::Comma => "','".into(),
            Token::Eq => "'='".into(),
            Token::NotEq => "'!='".into(),
            Token::Lt => "'<'".into(),
            Token::Le => "'<='".into(),
            Token::Gt => "'>'".into(),
            Token::Ge => "'>='".into(),
        }
    }

    fn is_keyword(&self, keyword: &str) -> bool {
        matches!(self, Token::Word(word) if word.eq_ignore_ascii_case(keyword))
    }
}

fn is_word_byte(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | ':' | '+' | '/' | '@')
}

fn tokenize(text: &str) -> Result<Vec<(Token, usize)>, FilterSyntaxError> {
    let mut tokens = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some(&(offset, c)) = chars.peek() {
        let error = |message: String| FilterSyntaxError { message, offset };
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let token = match c {
            '(' | ')' | ',' | '=' => {
                chars.next();
                match c {
                    '(' => Token::Open,
                    ')' => Token::Close,
                    ',' => Token::Comma,
                    _ => Token::Eq,
                }
            }
            '!' | '<' | '>' => {
                chars.next();
                let with_eq = chars.peek().is_some_and(|&(_, next)| next == '=');
                if with_eq {
                    chars.next();
                }
                match (c, with_eq) {
                    ('!', true) => Token::NotEq,
                    ('!', false) => {
                        return Err(error(
                            "'!' must be followed by '=' (write 'not' to negate)".into(),
                        ))
                    }
                    ('<', false) => Token::Lt,
                    ('<', true) => Token::Le,
                    ('>', false) => Token::Gt,
                    _ => Token::Ge,
                }
            }
            '\'' | '"' => {
                chars.next();
                let mut value = String::new();
                let mut closed = false;
                while let Some((_, next)) = chars.next() {
                    match next {
                        '\\' => match chars.next() {
                            Some((_, escaped)) => value.push(escaped),
                            None => break,
                        },
                        quote if quote == c => {
                            closed = true;
                            break;
                        }
                        other => value.push(other),
                    }
                }
                if !closed {
                    return Err(error(format!(
                        "the string starting here has no closing {c}"
                    )));
                }
                Token::Quoted(value)
            }
            c if is_word_byte(c) => {
                let mut word = String::new();
                while let Some(&(_, next)) = chars.peek() {
                    if !is_word_byte(next) {
                        break;
                    }
                    word.push(next);
                    chars.next();
                }
                Token::Word(word)
            }
            other => {
                return Err(error(format!(
                    "unexpected character {other:?} (quote values that contain it)"
                )))
            }
        };
        tokens.push((token, offset));
    }
    Ok(tokens)
}

/// Parses `text` into a filter; `field_type` gives each declared field's type (None: not
/// declared), `declared` lists them for error messages.
pub fn parse(
    text: &str,
    field_type: &dyn Fn(&str) -> Option<FieldType>,
    declared: &[String],
) -> Result<Filter, FilterSyntaxError> {
    let tokens = tokenize(text)?;
    let mut parser = Parser {
        tokens,
        position: 0,
        end: text.len(),
        field_type,
        declared,
    };
    if parser.tokens.is_empty() {
        return Err(FilterSyntaxError {
            message: "the filter is empty".into(),
            offset: 0,
        });
    }
    let filter = parser.or()?;
    if let Some((token, offset)) = parser.tokens.get(parser.position) {
        return Err(FilterSyntaxError {
            message: format!(
                "expected 'and', 'or' or the end of the filter, found {}",
                token.describe()
            ),
            offset: *offset,
        });
    }
    Ok(filter)
}

struct Parser<'a> {
    tokens: Vec<(Token, usize)>,
    position: usize,
    end: usize,
    field_type: &'a dyn Fn(&str) -> Option<FieldType>,
    declared: &'a [String],
}

/// One value of a condition, with where it is.
struct Literal {
    text: String,
    quoted: bool,
    offset: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.position).map(|(token, _)| token)
    }

    fn offset(&self) -> usize {
        self.tokens
            .get(self.position)
            .map_or(self.end, |(_, offset)| *offset)
    }

    fn found(&self) -> String {
        self.peek()
            .map_or("the end of the filter".into(), Token::describe)
    }

    fn error<T>(&self, message: String) -> Result<T, FilterSyntaxError> {
        Err(FilterSyntaxError {
            message,
            offset: self.offset(),
        })
    }

    fn next(&mut self) -> Option<(Token, usize)> {
        let token = self.tokens.get(self.position).cloned();
        self.position += 1;
        token
    }

    fn or(&mut self) -> Result<Filter, FilterSyntaxError> {
        let mut filters = vec![self.and()?];
        while self.peek().is_some_and(|t| t.is_keyword("or")) {
            self.position += 1;
            filters.push(self.and()?);
        }
        Ok(match filters.len() {
            1 => filters.remove(0),
            _ => Filter::any(filters),
        })
    }

    fn and(&mut self) -> Result<Filter, FilterSyntaxError> {
        let mut filters = vec![self.unary()?];
        while self.peek().is_some_and(|t| t.is_keyword("and")) {
            self.position += 1;
            filters.push(self.unary()?);
        }
        Ok(match filters.len() {
            1 => filters.remove(0),
            _ => Filter::all(filters),
        })
    }

    fn unary(&mut self) -> Result<Filter, FilterSyntaxError> {
        match self.peek() {
            Some(token) if token.is_keyword("not") => {
                self.position += 1;
                Ok(!self.unary()?)
            }
            Some(Token::Open) => {
                self.position += 1;
                let filter = self.or()?;
                match self.peek() {
                    Some(Token::Close) => {
                        self.position += 1;
                        Ok(filter)
                    }
                    _ => self.error(format!("expected ')', found {}", self.found())),
                }
            }
            Some(token) if token.is_keyword("and") || token.is_keyword("or") => {
                self.error(format!(
                    "expected a condition (a field name), 'not' or '(', found {}",
                    self.found()
                ))
            }
            Some(Token::Word(_)) => self.condition(),
            _ => self.error(format!(
                "expected a condition (a field name), 'not' or '(', found {}",
                self.found()
            )),
        }
    }

    fn condition(&mut self) -> Result<Filter, FilterSyntaxError> {
        let Some((Token::Word(field), field_offset)) = self.next() else {
            return self.error("expected a field name".into());
        };
        let Some(field_type) = (self.field_type)(&field) else {
            let declared = if self.declared.is_empty() {
                "none".to_owned()
            } else {
                self.declared.join(", ")
            };
            return Err(FilterSyntaxError {
                message: format!(
                    "field '{field}' is not declared by the collection (declared: {declared})"
                ),
                offset: field_offset,
            });
        };
        let operator = self.next();
        match operator {
            Some((token, _)) if token.is_keyword("exists") => Ok(Filter::exists(field)),
            Some((token, _)) if token.is_keyword("in") => {
                if self.peek() != Some(&Token::Open) {
                    return self.error(format!(
                        "expected '(' after 'in', found {}",
                        self.found()
                    ));
                }
                self.position += 1;
                let mut values = vec![self.literal("a value")?];
                loop {
                    match self.peek() {
                        Some(Token::Comma) => {
                            self.position += 1;
                            values.push(self.literal("a value")?);
                        }
                        Some(Token::Close) => {
                            self.position += 1;
                            break;
                        }
                        _ => {
                            return self.error(format!(
                                "expected ',' or ')' after a value of 'in', found {}",
                                self.found()
                            ))
                        }
                    }
                }
                equal_to_any(&field, field_type, values)
            }
            Some((Token::Eq, _)) => {
                let value = self.literal("a value")?;
                equal_to_any(&field, field_type, vec![value])
            }
            Some((Token::NotEq, _)) => {
                let value = self.literal("a value")?;
                Ok(!equal_to_any(&field, field_type, vec![value])?)
            }
            Some((comparison @ (Token::Lt | Token::Le | Token::Gt | Token::Ge), offset)) => {
                if field_type != FieldType::Number {
                    return Err(FilterSyntaxError {
                        message: format!(
                            "{} compares numbers, but '{field}' is a {field_type} field",
                            comparison.describe()
                        ),
                        offset,
                    });
                }
                let literal = self.literal("a number")?;
                let bound = number(&field, &literal)?;
                let range = Filter::range(field);
                Ok(match comparison {
                    Token::Lt => range.lt(bound),
                    Token::Le => range.lte(bound),
                    Token::Gt => range.gt(bound),
                    _ => range.gte(bound),
                }
                .into())
            }
            Some((token, offset)) => Err(FilterSyntaxError {
                message: format!(
                    "expected 'in', '=', '!=', '<', '<=', '>', '>=' or 'exists' after '{field}', found {}",
                    token.describe()
                ),
                offset,
            }),
            None => Err(FilterSyntaxError {
                message: format!(
                    "expected 'in', '=', '!=', '<', '<=', '>', '>=' or 'exists' after '{field}', found the end of the filter"
                ),
                offset: self.end,
            }),
        }
    }

    fn literal(&mut self, what: &str) -> Result<Literal, FilterSyntaxError> {
        match self.next() {
            Some((Token::Word(text), offset)) => Ok(Literal {
                text,
                quoted: false,
                offset,
            }),
            Some((Token::Quoted(text), offset)) => Ok(Literal {
                text,
                quoted: true,
                offset,
            }),
            Some((token, offset)) => Err(FilterSyntaxError {
                message: format!("expected {what}, found {}", token.describe()),
                offset,
            }),
            None => Err(FilterSyntaxError {
                message: format!("expected {what}, found the end of the filter"),
                offset: self.end,
            }),
        }
    }
}

fn number(field: &str, literal: &Literal) -> Result<f64, FilterSyntaxError> {
    match literal.text.parse::<f64>() {
        Ok(value) if value.is_finite() && !literal.quoted => Ok(value),
        _ => Err(FilterSyntaxError {
            message: format!(
                "'{field}' is a number field: expected a number, found {:?}",
                literal.text
            ),
            offset: literal.offset,
        }),
    }
}

/// `field` equals one of `values`, by the field's type.
fn equal_to_any(
    field: &str,
    field_type: FieldType,
    values: Vec<Literal>,
) -> Result<Filter, FilterSyntaxError> {
    match field_type {
        FieldType::Number => {
            let mut filters = Vec::new();
            for literal in &values {
                let value = number(field, literal)?;
                filters.push(Filter::from(Filter::range(field).gte(value).lte(value)));
            }
            Ok(one_or_any(filters))
        }
        FieldType::Bool => {
            let mut filters = Vec::new();
            for literal in &values {
                let value = match literal.text.to_ascii_lowercase().as_str() {
                    "true" if !literal.quoted => true,
                    "false" if !literal.quoted => false,
                    _ => {
                        return Err(FilterSyntaxError {
                            message: format!(
                                "'{field}' is a bool field: expected true or false, found {:?}",
                                literal.text
                            ),
                            offset: literal.offset,
                        })
                    }
                };
                filters.push(Filter::field(field).is(value));
            }
            Ok(one_or_any(filters))
        }
        // Keyword and keyword lists, and any type a newer server adds: keywords.
        _ => Ok(Filter::field(field).any_of(values.into_iter().map(|l| l.text))),
    }
}

fn one_or_any(mut filters: Vec<Filter>) -> Filter {
    match filters.len() {
        1 => filters.remove(0),
        _ => Filter::any(filters),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(name: &str) -> Option<FieldType> {
        match name {
            "section" | "architecture" | "priority" => Some(FieldType::Keyword),
            "tags" => Some(FieldType::Keywords),
            "installed_size_kb" => Some(FieldType::Number),
            "essential" => Some(FieldType::Bool),
            _ => None,
        }
    }

    fn declared() -> Vec<String> {
        ["section", "tags", "installed_size_kb", "essential"]
            .map(String::from)
            .to_vec()
    }

    fn ok(text: &str) -> Filter {
        parse(text, &schema, &declared()).unwrap_or_else(|e| panic!("{}", e.show(text)))
    }

    fn err(text: &str) -> FilterSyntaxError {
        parse(text, &schema, &declared()).unwrap_err()
    }

    #[test]
    fn the_issue_s_example_parses_with_not_tighter_than_and_tighter_than_or() {
        assert_eq!(
            ok("section in (python, libs) and installed_size_kb >= 100 and not architecture = all"),
            Filter::all([
                Filter::field("section").any_of(["python", "libs"]),
                Filter::range("installed_size_kb").gte(100.0).into(),
                !Filter::field("architecture").eq("all"),
            ])
        );
        assert_eq!(
            ok("section = a or section = b and not essential = true"),
            Filter::any([
                Filter::field("section").eq("a"),
                Filter::all([
                    Filter::field("section").eq("b"),
                    !Filter::field("essential").is(true),
                ]),
            ])
        );
        assert_eq!(
            ok("(section = a OR section = b) AND NOT NOT tags exists"),
            Filter::all([
                Filter::any([
                    Filter::field("section").eq("a"),
                    Filter::field("section").eq("b"),
                ]),
                !!Filter::exists("tags"),
            ])
        );
    }

    #[test]
    fn values_follow_the_field_s_type() {
        assert_eq!(
            ok("tags = devel::lang:python"),
            Filter::field("tags").eq("devel::lang:python")
        );
        assert_eq!(
            ok(r#"section = "with space" or section = 'it\'s'"#),
            Filter::any([
                Filter::field("section").eq("with space"),
                Filter::field("section").eq("it's"),
            ])
        );
        // A keyword may look like a number or a boolean.
        assert_eq!(ok("section = 42"), Filter::field("section").eq("42"));
        assert_eq!(ok("section = true"), Filter::field("section").eq("true"));
        assert_eq!(
            ok("essential = FALSE"),
            Filter::field("essential").is(false)
        );
        assert_eq!(
            ok("essential != true"),
            !Filter::field("essential").is(true)
        );
        assert_eq!(
            ok("installed_size_kb = 12.5"),
            Filter::range("installed_size_kb")
                .gte(12.5)
                .lte(12.5)
                .into()
        );
        assert_eq!(
            ok("installed_size_kb in (1, 2)"),
            Filter::any([
                Filter::range("installed_size_kb").gte(1.0).lte(1.0),
                Filter::range("installed_size_kb").gte(2.0).lte(2.0),
            ])
        );
        for (text, range) in [
            (
                "installed_size_kb < -1",
                Filter::range("installed_size_kb").lt(-1.0),
            ),
            (
                "installed_size_kb <= 1e3",
                Filter::range("installed_size_kb").lte(1000.0),
            ),
            (
                "installed_size_kb > 0",
                Filter::range("installed_size_kb").gt(0.0),
            ),
            (
                "installed_size_kb>=7",
                Filter::range("installed_size_kb").gte(7.0),
            ),
        ] {
            assert_eq!(ok(text), Filter::from(range), "{text}");
        }
    }

    #[test]
    fn errors_say_what_is_wrong_and_where() {
        let cases: &[(&str, &str, usize)] = &[
            ("", "empty", 0),
            ("section in (python", "expected ',' or ')'", 18),
            ("section in python", "expected '(' after 'in'", 11),
            ("section", "expected 'in', '=',", 7),
            ("section ~ a", "unexpected character '~'", 8),
            ("section = ", "expected a value, found the end", 10),
            (
                "color = red",
                "field 'color' is not declared by the collection (declared: section, tags",
                0,
            ),
            (
                "section < 3",
                "'<' compares numbers, but 'section' is a keyword field",
                8,
            ),
            (
                "installed_size_kb >= big",
                "expected a number, found \"big\"",
                21,
            ),
            ("installed_size_kb = '7'", "expected a number", 20),
            ("essential = maybe", "expected true or false", 12),
            ("section = a and", "expected a condition", 15),
            (
                "section = a b",
                "expected 'and', 'or' or the end of the filter, found 'b'",
                12,
            ),
            ("(section = a", "expected ')'", 12),
            ("section = 'open", "no closing '", 10),
            ("! section = a", "'!' must be followed by '='", 0),
            ("section = a and or", "expected a condition", 16),
        ];
        for (text, message, offset) in cases {
            let error = err(text);
            assert!(
                error.message.contains(message),
                "{text:?}: {:?} does not say {message:?}",
                error.message
            );
            assert_eq!(error.offset, *offset, "{text:?}: {}", error.show(text));
        }
        let shown = err("section in (python").show("section in (python");
        assert_eq!(
            shown,
            "expected ',' or ')' after a value of 'in', found the end of the filter (at column 19)\n  section in (python\n                    ^"
        );
    }
}
