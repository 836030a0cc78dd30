//! The attribute index of one partition: the attributes of its slots (slot = `u32` position,
//! dense from 0), stored per declared field so that a [`Filter`] turns into the exact set of
//! matching slots ([`SlotSet`]) by bitmap algebra, and so its count is exact.
//!
//! Per field:
//! - KEYWORD: a dictionary (term -> term id), a sorted posting list of slots per term, the term
//!   id of each slot, and a presence bitmap.
//! - KEYWORDS: a dictionary, a posting list per term (a slot appears once however often its list
//!   repeats the term), each slot's term ids as given (order and repeats, for
//!   [`AttributeIndex::attributes_of`]), and a presence bitmap (an empty list is present).
//! - NUMBER: a column of f64 and a presence bitmap. While the index can still change (a mutable
//!   partition), a Range scans the present slots (one comparison each). [`AttributeIndex::freeze`]
//!   (sealed partitions, which never change) adds a copy of the present `(value, slot)` pairs
//!   sorted by value, and a Range then costs two binary searches and one insert per match: a
//!   selective range no longer pays for every slot of the partition.
//! - BOOL: a bitmap of the slots holding true and one of the slots holding false.
//!
//! `All`, `Any` and `Not` are intersections, unions and complements of the children's bitmaps.
//! The index agrees with [`Filter::matches`] on every slot, for any filter (validated or not);
//! fields the index does not know (added to the schema after this partition was sealed) have no
//! value in any slot.
//!
//! Sealed segments store it as one section ([`AttributeIndex::encode_section`]); the caller wraps
//! it in its checksum. Little endian, fixed width:
//!
//! ```text
//! u8  version (1)
//! u32 n_slots
//! u32 schema_len, then the schema (Schema::encode)
//! per schema field, in declaration order:
//!   u8  field type code (must be the schema's)
//!   u64 x ceil(n_slots / 64): presence bitmap (bits at and past n_slots zero)
//!   KEYWORD:  dictionary, then u32 term id per present slot, in slot order
//!   KEYWORDS: dictionary, then u32 value count per present slot, then the u32 term ids of
//!             every present slot, in slot order
//!   NUMBER:   u64 f64 bits per present slot (finite)
//!   BOOL:     u64 x ceil(n_slots / 64): the slots holding true (a subset of the present ones)
//!   TEXT:     nothing (its presence bitmap is empty: the values are stored values, below)
//! dictionary: u32 n_terms, then per term u32 len and UTF-8 bytes (distinct terms; id = position)
//! ```
//!
//! Posting lists are not stored: decoding rebuilds them in one pass over the term ids, so the
//! file cannot hold lists that disagree with the slots' values.
//!
//! The index also carries each slot's stored values (TEXT values and the payload) as one blob
//! per slot (`stored.rs`), so every path that moves attributes between slots (seals, merges,
//! rebuilds, builds) moves them too; a sealed segment writes them as a section of their own,
//! read from the file on demand.

use std::collections::HashMap;

use crate::attributes::{AttributeError, Attributes, FieldSpec, FieldType, Schema, Value};
use crate::bytes::{ByteReader, ByteWriter};
use crate::error::{IndexError, Result};
use crate::filter::{range_holds, Filter};
use crate::fulltext::TextColumn;
use crate::stored::StoredColumn;
use std::sync::Arc;

/// A set of slots: a bitmap of `u64` words (slot `s` is bit `s % 64` of word `s / 64`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotSet {
    words: Vec<u64>,
}

fn words_for(n_slots: u32) -> usize {
    (n_slots as usize).div_ceil(64)
}

impl SlotSet {
    /// No slot, sized for `n_slots`.
    pub fn empty(n_slots: u32) -> SlotSet {
        SlotSet {
            words: vec![0; words_for(n_slots)],
        }
    }

    /// Every slot below `n_slots`.
    pub fn full(n_slots: u32) -> SlotSet {
        SlotSet::empty(n_slots).not(n_slots)
    }

    /// A set from bitmap words (for example a tombstone bitmap's).
    pub fn from_words(words: Vec<u64>) -> SlotSet {
        SlotSet { words }
    }

    /// The bitmap words.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    pub fn into_words(self) -> Vec<u64> {
        self.words
    }

    /// Adds a slot, growing the bitmap if needed.
    pub fn insert(&mut self, slot: u32) {
        let word_idx = slot as usize / 64;
        if self.words.len() <= word_idx {
            self.words.resize(word_idx + 1, 0);
        }
        self.words[word_idx] |= 1 << (slot % 64);
    }

    pub fn contains(&self, slot: u32) -> bool {
        self.words
            .get(slot as usize / 64)
            .is_some_and(|word| word & (1 << (slot % 64)) != 0)
    }

    /// The number of slots in the set.
    pub fn count(&self) -> usize {
        self.words
            .iter()
            .map(|word| word.count_ones() as usize)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&word| word == 0)
    }

    /// The slots in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(word_idx, &word)| {
            let mut remaining = word;
            std::iter::from_fn(move || {
                if remaining == 0 {
                    return None;
                }
                let bit = remaining.trailing_zeros();
                remaining &= remaining - 1;
                Some(word_idx as u32 * 64 + bit)
            })
        })
    }

    /// The slots in both sets.
    pub fn and(mut self, other: &SlotSet) -> SlotSet {
        for (word_idx, word) in self.words.iter_mut().enumerate() {
            *word &= other.words.get(word_idx).copied().unwrap_or(0);
        }
        self
    }

    /// The slots in either set.
    pub fn or(mut self, other: &SlotSet) -> SlotSet {
        if self.words.len() < other.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (word, other_word) in self.words.iter_mut().zip(&other.words) {
            *word |= other_word;
        }
        self
    }

    /// The slots below `n_slots` not in the set.
    pub fn not(mut self, n_slots: u32) -> SlotSet {
        self.words.resize(words_for(n_slots), 0);
        for word in &mut self.words {
            *word = !*word;
        }
        self.clear_from(n_slots);
        self
    }

    /// The slots below `n_slots`, sized for `n_slots`.
    fn clipped(&self, n_slots: u32) -> SlotSet {
        let mut words = self.words.clone();
        words.resize(words_for(n_slots), 0);
        let mut clipped = SlotSet { words };
        clipped.clear_from(n_slots);
        clipped
    }

    /// Clears the bits at and past `n_slots` in the last word.
    fn clear_from(&mut self, n_slots: u32) {
        let tail_bits = n_slots % 64;
        if tail_bits != 0 {
            if let Some(last) = self.words.last_mut() {
                *last &= (1u64 << tail_bits) - 1;
            }
        }
    }
}

/// A term id that marks a slot without a KEYWORD value.
const NO_TERM: u32 = u32::MAX;

/// The terms of one keyword field and their posting lists.
#[derive(Debug, Clone, Default)]
struct Dictionary {
    /// Term id -> term.
    terms: Vec<String>,
    term_ids: HashMap<String, u32>,
    /// Term id -> the slots holding the term, strictly increasing.
    postings: Vec<Vec<u32>>,
}

impl Dictionary {
    fn intern(&mut self, term: &str) -> u32 {
        if let Some(&term_id) = self.term_ids.get(term) {
            return term_id;
        }
        let term_id = self.terms.len() as u32;
        self.terms.push(term.to_string());
        self.term_ids.insert(term.to_string(), term_id);
        self.postings.push(Vec::new());
        term_id
    }

    /// Records that `slot` holds the term (slots arrive in increasing order; a repeat of the
    /// last slot is ignored).
    fn add_posting(&mut self, term_id: u32, slot: u32) {
        if let Some(postings) = self.postings.get_mut(term_id as usize) {
            if postings.last().is_none_or(|&last| last < slot) {
                postings.push(slot);
            }
        }
    }

    fn term(&self, term_id: u32) -> Option<&str> {
        self.terms.get(term_id as usize).map(String::as_str)
    }

    /// The slots below `n_slots` holding any of the terms.
    fn matching(&self, any_of: &[String], n_slots: u32) -> SlotSet {
        let mut set = SlotSet::empty(n_slots);
        for term in any_of {
            let Some(&term_id) = self.term_ids.get(term) else {
                continue;
            };
            for &slot in &self.postings[term_id as usize] {
                if slot >= n_slots {
                    break;
                }
                set.insert(slot);
            }
        }
        set
    }
}

#[derive(Debug, Clone, Default)]
struct KeywordColumn {
    dictionary: Dictionary,
    /// Slot -> term id, or `NO_TERM`; slots past the end have no value.
    term_of_slot: Vec<u32>,
    present: SlotSet,
}

#[derive(Debug, Clone, Default)]
struct KeywordsColumn {
    dictionary: Dictionary,
    /// Slot `s`'s term ids are `term_ids[value_ends[s - 1]..value_ends[s]]` (from 0 for slot 0);
    /// slots past the end have no value.
    value_ends: Vec<usize>,
    term_ids: Vec<u32>,
    present: SlotSet,
}

#[derive(Debug, Clone, Default)]
struct NumberColumn {
    /// Slot -> number (0 where absent); slots past the end have no value.
    values: Vec<f64>,
    present: SlotSet,
    /// The present slots' `(value, slot)` sorted by value, then slot: made by `freeze`,
    /// dropped by any change (values are finite, so the order is total).
    sorted: Option<Vec<(f64, u32)>>,
}

impl NumberColumn {
    fn freeze(&mut self) {
        let mut sorted: Vec<(f64, u32)> = self
            .present
            .iter()
            .filter_map(|slot| Some((*self.values.get(slot as usize)?, slot)))
            .collect();
        sorted.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        self.sorted = Some(sorted);
    }

    /// The slots below `n_slots` whose value lies within every given bound, through the sorted
    /// copy: `None` when there is none.
    fn sorted_range(&self, bounds: [Option<f64>; 4], n_slots: u32) -> Option<SlotSet> {
        let sorted = self.sorted.as_ref()?;
        let [gt, gte, lt, lte] = bounds;
        let mut set = SlotSet::empty(n_slots);
        // A NaN bound holds for no number (as `range_holds` says).
        if bounds.iter().flatten().any(|bound| bound.is_nan()) {
            return Some(set);
        }
        // Each predicate holds for a prefix of the sorted values (`-0.0` and `0.0`, the only
        // values `total_cmp` tells apart that comparisons do not, answer alike).
        let first = |below: &dyn Fn(f64) -> bool| sorted.partition_point(|(v, _)| below(*v));
        let start =
            first(&|v| gt.is_some_and(|b| v <= b)).max(first(&|v| gte.is_some_and(|b| v < b)));
        let end = first(&|v| lt.is_none_or(|b| v < b)).min(first(&|v| lte.is_none_or(|b| v <= b)));
        for &(_, slot) in sorted.get(start..end).unwrap_or_default() {
            if slot < n_slots {
                set.insert(slot);
            }
        }
        Some(set)
    }
}

#[derive(Debug, Clone, Default)]
struct BoolColumn {
    true_slots: SlotSet,
    false_slots: SlotSet,
}

/// The values of one declared field across the slots.
#[derive(Debug, Clone)]
enum Column {
    Keyword(KeywordColumn),
    Keywords(KeywordsColumn),
    Number(NumberColumn),
    Bool(BoolColumn),
    /// A TEXT field: its values are stored values (the index's [`StoredColumn`]); here is
    /// its inverted index (`fulltext.rs`).
    Text(TextColumn),
}

impl Column {
    fn new(spec: &FieldSpec) -> Column {
        match spec.field_type {
            FieldType::Keyword => Column::Keyword(KeywordColumn::default()),
            FieldType::Keywords => Column::Keywords(KeywordsColumn::default()),
            FieldType::Number => Column::Number(NumberColumn::default()),
            FieldType::Bool => Column::Bool(BoolColumn::default()),
            FieldType::Text => Column::Text(TextColumn::new(spec.analyzer)),
        }
    }

    /// Records a slot's value. Slots arrive in increasing order, each at most once; a value of
    /// another type than the column's, or a slot already recorded, is ignored (neither happens
    /// after [`Schema::validate`] and the slot checks of [`AttributeIndex::push`]).
    fn append(&mut self, slot: u32, value: &Value) {
        match (self, value) {
            (Column::Keyword(column), Value::Keyword(keyword)) => {
                if column.present.contains(slot) {
                    return;
                }
                let term_id = column.dictionary.intern(keyword);
                column.append_term(slot, term_id);
            }
            (Column::Keywords(column), Value::Keywords(keywords)) => {
                if (slot as usize) < column.value_ends.len() {
                    return;
                }
                // Slots skipped since the last list have empty ranges (and no presence bit).
                let end = column.term_ids.len();
                column.value_ends.resize(slot as usize, end);
                for keyword in keywords {
                    let term_id = column.dictionary.intern(keyword);
                    column.term_ids.push(term_id);
                    column.dictionary.add_posting(term_id, slot);
                }
                column.value_ends.push(column.term_ids.len());
                column.present.insert(slot);
            }
            (Column::Number(column), Value::Number(number)) => {
                column.sorted = None;
                if column.values.len() <= slot as usize {
                    column.values.resize(slot as usize + 1, 0.0);
                }
                column.values[slot as usize] = *number;
                column.present.insert(slot);
            }
            (Column::Bool(column), Value::Bool(boolean)) => {
                if *boolean {
                    column.true_slots.insert(slot);
                } else {
                    column.false_slots.insert(slot);
                }
            }
            (Column::Text(column), Value::Text(text)) => column.append(slot, text),
            _ => {}
        }
    }

    /// The slots below `n_slots` with a value, sized for `n_slots`.
    fn present(&self, n_slots: u32) -> SlotSet {
        match self {
            Column::Keyword(column) => column.present.clipped(n_slots),
            Column::Keywords(column) => column.present.clipped(n_slots),
            Column::Number(column) => column.present.clipped(n_slots),
            Column::Bool(column) => column
                .true_slots
                .clipped(n_slots)
                .or(&column.false_slots.clipped(n_slots)),
            Column::Text(_) => SlotSet::empty(n_slots),
        }
    }

    fn value_of(&self, slot: u32) -> Option<Value> {
        match self {
            Column::Keyword(column) => {
                let term_id = *column.term_of_slot.get(slot as usize)?;
                column
                    .dictionary
                    .term(term_id)
                    .map(|term| Value::Keyword(term.to_string()))
            }
            Column::Keywords(column) => {
                if !column.present.contains(slot) {
                    return None;
                }
                let term_ids = column.term_ids_of(slot)?;
                let keywords = term_ids
                    .iter()
                    .filter_map(|&term_id| column.dictionary.term(term_id))
                    .map(str::to_string)
                    .collect();
                Some(Value::Keywords(keywords))
            }
            Column::Number(column) => {
                if !column.present.contains(slot) {
                    return None;
                }
                column.values.get(slot as usize).copied().map(Value::Number)
            }
            Column::Bool(column) => {
                if column.true_slots.contains(slot) {
                    Some(Value::Bool(true))
                } else if column.false_slots.contains(slot) {
                    Some(Value::Bool(false))
                } else {
                    None
                }
            }
            Column::Text(_) => None,
        }
    }

    /// The slots below `n_slots` matching a Match (same rules as [`Filter::matches`]).
    fn matching_match(&self, any_of: &[String], boolean: Option<bool>, n_slots: u32) -> SlotSet {
        match self {
            Column::Keyword(column) => column.dictionary.matching(any_of, n_slots),
            Column::Keywords(column) => column.dictionary.matching(any_of, n_slots),
            Column::Bool(column) => match boolean {
                Some(true) => column.true_slots.clipped(n_slots),
                Some(false) => column.false_slots.clipped(n_slots),
                None => SlotSet::empty(n_slots),
            },
            Column::Number(_) | Column::Text(_) => SlotSet::empty(n_slots),
        }
    }

    /// The slots below `n_slots` matching a Range (only numbers can).
    fn matching_range(&self, bounds: [Option<f64>; 4], n_slots: u32) -> SlotSet {
        let Column::Number(column) = self else {
            return SlotSet::empty(n_slots);
        };
        if let Some(set) = column.sorted_range(bounds, n_slots) {
            return set;
        }
        let [gt, gte, lt, lte] = bounds;
        let mut set = SlotSet::empty(n_slots);
        for slot in column.present.clipped(n_slots).iter() {
            let holds = column
                .values
                .get(slot as usize)
                .is_some_and(|&number| range_holds(number, gt, gte, lt, lte));
            if holds {
                set.insert(slot);
            }
        }
        set
    }
}

impl KeywordColumn {
    fn append_term(&mut self, slot: u32, term_id: u32) {
        if self.term_of_slot.len() <= slot as usize {
            self.term_of_slot.resize(slot as usize + 1, NO_TERM);
        }
        self.term_of_slot[slot as usize] = term_id;
        self.dictionary.add_posting(term_id, slot);
        self.present.insert(slot);
    }
}

impl KeywordsColumn {
    fn term_ids_of(&self, slot: u32) -> Option<&[u32]> {
        let slot = slot as usize;
        let end = *self.value_ends.get(slot)?;
        let start = if slot == 0 {
            0
        } else {
            self.value_ends[slot - 1]
        };
        self.term_ids.get(start..end)
    }
}

/// The attributes of one partition's slots, indexed per declared field (see the module
/// documentation). One writer appends slots (the mutable segment) or it is decoded whole (a
/// sealed segment); the caller provides the locking.
#[derive(Debug, Clone)]
pub struct AttributeIndex {
    schema: Schema,
    /// Slots below this have been pushed (or decoded); later ones have no attributes.
    n_slots: u32,
    /// One column per schema field, in declaration order.
    columns: Vec<Column>,
    /// Each slot's stored values (TEXT values and payload), kept apart from the columns.
    stored: StoredColumn,
}

impl AttributeIndex {
    const SECTION_VERSION: u8 = 1;

    /// An index of no slots over the fields of `schema`.
    pub fn new(schema: Schema) -> AttributeIndex {
        let columns = schema.fields().iter().map(Column::new).collect();
        AttributeIndex {
            schema,
            n_slots: 0,
            columns,
            stored: StoredColumn::default(),
        }
    }

    /// The fields this index holds.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// One past the highest slot pushed (or the slot count given at decoding).
    pub fn n_slots(&self) -> u32 {
        self.n_slots
    }

    /// Adopts a schema that extends the current one (fields added to the collection); the new
    /// fields have no value in the slots already pushed.
    pub fn extend_schema(&mut self, schema: Schema) -> Result<(), AttributeError> {
        if !schema.starts_with(&self.schema) {
            return Err(AttributeError::SchemaMismatch {
                problem: "the new schema does not extend the index's fields".to_string(),
            });
        }
        for spec in &schema.fields()[self.schema.len()..] {
            self.columns.push(Column::new(spec));
        }
        self.schema = schema;
        Ok(())
    }

    /// Prepares the index for searches that will not see it change (a sealed partition): each
    /// number column gets its sorted copy. A later `push` drops the copy it invalidates.
    pub fn freeze(&mut self) {
        for column in &mut self.columns {
            if let Column::Number(column) = column {
                column.freeze();
            }
        }
    }

    /// Appends one slot's attributes: the slot must come after every slot pushed before (gaps
    /// are slots without attributes, and empty attributes are fine) and the attributes must be
    /// valid for the index's schema. On error nothing changes.
    pub fn push(&mut self, slot: u32, attributes: &Attributes) -> Result<(), AttributeError> {
        if slot < self.n_slots || slot == u32::MAX {
            return Err(AttributeError::SlotOutOfOrder {
                slot,
                n_slots: self.n_slots,
            });
        }
        self.schema.validate(attributes)?;
        self.append(slot, attributes);
        Ok(())
    }

    /// Appends without validation (callers guarantee increasing slots below `u32::MAX`); fields
    /// the schema does not know and values of the wrong type are skipped.
    fn append(&mut self, slot: u32, attributes: &Attributes) {
        for (name, value) in attributes.iter() {
            if let Some(field_idx) = self.schema.field_index(name) {
                self.columns[field_idx as usize].append(slot, value);
            }
        }
        if attributes.has_stored() {
            let (_, mut stored) = attributes.split_stored();
            let schema = &self.schema;
            stored.retain(
                |name| schema.field_type(name) == Some(FieldType::Text),
                true,
            );
            self.stored.push(slot, Arc::from(stored.encode()));
        }
        self.n_slots = self.n_slots.max(slot + 1);
    }

    /// One slot's stored values (TEXT values and payload; empty for a slot without any): an
    /// error when they are in a segment file that cannot be read, fails its checksum, or holds
    /// bytes that do not decode.
    pub fn stored_of(&self, slot: u32) -> Result<Attributes> {
        match self.stored.get(slot)? {
            Some(blob) => Attributes::decode(&blob)
                .map_err(|error| bad(format!("the stored values of slot {slot}: {error}"))),
            None => Ok(Attributes::new()),
        }
    }

    /// One slot's document: [`AttributeIndex::attributes_of`], and with `stored` its
    /// [`AttributeIndex::stored_of`] too (only then can it fail).
    pub fn document_of(&self, slot: u32, stored: bool) -> Result<Attributes> {
        let mut document = self.attributes_of(slot);
        if stored && !self.stored.is_empty() {
            document.merge(self.stored_of(slot)?);
        }
        Ok(document)
    }

    /// True when some slot has stored values (a sealed partition then writes them as a
    /// section of their own).
    pub fn has_stored(&self) -> bool {
        !self.stored.is_empty()
    }

    /// The stored values as a sealed-segment section (`stored.rs`); an error when they are in
    /// a file that cannot be read.
    pub(crate) fn encode_stored_section(&self) -> Result<Vec<u8>> {
        self.stored.encode_section(self.n_slots)
    }

    /// Adopts a partition's decoded stored values (a sealed segment's section); the index then
    /// counts at least `n_slots` slots.
    pub(crate) fn set_stored(&mut self, stored: StoredColumn, n_slots: u32) {
        self.stored = stored;
        if !self.stored.is_empty() {
            self.n_slots = self.n_slots.max(n_slots);
        }
    }

    /// Bytes of memory the stored values take (in memory, or their offsets and checksums).
    pub fn stored_memory_bytes(&self) -> usize {
        self.stored.memory_bytes()
    }

    /// The column of a field, if this index holds it.
    fn column(&self, field: &str) -> Option<&Column> {
        self.schema
            .field_index(field)
            .map(|field_idx| &self.columns[field_idx as usize])
    }

    /// The slots below `n_slots` whose attributes match the filter, exactly:
    /// `matching(f, n).contains(s) == f.matches(&attributes_of(s))` for every `s < n`. Slots at
    /// or past [`AttributeIndex::n_slots`] have no attributes (so `Not` and `All([])` include
    /// them). Recurses once per filter level: validate filters first.
    pub fn matching(&self, filter: &Filter, n_slots: u32) -> SlotSet {
        match filter {
            Filter::All(children) => {
                let mut set = SlotSet::full(n_slots);
                for child in children {
                    if set.is_empty() {
                        break;
                    }
                    set = set.and(&self.matching(child, n_slots));
                }
                set
            }
            Filter::Any(children) => children.iter().fold(SlotSet::empty(n_slots), |set, child| {
                set.or(&self.matching(child, n_slots))
            }),
            Filter::Not(child) => self.matching(child, n_slots).not(n_slots),
            Filter::Match {
                field,
                any_of,
                boolean,
            } => match self.column(field) {
                Some(column) => column.matching_match(any_of, *boolean, n_slots),
                None => SlotSet::empty(n_slots),
            },
            Filter::Range {
                field,
                gt,
                gte,
                lt,
                lte,
            } => match self.column(field) {
                Some(column) => column.matching_range([*gt, *gte, *lt, *lte], n_slots),
                None => SlotSet::empty(n_slots),
            },
            Filter::Exists(field) => match self.column(field) {
                Some(column) => column.present(n_slots),
                None => SlotSet::empty(n_slots),
            },
        }
    }

    /// One slot's attributes as pushed (empty for a slot without any, or past the end).
    pub fn attributes_of(&self, slot: u32) -> Attributes {
        let mut attributes = Attributes::new();
        for (spec, column) in self.schema.fields().iter().zip(&self.columns) {
            if let Some(value) = column.value_of(slot) {
                attributes.insert(spec.name.clone(), value);
            }
        }
        attributes
    }

    /// The index renumbered: new slot `i` holds old slot `old_slots_in_new_order[i]` (an old
    /// slot past the end gives a slot without attributes). For rebuilds that drop tombstones or
    /// reorder slots.
    pub fn remap(&self, old_slots_in_new_order: &[u32]) -> Result<AttributeIndex> {
        AttributeIndex::gather(self.schema.clone(), &[(self, old_slots_in_new_order)])
    }

    /// Concatenates several partitions (a merge): for each part in order, its listed old slots
    /// become the next new slots. `schema` must extend every part's schema (it is normally the
    /// collection's current one).
    pub fn from_parts(
        schema: Schema,
        parts: &[(&AttributeIndex, &[u32])],
    ) -> Result<AttributeIndex> {
        if let Some(part_idx) = parts
            .iter()
            .position(|(part, _)| !schema.starts_with(part.schema()))
        {
            return Err(IndexError::InvalidInput(
                AttributeError::SchemaMismatch {
                    problem: format!(
                        "part {part_idx} has fields the merged schema does not extend"
                    ),
                }
                .to_string(),
            ));
        }
        AttributeIndex::gather(schema, parts)
    }

    fn gather(schema: Schema, parts: &[(&AttributeIndex, &[u32])]) -> Result<AttributeIndex> {
        let old_slots = parts
            .iter()
            .flat_map(|(part, old_slots)| old_slots.iter().map(move |&old_slot| (*part, old_slot)));
        AttributeIndex::gather_slots(schema, old_slots)
    }

    /// An index whose new slot `i` holds the `i`-th picked `(index, old slot)`'s attributes, in
    /// any order and from any number of indexes (a merge whose slots are sorted by document
    /// id). Values of fields `schema` does not declare, or declares with another type, are
    /// dropped: pass a schema that extends every picked index's (the longest of theirs, since
    /// fields are only ever appended). Stored values are carried as they are (read from the
    /// file for a sealed partition's: an error if a read fails or a checksum does not match).
    pub fn gather_slots<'a>(
        schema: Schema,
        picks: impl IntoIterator<Item = (&'a AttributeIndex, u32)>,
    ) -> Result<AttributeIndex> {
        let mut index = AttributeIndex::new(schema);
        // Slot u32::MAX is never used, so at most u32::MAX slots.
        for (new_slot, (part, old_slot)) in (0..u32::MAX).zip(picks) {
            if !part.schema.is_empty() {
                index.append(new_slot, &part.attributes_of(old_slot));
            }
            if let Some(blob) = part.stored.get(old_slot)? {
                index.index_texts(new_slot, &blob)?;
                index.stored.push(new_slot, blob);
            }
            index.n_slots = new_slot + 1;
        }
        Ok(index)
    }

    /// Indexes the TEXT values of one slot's stored blob (a slot carried from another index,
    /// whose TEXT values are not among its indexed attributes).
    fn index_texts(&mut self, slot: u32, blob: &[u8]) -> Result<()> {
        if !self.has_text_fields() {
            return Ok(());
        }
        let stored = Attributes::decode(blob)
            .map_err(|error| bad(format!("the stored values of slot {slot}: {error}")))?;
        for (name, value) in stored.iter() {
            if let (Some(field_idx), Value::Text(text)) = (self.schema.field_index(name), value) {
                if let Column::Text(column) = &mut self.columns[field_idx as usize] {
                    column.append(slot, text);
                }
            }
        }
        Ok(())
    }

    /// True when the schema declares a TEXT field.
    pub fn has_text_fields(&self) -> bool {
        self.columns.iter().any(|c| matches!(c, Column::Text(_)))
    }

    /// The inverted index of the TEXT field of this name.
    pub(crate) fn text_column(&self, field: &str) -> Option<&TextColumn> {
        match self.column(field)? {
            Column::Text(column) => Some(column),
            _ => None,
        }
    }

    /// Bytes of memory the TEXT fields' inverted indexes take.
    pub fn text_memory_bytes(&self) -> usize {
        self.columns
            .iter()
            .map(|column| match column {
                Column::Text(column) => column.memory_bytes(),
                _ => 0,
            })
            .sum()
    }

    /// The TEXT fields' inverted indexes as a sealed-segment section: per TEXT field in
    /// declaration order, its postings (`TextColumn::encode`).
    /// `n_slots` is the partition's (at least the index's).
    pub(crate) fn encode_postings_section(&self, n_slots: u32) -> Vec<u8> {
        let mut writer = ByteWriter::default();
        for column in &self.columns {
            if let Column::Text(column) = column {
                column.encode(n_slots.max(self.n_slots), &mut writer);
            }
        }
        writer.bytes
    }

    /// Adopts the inverted indexes of a postings section written for this index's schema and
    /// slot count; damage is an [`IndexError::Format`].
    pub(crate) fn decode_postings_section(&mut self, bytes: &[u8]) -> Result<()> {
        let mut reader = ByteReader::new(bytes);
        let n_slots = self.n_slots;
        for column in &mut self.columns {
            if let Column::Text(column) = column {
                *column = TextColumn::decode(&mut reader, column.analyzer(), n_slots)?;
            }
        }
        if reader.remaining() != 0 {
            return Err(bad(format!(
                "{} trailing bytes after the postings section",
                reader.remaining()
            )));
        }
        Ok(())
    }

    /// Builds the TEXT fields' inverted indexes from the stored values (a segment written
    /// before postings existed): reads every slot's stored values, from the file for a
    /// written segment.
    pub(crate) fn rebuild_postings(&mut self) -> Result<()> {
        if !self.has_text_fields() {
            return Ok(());
        }
        for column in &mut self.columns {
            if let Column::Text(column) = column {
                *column = TextColumn::new(column.analyzer());
            }
        }
        for slot in 0..self.n_slots {
            if let Some(blob) = self.stored.get(slot)? {
                self.index_texts(slot, &blob)?;
            }
        }
        Ok(())
    }

    /// The index as a sealed-segment section (layout in the module documentation).
    pub fn encode_section(&self) -> Vec<u8> {
        let mut writer = ByteWriter::default();
        writer.u8(AttributeIndex::SECTION_VERSION);
        writer.u32(self.n_slots);
        let schema_bytes = self.schema.encode();
        writer.u32(schema_bytes.len() as u32);
        writer.bytes.extend_from_slice(&schema_bytes);
        for (spec, column) in self.schema.fields().iter().zip(&self.columns) {
            writer.u8(spec.field_type.code());
            let present = column.present(self.n_slots);
            writer.u64s(present.words());
            match column {
                Column::Keyword(column) => {
                    write_dictionary(&mut writer, &column.dictionary);
                    for slot in present.iter() {
                        let term_id = column.term_of_slot.get(slot as usize);
                        writer.u32(term_id.copied().unwrap_or(NO_TERM));
                    }
                }
                Column::Keywords(column) => {
                    write_dictionary(&mut writer, &column.dictionary);
                    for slot in present.iter() {
                        let n_values = column.term_ids_of(slot).map_or(0, <[u32]>::len);
                        writer.u32(n_values as u32);
                    }
                    for slot in present.iter() {
                        writer.u32s(column.term_ids_of(slot).unwrap_or_default());
                    }
                }
                Column::Number(column) => {
                    for slot in present.iter() {
                        let number = column.values.get(slot as usize).copied();
                        writer.u64(number.unwrap_or(f64::NAN).to_bits());
                    }
                }
                Column::Bool(column) => {
                    writer.u64s(column.true_slots.clipped(self.n_slots).words());
                }
                // Its values are in the stored section; its presence bitmap is empty.
                Column::Text(_) => {}
            }
        }
        writer.bytes
    }

    /// Decodes [`AttributeIndex::encode_section`]'s bytes for a partition of `n_slots` slots
    /// (the section may record fewer: the rest have no attributes). Every count is checked
    /// against the bytes left, every slot against the slot count and every term id against its
    /// dictionary; damage is an [`IndexError::Format`], never a panic.
    pub fn decode_section(bytes: &[u8], n_slots: u32) -> Result<AttributeIndex> {
        let mut reader = ByteReader::new(bytes);
        let version = reader.u8("attribute section version")?;
        if version != AttributeIndex::SECTION_VERSION {
            return Err(bad(format!("unknown attribute section version {version}")));
        }
        let recorded_n_slots = reader.u32("attribute section slot count")?;
        if recorded_n_slots > n_slots {
            return Err(bad(format!(
                "attribute section holds {recorded_n_slots} slots, the partition {n_slots}"
            )));
        }
        let schema_len = reader.u32("attribute section schema length")? as usize;
        let schema_bytes = reader.take(schema_len, "attribute section schema")?;
        let schema = Schema::decode(schema_bytes)
            .map_err(|error| bad(format!("attribute section schema: {error}")))?;
        let mut index = AttributeIndex::new(schema.clone());
        for (spec, column) in schema.fields().iter().zip(&mut index.columns) {
            let code = reader.u8("attribute field type")?;
            if code != spec.field_type.code() {
                return Err(bad(format!(
                    "attribute field {:?} has type code {code}, the schema says {}",
                    spec.name, spec.field_type
                )));
            }
            let present = read_bitmap(&mut reader, recorded_n_slots, "attribute presence")?;
            let n_present = present.count();
            match column {
                Column::Keyword(column) => {
                    column.dictionary = read_dictionary(&mut reader)?;
                    let term_ids = reader.u32s(n_present, "keyword term ids")?;
                    for (slot, term_id) in present.iter().zip(term_ids) {
                        check_term_id(&column.dictionary, term_id)?;
                        column.append_term(slot, term_id);
                    }
                }
                Column::Keywords(column) => {
                    column.dictionary = read_dictionary(&mut reader)?;
                    let value_counts = reader.u32s(n_present, "keyword value counts")?;
                    let n_values = value_counts
                        .iter()
                        .try_fold(0usize, |total, &count| total.checked_add(count as usize))
                        .ok_or_else(|| bad("keyword value counts overflow".to_string()))?;
                    let term_ids = reader.u32s(n_values, "keyword list term ids")?;
                    let mut start = 0;
                    for (slot, count) in present.iter().zip(value_counts) {
                        let end = start + count as usize;
                        for &term_id in &term_ids[start..end] {
                            check_term_id(&column.dictionary, term_id)?;
                            column.dictionary.add_posting(term_id, slot);
                        }
                        let gap_end = column.term_ids.len();
                        column.value_ends.resize(slot as usize, gap_end);
                        column.term_ids.extend_from_slice(&term_ids[start..end]);
                        column.value_ends.push(column.term_ids.len());
                        start = end;
                    }
                    column.present = present;
                }
                Column::Number(column) => {
                    let bits = reader.u64s(n_present, "numbers")?;
                    column.values = vec![0.0; recorded_n_slots as usize];
                    for (slot, bits) in present.iter().zip(bits) {
                        let number = f64::from_bits(bits);
                        if !number.is_finite() {
                            return Err(bad(format!(
                                "attribute field {:?} holds a NaN or infinite number",
                                spec.name
                            )));
                        }
                        column.values[slot as usize] = number;
                    }
                    column.present = present;
                }
                Column::Bool(column) => {
                    let true_slots = read_bitmap(&mut reader, recorded_n_slots, "true slots")?;
                    let outside_present = true_slots
                        .words()
                        .iter()
                        .zip(present.words())
                        .any(|(true_word, present_word)| true_word & !present_word != 0);
                    if outside_present {
                        return Err(bad(format!(
                            "attribute field {:?} has true slots without a value",
                            spec.name
                        )));
                    }
                    column.false_slots = true_slots.clone().not(recorded_n_slots).and(&present);
                    column.true_slots = true_slots;
                }
                Column::Text(_) => {
                    if !present.is_empty() {
                        return Err(bad(format!(
                            "TEXT field {:?} has values in the attribute section",
                            spec.name
                        )));
                    }
                }
            }
        }
        if reader.remaining() != 0 {
            return Err(bad(format!(
                "{} trailing bytes after the attribute section",
                reader.remaining()
            )));
        }
        index.n_slots = n_slots;
        Ok(index)
    }
}

fn bad(reason: String) -> IndexError {
    IndexError::Format(reason)
}

fn write_dictionary(writer: &mut ByteWriter, dictionary: &Dictionary) {
    writer.u32(dictionary.terms.len() as u32);
    for term in &dictionary.terms {
        writer.u32(term.len() as u32);
        writer.bytes.extend_from_slice(term.as_bytes());
    }
}

fn read_dictionary(reader: &mut ByteReader<'_>) -> Result<Dictionary> {
    let n_terms = reader.u32("dictionary term count")? as usize;
    // Each term takes at least its 4-byte length.
    if n_terms.saturating_mul(4) > reader.remaining() {
        return Err(bad(format!(
            "dictionary of {n_terms} terms cannot fit in {} bytes",
            reader.remaining()
        )));
    }
    let mut dictionary = Dictionary::default();
    for _ in 0..n_terms {
        let term_len = reader.u32("dictionary term length")? as usize;
        let raw = reader.take(term_len, "dictionary term")?;
        let term = std::str::from_utf8(raw)
            .map_err(|_| bad("dictionary term is not UTF-8".to_string()))?;
        if dictionary.term_ids.contains_key(term) {
            return Err(bad(format!("dictionary term {term:?} appears twice")));
        }
        dictionary.intern(term);
    }
    Ok(dictionary)
}

fn check_term_id(dictionary: &Dictionary, term_id: u32) -> Result<()> {
    if term_id as usize >= dictionary.terms.len() {
        return Err(bad(format!(
            "term id {term_id} past a dictionary of {} terms",
            dictionary.terms.len()
        )));
    }
    Ok(())
}

/// Reads a bitmap of `n_slots` bits, refusing set bits at or past `n_slots`.
fn read_bitmap(reader: &mut ByteReader<'_>, n_slots: u32, what: &str) -> Result<SlotSet> {
    let words = reader.u64s(words_for(n_slots), what)?;
    let set = SlotSet::from_words(words);
    if set.clipped(n_slots) != set {
        return Err(bad(format!("{what}: bits set past slot {n_slots}")));
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attributes::FieldSpec;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const VOCABULARY: [&str; 6] = ["a", "b", "c", "dd", "", "é"];
    const NUMBERS: [f64; 8] = [-2.0, -0.5, 0.0, 1.0, 1.5, 3.0, 1e6, 9_007_199_254_740_993.0];

    fn random_schema(rng: &mut StdRng) -> Schema {
        let n_fields = rng.random_range(1..=6);
        let types = [
            FieldType::Keyword,
            FieldType::Keywords,
            FieldType::Number,
            FieldType::Bool,
        ];
        Schema::new(
            (0..n_fields)
                .map(|field_idx| {
                    FieldSpec::new(format!("f{field_idx}"), types[rng.random_range(0..4)])
                })
                .collect(),
        )
        .unwrap()
    }

    fn random_keyword(rng: &mut StdRng) -> String {
        VOCABULARY[rng.random_range(0..VOCABULARY.len())].to_string()
    }

    fn random_value(rng: &mut StdRng, field_type: FieldType) -> Value {
        match field_type {
            FieldType::Keyword => Value::Keyword(random_keyword(rng)),
            FieldType::Keywords => {
                let n_values = rng.random_range(0..=4);
                Value::Keywords((0..n_values).map(|_| random_keyword(rng)).collect())
            }
            FieldType::Number => Value::Number(NUMBERS[rng.random_range(0..NUMBERS.len())]),
            FieldType::Bool => Value::Bool(rng.random_bool(0.5)),
            FieldType::Text => Value::Text(random_keyword(rng)),
        }
    }

    fn random_document(rng: &mut StdRng, schema: &Schema) -> Attributes {
        let mut attributes = Attributes::new();
        for spec in schema.fields() {
            if rng.random_bool(0.6) {
                attributes.insert(spec.name.clone(), random_value(rng, spec.field_type));
            }
        }
        attributes
    }

    fn random_bound(rng: &mut StdRng) -> Option<f64> {
        rng.random_bool(0.4)
            .then(|| NUMBERS[rng.random_range(0..NUMBERS.len())])
    }

    /// A random filter over the schema's fields; with `loose`, also Matches and Ranges that
    /// validation refuses (the index must agree with `matches` on those too).
    fn random_filter(rng: &mut StdRng, schema: &Schema, depth: usize, loose: bool) -> Filter {
        if depth < 5 && rng.random_bool(0.45) {
            let kind = rng.random_range(0..3);
            if kind == 2 {
                return Filter::Not(Box::new(random_filter(rng, schema, depth + 1, loose)));
            }
            let n_children = rng.random_range(0..=3);
            let children = (0..n_children)
                .map(|_| random_filter(rng, schema, depth + 1, loose))
                .collect();
            return if kind == 0 {
                Filter::All(children)
            } else {
                Filter::Any(children)
            };
        }
        let spec = &schema.fields()[rng.random_range(0..schema.len())];
        let field = spec.name.clone();
        if rng.random_bool(0.15) {
            return Filter::Exists(field);
        }
        if loose && rng.random_bool(0.3) {
            return if rng.random_bool(0.5) {
                Filter::Match {
                    field,
                    any_of: (0..rng.random_range(0..3))
                        .map(|_| random_keyword(rng))
                        .collect(),
                    boolean: rng.random_bool(0.5).then(|| rng.random_bool(0.5)),
                }
            } else {
                Filter::Range {
                    field,
                    gt: random_bound(rng),
                    gte: random_bound(rng),
                    lt: random_bound(rng),
                    lte: random_bound(rng),
                }
            };
        }
        match spec.field_type {
            FieldType::Keyword | FieldType::Keywords => Filter::Match {
                field,
                any_of: (0..rng.random_range(1..=3))
                    .map(|_| random_keyword(rng))
                    .collect(),
                boolean: None,
            },
            FieldType::Bool => Filter::Match {
                field,
                any_of: Vec::new(),
                boolean: Some(rng.random_bool(0.5)),
            },
            // Random schemas declare no TEXT field (filters cannot use one).
            FieldType::Text => Filter::All(Vec::new()),
            FieldType::Number => loop {
                let (gt, mut gte) = (random_bound(rng), random_bound(rng));
                let (mut lt, lte) = (random_bound(rng), random_bound(rng));
                if gt.is_some() {
                    gte = None;
                }
                if lte.is_some() {
                    lt = None;
                }
                if [gt, gte, lt, lte].iter().any(Option::is_some) {
                    break Filter::Range {
                        field,
                        gt,
                        gte,
                        lt,
                        lte,
                    };
                }
            },
        }
    }

    /// The slots whose documents match, by the naive evaluator.
    fn expected(filter: &Filter, documents: &[Attributes]) -> SlotSet {
        let mut set = SlotSet::empty(documents.len() as u32);
        for (slot, document) in documents.iter().enumerate() {
            if filter.matches(document) {
                set.insert(slot as u32);
            }
        }
        set
    }

    fn keyword(text: &str) -> Value {
        Value::Keyword(text.to_string())
    }

    fn any_of(field: &str, values: &[&str]) -> Filter {
        Filter::Match {
            field: field.to_string(),
            any_of: values.iter().map(|value| value.to_string()).collect(),
            boolean: None,
        }
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

    /// 200 slots of every field type, with gaps, and 50 trailing slots without attributes.
    fn example_index() -> (AttributeIndex, Vec<Attributes>) {
        let schema = example_schema();
        let mut rng = StdRng::seed_from_u64(99);
        let mut index = AttributeIndex::new(schema.clone());
        let mut documents = Vec::new();
        for slot in 0..200u32 {
            let document = if slot % 7 == 3 {
                Attributes::new()
            } else {
                random_document(&mut rng, &schema)
            };
            if slot % 11 == 5 {
                // A slot never pushed has no attributes.
                documents.push(Attributes::new());
            } else {
                index.push(slot, &document).unwrap();
                documents.push(document);
            }
        }
        documents.resize(250, Attributes::new());
        (index, documents)
    }

    #[test]
    fn matching_equals_the_naive_evaluator_on_random_schemas_documents_and_filters() {
        let mut rng = StdRng::seed_from_u64(0x28_f11e);
        // Filters whose answer is neither empty nor every slot: the test must exercise those.
        let mut n_selective = 0;
        for _case in 0..250 {
            let query_schema = random_schema(&mut rng);
            // The index may know only a prefix of the fields (sealed before fields were added).
            let n_known = rng.random_range(0..=query_schema.len());
            let index_schema = Schema::new(query_schema.fields()[..n_known].to_vec()).unwrap();
            let n_pushed = rng.random_range(0..150u32);
            let mut index = AttributeIndex::new(index_schema.clone());
            let mut documents = Vec::new();
            for slot in 0..n_pushed {
                let document = random_document(&mut rng, &index_schema);
                if rng.random_bool(0.1) {
                    // A slot never pushed has no attributes.
                    documents.push(Attributes::new());
                } else {
                    index.push(slot, &document).unwrap();
                    documents.push(document);
                }
            }
            let n_slots = n_pushed + rng.random_range(0..70);
            documents.resize(n_slots as usize, Attributes::new());

            let decoded = AttributeIndex::decode_section(&index.encode_section(), n_slots).unwrap();
            let mut frozen = decoded.clone();
            frozen.freeze();
            let new_order: Vec<u32> = (0..rng.random_range(0..=n_slots + 5))
                .map(|_| rng.random_range(0..n_slots + 5))
                .collect();
            let remapped = index.remap(&new_order).unwrap();
            let remapped_documents: Vec<Attributes> = new_order
                .iter()
                .map(|&old| documents.get(old as usize).cloned().unwrap_or_default())
                .collect();

            for (slot, document) in documents.iter().enumerate() {
                assert_eq!(&index.attributes_of(slot as u32), document);
                assert_eq!(&decoded.attributes_of(slot as u32), document);
            }
            for _ in 0..40 {
                let loose = rng.random_bool(0.3);
                let filter = random_filter(&mut rng, &query_schema, 1, loose);
                if !loose {
                    assert_eq!(filter.validate(&query_schema), Ok(()), "{filter:?}");
                }
                let want = expected(&filter, &documents);
                let got = index.matching(&filter, n_slots);
                assert_eq!(got, want, "{filter:?}");
                assert_eq!(got.count(), want.iter().count());
                if got.count() > 0 && got.count() < n_slots as usize {
                    n_selective += 1;
                }
                assert_eq!(decoded.matching(&filter, n_slots), want, "{filter:?}");
                assert_eq!(frozen.matching(&filter, n_slots), want, "{filter:?}");
                assert_eq!(
                    remapped.matching(&filter, new_order.len() as u32),
                    expected(&filter, &remapped_documents),
                    "{filter:?}"
                );
            }
        }
        assert!(n_selective > 3000, "{n_selective}");
    }

    #[test]
    fn filters_matching_no_slot_one_slot_and_every_slot() {
        let schema = example_schema();
        let mut index = AttributeIndex::new(schema);
        for slot in 0..100u32 {
            let mut document = Attributes::new();
            document.insert("section", keyword(if slot == 42 { "rare" } else { "libs" }));
            document.insert("size", Value::Number(f64::from(slot)));
            index.push(slot, &document).unwrap();
        }
        let none = any_of("section", &["absent"]);
        assert_eq!(index.matching(&none, 100).count(), 0);
        assert!(index.matching(&none, 100).is_empty());
        assert_eq!(index.matching(&Filter::Any(Vec::new()), 100).count(), 0);

        let one = any_of("section", &["rare"]);
        assert_eq!(index.matching(&one, 100).iter().collect::<Vec<_>>(), [42]);
        let one_range = Filter::Range {
            field: "size".to_string(),
            gt: None,
            gte: Some(99.0),
            lt: None,
            lte: None,
        };
        assert_eq!(
            index.matching(&one_range, 100).iter().collect::<Vec<_>>(),
            [99]
        );

        let every = Filter::Exists("section".to_string());
        assert_eq!(index.matching(&every, 100), SlotSet::full(100));
        assert_eq!(index.matching(&Filter::All(Vec::new()), 100).count(), 100);
        // Slots past the pushed ones have no attributes: Not(Match) includes them.
        let not_rare = Filter::Not(Box::new(one));
        assert_eq!(index.matching(&not_rare, 130).count(), 129);
        assert_eq!(index.matching(&every, 130).count(), 100);
        // A smaller slot count cuts every answer.
        assert_eq!(index.matching(&Filter::All(Vec::new()), 10).count(), 10);
        assert_eq!(index.matching(&every, 10).count(), 10);
        assert_eq!(index.matching(&not_rare, 0).count(), 0);
    }

    #[test]
    fn section_round_trip_keeps_attributes_and_matching() {
        let (index, documents) = example_index();
        let n_slots = documents.len() as u32;
        let bytes = index.encode_section();
        let decoded = AttributeIndex::decode_section(&bytes, n_slots).unwrap();
        assert_eq!(decoded.n_slots(), n_slots);
        assert_eq!(decoded.schema(), index.schema());
        for (slot, document) in documents.iter().enumerate() {
            assert_eq!(&decoded.attributes_of(slot as u32), document);
        }
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..200 {
            let filter = random_filter(&mut rng, index.schema(), 1, false);
            assert_eq!(
                decoded.matching(&filter, n_slots),
                expected(&filter, &documents)
            );
        }
        // Encoding the decoded index again gives the same bytes, but for the slot count.
        let again = AttributeIndex::decode_section(&decoded.encode_section(), n_slots).unwrap();
        assert_eq!(again.encode_section(), decoded.encode_section());
        // An empty index, and a partition smaller than the section, which is refused.
        let empty = AttributeIndex::new(Schema::default());
        let decoded_empty = AttributeIndex::decode_section(&empty.encode_section(), 7).unwrap();
        assert_eq!(decoded_empty.attributes_of(3), Attributes::new());
        assert!(AttributeIndex::decode_section(&bytes, index.n_slots() - 1).is_err());
    }

    #[test]
    fn damaged_sections_are_errors_never_panics() {
        let (index, documents) = example_index();
        let n_slots = documents.len() as u32;
        let bytes = index.encode_section();
        for end in 0..bytes.len() {
            assert!(
                AttributeIndex::decode_section(&bytes[..end], n_slots).is_err(),
                "{end}"
            );
        }
        let mut rng = StdRng::seed_from_u64(0xdead);
        let filters: Vec<Filter> = (0..20)
            .map(|_| random_filter(&mut rng, index.schema(), 1, true))
            .collect();
        let mut n_accepted = 0;
        for _ in 0..400 {
            let mut damaged = bytes.clone();
            let byte = rng.random_range(0..damaged.len());
            damaged[byte] ^= 1 << rng.random_range(0..8);
            let Ok(decoded) = AttributeIndex::decode_section(&damaged, n_slots) else {
                continue;
            };
            // Accepted damage (a flipped presence bit, number or term id) is still a
            // consistent index: it agrees with the naive evaluator on its own attributes.
            n_accepted += 1;
            let decoded_documents: Vec<Attributes> = (0..n_slots)
                .map(|slot| decoded.attributes_of(slot))
                .collect();
            for filter in &filters {
                assert_eq!(
                    decoded.matching(filter, n_slots),
                    expected(filter, &decoded_documents)
                );
            }
        }
        assert!(n_accepted < 400);
        for _ in 0..300 {
            let n_bytes = rng.random_range(0..64);
            let mut garbage: Vec<u8> = (0..n_bytes).map(|_| rng.random()).collect();
            if let Some(first) = garbage.first_mut() {
                *first = 1;
            }
            let _ = AttributeIndex::decode_section(&garbage, n_slots);
        }
    }

    #[test]
    fn frozen_number_columns_answer_ranges_as_the_scan_does_at_signed_zeros_and_nan() {
        let schema = Schema::new(vec![FieldSpec::new("n", FieldType::Number)]).unwrap();
        let mut index = AttributeIndex::new(schema);
        let values = [0.0, -0.0, 2.0, -1.0, 2.0, 0.0];
        for (slot, value) in values.iter().enumerate() {
            let mut document = Attributes::new();
            document.insert("n", Value::Number(*value));
            // Slot 3 is left without attributes.
            if slot != 3 {
                index.push(slot as u32, &document).unwrap();
            }
        }
        let mut frozen = index.clone();
        frozen.freeze();
        let bounds = [
            None,
            Some(0.0),
            Some(-0.0),
            Some(2.0),
            Some(f64::NAN),
            Some(-5.0),
        ];
        for gt in bounds {
            for gte in bounds {
                for lt in bounds {
                    for lte in bounds {
                        let filter = Filter::Range {
                            field: "n".into(),
                            gt,
                            gte,
                            lt,
                            lte,
                        };
                        for n_slots in [4, 6, 9] {
                            assert_eq!(
                                frozen.matching(&filter, n_slots),
                                index.matching(&filter, n_slots),
                                "{filter:?} over {n_slots} slots"
                            );
                        }
                    }
                }
            }
        }
        // A push after freezing drops the sorted copy instead of answering from a stale one.
        let mut document = Attributes::new();
        document.insert("n", Value::Number(7.0));
        frozen.push(7, &document).unwrap();
        let seven = Filter::Range {
            field: "n".into(),
            gt: Some(6.0),
            gte: None,
            lt: None,
            lte: None,
        };
        assert_eq!(
            frozen.matching(&seven, 8).iter().collect::<Vec<_>>(),
            vec![7]
        );
    }

    #[test]
    fn remap_renumbers_slots() {
        let (index, documents) = example_index();
        let new_order = [199u32, 0, 0, 3, 1000, 17];
        let remapped = index.remap(&new_order).unwrap();
        assert_eq!(remapped.n_slots(), 6);
        for (new_slot, &old_slot) in new_order.iter().enumerate() {
            let want = documents
                .get(old_slot as usize)
                .cloned()
                .unwrap_or_default();
            assert_eq!(remapped.attributes_of(new_slot as u32), want);
        }
        assert_eq!(index.remap(&[]).unwrap().n_slots(), 0);
    }

    #[test]
    fn from_parts_concatenates_partitions_and_refuses_a_foreign_schema() {
        let (newer, newer_documents) = example_index();
        let older_schema = Schema::new(example_schema().fields()[..2].to_vec()).unwrap();
        let mut older = AttributeIndex::new(older_schema);
        let mut older_document = Attributes::new();
        older_document.insert("section", keyword("old"));
        older.push(0, &older_document).unwrap();
        older.push(2, &Attributes::new()).unwrap();

        let merged = AttributeIndex::from_parts(
            example_schema(),
            &[(&older, &[2, 0]), (&newer, &[10, 11, 12])],
        )
        .unwrap();
        assert_eq!(merged.n_slots(), 5);
        assert_eq!(merged.attributes_of(0), Attributes::new());
        assert_eq!(merged.attributes_of(1), older_document);
        for (new_slot, old_slot) in [(2u32, 10usize), (3, 11), (4, 12)] {
            assert_eq!(merged.attributes_of(new_slot), newer_documents[old_slot]);
        }
        let rare = any_of("section", &["old"]);
        assert_eq!(merged.matching(&rare, 5).iter().collect::<Vec<_>>(), [1]);

        let foreign = Schema::new(vec![FieldSpec::new("section", FieldType::Number)]).unwrap();
        let error = AttributeIndex::from_parts(foreign, &[(&older, &[0])]).unwrap_err();
        assert!(error.to_string().contains("schema: part 0"), "{error}");
    }

    #[test]
    fn push_refuses_invalid_attributes_and_slots_out_of_order() {
        let mut index = AttributeIndex::new(example_schema());
        let mut document = Attributes::new();
        document.insert("section", keyword("libs"));
        index.push(3, &document).unwrap();
        assert_eq!(index.n_slots(), 4);
        assert_eq!(
            index.push(3, &document).unwrap_err(),
            AttributeError::SlotOutOfOrder {
                slot: 3,
                n_slots: 4
            }
        );
        assert!(index.push(u32::MAX, &document).is_err());

        let mut bad = Attributes::new();
        bad.insert("section", keyword("python"));
        bad.insert("size", keyword("big"));
        assert_eq!(
            index.push(5, &bad).unwrap_err().to_string(),
            "attributes: field \"size\" is declared NUMBER but got a keyword"
        );
        // Nothing changed: the valid field of the refused document was not indexed.
        assert_eq!(index.n_slots(), 4);
        assert!(index
            .matching(&any_of("section", &["python"]), 10)
            .is_empty());
        index.push(4, &Attributes::new()).unwrap();
        assert_eq!(index.n_slots(), 5);
    }

    #[test]
    fn extend_schema_adds_fields_without_values() {
        let older = Schema::new(example_schema().fields()[..1].to_vec()).unwrap();
        let mut index = AttributeIndex::new(older);
        let mut document = Attributes::new();
        document.insert("section", keyword("libs"));
        index.push(0, &document).unwrap();
        let mut with_size = document.clone();
        with_size.insert("size", Value::Number(2.0));
        assert!(
            index.push(1, &with_size).is_err(),
            "size is not declared yet"
        );

        index.extend_schema(example_schema()).unwrap();
        index.push(1, &with_size).unwrap();
        let exists = Filter::Exists("size".to_string());
        assert_eq!(index.matching(&exists, 2).iter().collect::<Vec<_>>(), [1]);
        assert_eq!(index.attributes_of(0), document);
        assert_eq!(index.attributes_of(1), with_size);

        let unrelated = Schema::new(vec![FieldSpec::new("x", FieldType::Bool)]).unwrap();
        assert!(index.extend_schema(unrelated).is_err());
    }

    #[test]
    fn slot_set_algebra() {
        let mut odd = SlotSet::empty(130);
        for slot in (1..130).step_by(2) {
            odd.insert(slot);
        }
        assert_eq!(odd.count(), 65);
        assert!(odd.contains(129) && !odd.contains(128) && !odd.contains(5000));
        let even = odd.clone().not(130);
        assert_eq!(even.count(), 65);
        assert_eq!(even.iter().take(3).collect::<Vec<_>>(), [0, 2, 4]);
        assert!(odd.clone().and(&even).is_empty());
        assert_eq!(odd.clone().or(&even), SlotSet::full(130));
        assert_eq!(SlotSet::full(130).count(), 130);
        assert_eq!(SlotSet::full(128).words(), [u64::MAX, u64::MAX]);
        assert_eq!(SlotSet::full(0).count(), 0);
        // Sets of different sizes combine as if padded with absent slots.
        let mut small = SlotSet::empty(1);
        small.insert(0);
        assert_eq!(small.clone().or(&odd).count(), 66);
        assert_eq!(odd.clone().and(&small).count(), 0);
        assert_eq!(small.clone().not(3).iter().collect::<Vec<_>>(), [1, 2]);
        assert_eq!(
            SlotSet::from_words(vec![0b101]).iter().collect::<Vec<_>>(),
            [0, 2]
        );
    }
}
