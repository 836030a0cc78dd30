//! Full text: the analyzer of a TEXT field, its inverted index (one per partition and field),
//! and BM25 scoring.
//!
//! The analyzer is Lucene's StandardAnalyzer family: Unicode word segmentation (UAX #29, the
//! `unicode-segmentation` crate), lowercasing, ASCII folding (NFKD from
//! `unicode-normalization`, combining marks dropped: "Café" and "cafe" are one term), and,
//! when the field asks, Lucene's 33 English stop words and the Snowball English stemmer
//! (`rust-stemmers`). Tokens longer than [`TextAnalyzer::MAX_TOKEN_BYTES`] are dropped.
//!
//! BM25 is Lucene's (`BM25Similarity` since Lucene 8): for a query term `t` and document `d`,
//! `idf(t) · tf / (tf + k1 · (1 − b + b · |d| / avgdl))` with
//! `idf(t) = ln(1 + (N − n(t) + 0.5) / (n(t) + 0.5))`, summed over the query's terms (a term
//! given twice counts twice). Two choices differ from Lucene: `|d|` is the exact token count
//! (Lucene rounds it into one byte, exact below 40 tokens and within about 12% above), and
//! the statistics (`N` documents with a value, their total length, `n(t)` documents holding
//! the term) are those of the live documents of the tenants searched, over every segment:
//! removed and superseded versions never count, merges change nothing, and one tenant's
//! documents never move another tenant's scores.

use std::collections::HashMap;

use unicode_normalization::char::is_combining_mark;
use unicode_normalization::UnicodeNormalization;
use unicode_segmentation::UnicodeSegmentation;

use crate::attribute_index::SlotSet;
use crate::bytes::{ByteReader, ByteWriter};
use crate::error::{IndexError, Result};
use crate::search::Hit;

/// Lucene's `EnglishAnalyzer.ENGLISH_STOP_WORDS_SET`, sorted.
const ENGLISH_STOP_WORDS: [&str; 33] = [
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it",
    "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these",
    "they", "this", "to", "was", "will", "with",
];

/// How a TEXT field's values and queries become terms (declared with the field).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TextAnalyzer {
    /// Snowball's English stemmer ("indexing" and "indexes" become "index").
    pub english_stemmer: bool,
    /// Drops Lucene's 33 English stop words ("the", "of", ...).
    pub english_stop_words: bool,
}

impl TextAnalyzer {
    /// Longer tokens (after folding) are dropped: they are not words.
    pub const MAX_TOKEN_BYTES: usize = 255;

    /// True for the analyzer every TEXT field gets unless it asks for more.
    pub fn is_default(&self) -> bool {
        *self == TextAnalyzer::default()
    }

    /// The analyzer's options as one byte (bit 0: stemmer, bit 1: stop words).
    pub(crate) fn flags(&self) -> u8 {
        u8::from(self.english_stemmer) | (u8::from(self.english_stop_words) << 1)
    }

    /// The analyzer of [`TextAnalyzer::flags`]'s byte; `None` for unknown bits.
    pub(crate) fn from_flags(flags: u8) -> Option<TextAnalyzer> {
        (flags & !0b11 == 0).then_some(TextAnalyzer {
            english_stemmer: flags & 1 != 0,
            english_stop_words: flags & 2 != 0,
        })
    }

    /// The terms of `text`, in order (a term repeated in the text is repeated here).
    pub fn tokens(&self, text: &str) -> Vec<String> {
        let stemmer = self
            .english_stemmer
            .then(|| rust_stemmers::Stemmer::create(rust_stemmers::Algorithm::English));
        let mut tokens = Vec::new();
        for word in text.unicode_words() {
            let folded: String = word
                .nfkd()
                .filter(|c| !is_combining_mark(*c))
                .flat_map(char::to_lowercase)
                .collect();
            if folded.is_empty() || folded.len() > TextAnalyzer::MAX_TOKEN_BYTES {
                continue;
            }
            if self.english_stop_words && ENGLISH_STOP_WORDS.binary_search(&&*folded).is_ok() {
                continue;
            }
            match &stemmer {
                Some(stemmer) => tokens.push(stemmer.stem(&folded).into_owned()),
                None => tokens.push(folded),
            }
        }
        tokens
    }
}

/// BM25's two settings (a collection's; Lucene's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bm25 {
    /// Term-frequency saturation: 0 ignores repeats, larger values reward them longer.
    pub k1: f64,
    /// Length normalisation: 0 ignores document length, 1 normalises fully.
    pub b: f64,
}

impl Default for Bm25 {
    fn default() -> Self {
        Bm25 { k1: 1.2, b: 0.75 }
    }
}

impl Bm25 {
    /// The weights of a query's terms given the statistics of the documents searched; `None`
    /// when no document has a value (nothing can match).
    pub fn weigh(&self, stats: &TextStats) -> Option<TermWeights> {
        if stats.n_docs == 0 {
            return None;
        }
        let n = stats.n_docs as f64;
        let idf = stats
            .doc_freqs
            .iter()
            .map(|&df| (1.0 + (n - df as f64 + 0.5) / (df as f64 + 0.5)).ln())
            .collect();
        Some(TermWeights {
            idf,
            k1: self.k1,
            b: self.b,
            avg_len: stats.total_len as f64 / n,
        })
    }
}

/// The statistics BM25 needs, summed over the partitions searched: documents with a value for
/// the field, their total token count, and per query term the documents holding it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextStats {
    pub n_docs: u64,
    pub total_len: u64,
    /// One per query term, in the query's order.
    pub doc_freqs: Vec<u64>,
}

impl TextStats {
    /// Adds another partition's statistics for the same query terms.
    pub fn add(&mut self, other: &TextStats) {
        self.n_docs += other.n_docs;
        self.total_len += other.total_len;
        if self.doc_freqs.len() < other.doc_freqs.len() {
            self.doc_freqs.resize(other.doc_freqs.len(), 0);
        }
        for (mine, theirs) in self.doc_freqs.iter_mut().zip(&other.doc_freqs) {
            *mine += theirs;
        }
    }
}

/// What scoring a query needs besides the postings: each term's idf, the settings and the
/// average length, all from the statistics of every partition searched.
#[derive(Debug, Clone, PartialEq)]
pub struct TermWeights {
    pub idf: Vec<f64>,
    pub k1: f64,
    pub b: f64,
    pub avg_len: f64,
}

impl TermWeights {
    /// One term's contribution to a document's score.
    #[inline]
    pub fn term_score(&self, term: usize, tf: u32, len: u32) -> f64 {
        let tf = tf as f64;
        let norm = self.k1 * (1.0 - self.b + self.b * len as f64 / self.avg_len);
        self.idf[term] * tf / (tf + norm)
    }
}

/// One document's occurrences of a term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Posting {
    slot: u32,
    tf: u32,
}

/// One TEXT field's inverted index over a partition's slots: per term the slots holding it
/// (increasing) with their counts, and each slot's token count. One writer appends slots in
/// increasing order (the caller locks); queries read.
#[derive(Debug, Clone, Default)]
pub(crate) struct TextColumn {
    analyzer: TextAnalyzer,
    term_ids: HashMap<Box<str>, u32>,
    postings: Vec<Vec<Posting>>,
    /// Token count by slot; 0 for a slot without a value (or one whose value has no token).
    lengths: Vec<u32>,
    /// Slots with at least one token, and their tokens in all.
    n_docs: u64,
    total_len: u64,
}

impl TextColumn {
    const SECTION_VERSION: u8 = 1;

    pub(crate) fn new(analyzer: TextAnalyzer) -> TextColumn {
        TextColumn {
            analyzer,
            ..TextColumn::default()
        }
    }

    pub(crate) fn analyzer(&self) -> TextAnalyzer {
        self.analyzer
    }

    /// Indexes one slot's value. Slots come in increasing order; a slot already indexed (or
    /// below one) is ignored.
    pub(crate) fn append(&mut self, slot: u32, text: &str) {
        if (slot as usize) < self.lengths.len() {
            return;
        }
        let tokens = self.analyzer.tokens(text);
        let mut counts: HashMap<&str, u32> = HashMap::new();
        for token in &tokens {
            *counts.entry(token).or_default() += 1;
        }
        let mut terms: Vec<(&str, u32)> = counts.into_iter().collect();
        terms.sort_unstable();
        for (term, tf) in terms {
            self.add_posting(term, Posting { slot, tf });
        }
        self.set_length(slot, tokens.len() as u32);
    }

    fn add_posting(&mut self, term: &str, posting: Posting) {
        let term_id = match self.term_ids.get(term) {
            Some(&term_id) => term_id,
            None => {
                let term_id = self.postings.len() as u32;
                self.term_ids.insert(term.into(), term_id);
                self.postings.push(Vec::new());
                term_id
            }
        };
        self.postings[term_id as usize].push(posting);
    }

    fn set_length(&mut self, slot: u32, len: u32) {
        self.lengths.resize(slot as usize, 0);
        self.lengths.push(len);
        if len > 0 {
            self.n_docs += 1;
            self.total_len += u64::from(len);
        }
    }

    fn len_of(&self, slot: u32) -> u32 {
        self.lengths.get(slot as usize).copied().unwrap_or(0)
    }

    fn postings_of(&self, term: &str) -> &[Posting] {
        self.term_ids
            .get(term)
            .map_or(&[], |&term_id| &self.postings[term_id as usize])
    }

    /// The statistics of the live slots for `terms` (`dead`: the dead slots), so a partition
    /// without dead slots costs one lookup per term.
    pub(crate) fn stats(&self, terms: &[String], dead: &SlotSet) -> TextStats {
        let mut stats = TextStats {
            n_docs: self.n_docs,
            total_len: self.total_len,
            doc_freqs: Vec::with_capacity(terms.len()),
        };
        let mut any_dead = false;
        for slot in dead.iter() {
            let len = self.len_of(slot);
            if len > 0 {
                any_dead = true;
                stats.n_docs -= 1;
                stats.total_len -= u64::from(len);
            }
        }
        for term in terms {
            let postings = self.postings_of(term);
            let df = match any_dead {
                false => postings.len(),
                true => postings.iter().filter(|p| !dead.contains(p.slot)).count(),
            };
            stats.doc_freqs.push(df as u64);
        }
        stats
    }

    /// The BM25 score of every slot `accept`ed that holds a query term, as `(slot, score)` in
    /// no order. Scores accumulate in an array over the partition's slots when the postings
    /// are many (a long query, common terms: no hashing per posting), in a map otherwise.
    pub(crate) fn scores(
        &self,
        terms: &[String],
        weights: &TermWeights,
        accept: impl Fn(u32) -> bool,
    ) -> Vec<(u32, f64)> {
        let n_postings: usize = terms.iter().map(|term| self.postings_of(term).len()).sum();
        let dense = n_postings.saturating_mul(8) >= self.lengths.len();
        self.scores_into(terms, weights, accept, dense)
    }

    /// `scores`, accumulating in an array over the slots (`dense`) or in a map.
    fn scores_into(
        &self,
        terms: &[String],
        weights: &TermWeights,
        accept: impl Fn(u32) -> bool,
        dense: bool,
    ) -> Vec<(u32, f64)> {
        let postings: Vec<&[Posting]> = terms.iter().map(|term| self.postings_of(term)).collect();
        let add = |scores: &mut dyn FnMut(u32, f64)| {
            for (term_idx, postings) in postings.iter().enumerate() {
                for posting in *postings {
                    if accept(posting.slot) {
                        let len = self.len_of(posting.slot);
                        scores(posting.slot, weights.term_score(term_idx, posting.tf, len));
                    }
                }
            }
        };
        if dense {
            // Every term's contribution is positive (idf > 0 since n(t) <= N, tf >= 1), so
            // 0 marks a slot no accepted posting reached.
            let mut dense = vec![0.0f64; self.lengths.len()];
            add(&mut |slot, score| dense[slot as usize] += score);
            return dense
                .into_iter()
                .enumerate()
                .filter(|(_, score)| *score > 0.0)
                .map(|(slot, score)| (slot as u32, score))
                .collect();
        }
        let mut sparse: HashMap<u32, f64> = HashMap::new();
        add(&mut |slot, score| *sparse.entry(slot).or_default() += score);
        sparse.into_iter().collect()
    }

    /// Bytes of memory the index takes (an estimate: terms, postings and lengths).
    pub(crate) fn memory_bytes(&self) -> usize {
        let terms: usize = self.term_ids.keys().map(|term| term.len() + 48).sum();
        let postings: usize = self.postings.iter().map(|p| p.capacity() * 8 + 24).sum();
        terms + postings + self.lengths.capacity() * 4
    }

    /// The index as bytes of a sealed partition's postings section (`docs/SEGMENT_FORMAT.md`):
    /// version, slot count, the terms sorted with their postings (slot, count), then every
    /// slot's length.
    pub(crate) fn encode(&self, n_slots: u32, writer: &mut ByteWriter) {
        writer.u8(TextColumn::SECTION_VERSION);
        writer.u8(self.analyzer.flags());
        let mut terms: Vec<(&str, u32)> = self
            .term_ids
            .iter()
            .map(|(term, &term_id)| (&**term, term_id))
            .collect();
        terms.sort_unstable();
        writer.u32(terms.len() as u32);
        for (term, term_id) in terms {
            writer.u32(term.len() as u32);
            writer.bytes.extend_from_slice(term.as_bytes());
            let postings = &self.postings[term_id as usize];
            writer.u32(postings.len() as u32);
            for posting in postings {
                writer.u32(posting.slot);
                writer.u32(posting.tf);
            }
        }
        writer.u32(n_slots);
        for slot in 0..n_slots {
            writer.u32(self.len_of(slot));
        }
    }

    /// Decodes [`TextColumn::encode`]'s bytes for a partition of `n_slots` slots. Every count
    /// is checked against the bytes left and every slot against the slot count; postings must
    /// increase, and each slot's counts must add up to its length: damage is an
    /// [`IndexError::Format`], never a panic.
    pub(crate) fn decode(
        reader: &mut ByteReader<'_>,
        analyzer: TextAnalyzer,
        n_slots: u32,
    ) -> Result<TextColumn> {
        let version = reader.u8("postings version")?;
        if version != TextColumn::SECTION_VERSION {
            return Err(bad(format!("unknown postings version {version}")));
        }
        let flags = reader.u8("postings analyzer")?;
        if TextAnalyzer::from_flags(flags) != Some(analyzer) {
            return Err(bad(format!(
                "postings made by analyzer {flags:#x}, the field declares {:#x}",
                analyzer.flags()
            )));
        }
        let n_terms = reader.u32("postings term count")? as usize;
        // Each term takes at least its length and its posting count.
        if n_terms.saturating_mul(8) > reader.remaining() {
            return Err(bad(format!(
                "{n_terms} terms cannot fit in {} bytes",
                reader.remaining()
            )));
        }
        let mut column = TextColumn::new(analyzer);
        let mut sums = vec![0u64; n_slots as usize];
        let mut previous: Option<String> = None;
        for _ in 0..n_terms {
            let term_len = reader.u32("postings term length")? as usize;
            let raw = reader.take(term_len, "postings term")?;
            let term = std::str::from_utf8(raw)
                .map_err(|_| bad("a postings term is not UTF-8".to_string()))?;
            if previous.as_deref().is_some_and(|p| p >= term) {
                return Err(bad(format!("postings term {term:?} out of order")));
            }
            let n_postings = reader.u32("posting count")? as usize;
            if n_postings == 0 || n_postings > n_slots as usize {
                return Err(bad(format!(
                    "term {term:?} has {n_postings} postings in {n_slots} slots"
                )));
            }
            let pairs = reader.u32s(n_postings * 2, "postings")?;
            let mut postings = Vec::with_capacity(n_postings);
            for pair in pairs.chunks_exact(2) {
                let (slot, tf) = (pair[0], pair[1]);
                let increasing = postings.last().is_none_or(|p: &Posting| p.slot < slot);
                if slot >= n_slots || tf == 0 || !increasing {
                    return Err(bad(format!(
                        "term {term:?}: posting (slot {slot}, count {tf}) out of order, past \
                         {n_slots} slots or empty"
                    )));
                }
                sums[slot as usize] += u64::from(tf);
                postings.push(Posting { slot, tf });
            }
            column
                .term_ids
                .insert(term.into(), column.postings.len() as u32);
            column.postings.push(postings);
            previous = Some(term.to_string());
        }
        let recorded = reader.u32("postings slot count")?;
        if recorded != n_slots {
            return Err(bad(format!(
                "postings of {recorded} slots in a partition of {n_slots}"
            )));
        }
        let lengths = reader.u32s(n_slots as usize, "text lengths")?;
        for (slot, (&len, &sum)) in lengths.iter().zip(&sums).enumerate() {
            if u64::from(len) != sum {
                return Err(bad(format!(
                    "slot {slot} has length {len} but {sum} term occurrences"
                )));
            }
            column.set_length(slot as u32, len);
        }
        Ok(column)
    }
}

fn bad(reason: String) -> IndexError {
    IndexError::Format(reason)
}

/// The `k` best live slots of one partition for a text query, as hits of `user_id` (best
/// first; a hit's distance is its negated score, so lower is better as for vectors).
pub(crate) fn text_hits(
    user_id: u128,
    column: &TextColumn,
    terms: &[String],
    weights: &TermWeights,
    k: usize,
    accept: impl Fn(u32) -> bool,
    doc_ids: &[u128],
) -> Vec<Hit> {
    let scores = column.scores(terms, weights, accept);
    top_k_scores(scores, k, |slot| doc_ids[slot as usize])
        .into_iter()
        .map(|(score, slot)| Hit {
            user_id,
            doc_id: doc_ids[slot as usize],
            distance: -(score as f32),
        })
        .collect()
}

/// The `k` best `(score, slot)` of `scores`, best first; ties go to the smaller `key` (the
/// document id), so the answer does not depend on hashing.
pub(crate) fn top_k_scores(
    scores: Vec<(u32, f64)>,
    k: usize,
    key: impl Fn(u32) -> u128,
) -> Vec<(f64, u32)> {
    let mut scored: Vec<(f64, u32)> = scores.into_iter().map(|(slot, s)| (s, slot)).collect();
    let order = |a: &(f64, u32), b: &(f64, u32)| b.0.total_cmp(&a.0).then(key(a.1).cmp(&key(b.1)));
    if scored.len() > k && k > 0 {
        scored.select_nth_unstable_by(k - 1, order);
        scored.truncate(k);
    }
    scored.sort_unstable_by(order);
    scored.truncate(k);
    scored
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn plain() -> TextAnalyzer {
        TextAnalyzer::default()
    }

    #[test]
    fn words_are_segmented_lowercased_and_folded() {
        assert_eq!(
            plain().tokens("Café au LAIT, naïve résumé! libfoo-dev 3.14 ＦＵＬＬ"),
            ["cafe", "au", "lait", "naive", "resume", "libfoo", "dev", "3.14", "full"]
        );
        // Scripts without ASCII letters keep their words, lowercased.
        assert_eq!(plain().tokens("Привет МИР"), ["привет", "мир"]);
        assert_eq!(plain().tokens("  ,;  "), Vec::<String>::new());
        let long = "x".repeat(TextAnalyzer::MAX_TOKEN_BYTES + 1);
        assert_eq!(plain().tokens(&format!("a {long} b")), ["a", "b"]);
    }

    #[test]
    fn stemming_and_stop_words_are_the_fields_choice() {
        let english = TextAnalyzer {
            english_stemmer: true,
            english_stop_words: true,
        };
        assert_eq!(
            english.tokens("The indexing of the Indexes is running"),
            ["index", "index", "run"]
        );
        let stop_only = TextAnalyzer {
            english_stemmer: false,
            english_stop_words: true,
        };
        assert_eq!(stop_only.tokens("The indexing"), ["indexing"]);
        assert!(ENGLISH_STOP_WORDS.windows(2).all(|w| w[0] < w[1]));
        for flags in 0..4 {
            assert_eq!(TextAnalyzer::from_flags(flags).unwrap().flags(), flags);
        }
        assert_eq!(TextAnalyzer::from_flags(4), None);
    }

    fn column(texts: &[&str]) -> TextColumn {
        let mut column = TextColumn::new(plain());
        for (slot, text) in texts.iter().enumerate() {
            column.append(slot as u32, text);
        }
        column
    }

    /// BM25 straight from the formula over a list of token lists.
    fn naive(docs: &[Vec<String>], query: &[String], bm25: Bm25) -> Vec<f64> {
        let with_value: Vec<&Vec<String>> = docs.iter().filter(|d| !d.is_empty()).collect();
        let n = with_value.len() as f64;
        let avg = with_value.iter().map(|d| d.len()).sum::<usize>() as f64 / n;
        docs.iter()
            .map(|doc| {
                query
                    .iter()
                    .map(|term| {
                        let df = with_value.iter().filter(|d| d.contains(term)).count() as f64;
                        let tf = doc.iter().filter(|t| *t == term).count() as f64;
                        let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
                        let norm = bm25.k1 * (1.0 - bm25.b + bm25.b * doc.len() as f64 / avg);
                        idf * tf / (tf + norm)
                    })
                    .sum()
            })
            .collect()
    }

    #[test]
    fn scores_match_the_formula_over_random_corpora_with_dead_slots() {
        let mut rng = StdRng::seed_from_u64(41);
        let words = [
            "alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta",
        ];
        for round in 0..50 {
            let n = rng.random_range(1..60);
            let texts: Vec<String> = (0..n)
                .map(|_| {
                    let len = rng.random_range(0..12);
                    (0..len)
                        .map(|_| words[rng.random_range(0..words.len())])
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect();
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let column = column(&refs);
            let dead: Vec<bool> = (0..n).map(|_| rng.random_bool(0.2)).collect();
            let query: Vec<String> = (0..rng.random_range(1..4))
                .map(|_| words[rng.random_range(0..words.len())].to_string())
                .collect();
            let bm25 = Bm25 {
                k1: 0.5 + rng.random::<f64>(),
                b: rng.random::<f64>(),
            };
            let mut dead_slots = SlotSet::empty(n as u32);
            for slot in (0..n as u32).filter(|&s| dead[s as usize]) {
                dead_slots.insert(slot);
            }
            let stats = column.stats(&query, &dead_slots);
            let live_docs: Vec<Vec<String>> = texts
                .iter()
                .enumerate()
                .map(|(slot, text)| match dead[slot] {
                    true => Vec::new(),
                    false => plain().tokens(text),
                })
                .collect();
            let Some(weights) = bm25.weigh(&stats) else {
                assert!(live_docs.iter().all(Vec::is_empty), "round {round}");
                continue;
            };
            let expected = naive(&live_docs, &query, bm25);
            // Both ways of accumulating, whichever `scores` would pick.
            for dense in [true, false] {
                let scores: HashMap<u32, f64> = column
                    .scores_into(&query, &weights, |s| !dead[s as usize], dense)
                    .into_iter()
                    .collect();
                for (slot, want) in expected.iter().enumerate() {
                    let got = scores.get(&(slot as u32)).copied().unwrap_or(0.0);
                    assert!(
                        (got - want).abs() <= 1e-9 * want.abs().max(1.0),
                        "round {round} slot {slot} (dense {dense}): {got} against {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn postings_round_trip_and_damage_is_refused() {
        let column = column(&["a b a", "", "b c", "c c c d"]);
        let mut writer = ByteWriter::default();
        column.encode(4, &mut writer);
        let bytes = writer.bytes;
        let back = TextColumn::decode(&mut ByteReader::new(&bytes), plain(), 4).unwrap();
        assert_eq!(back.lengths, column.lengths);
        assert_eq!(back.n_docs, 3);
        assert_eq!(back.total_len, 9);
        for term in ["a", "b", "c", "d", "e"] {
            assert_eq!(back.postings_of(term), column.postings_of(term), "{term}");
        }
        // Another analyzer's postings are refused.
        let english = TextAnalyzer {
            english_stemmer: true,
            english_stop_words: false,
        };
        assert!(TextColumn::decode(&mut ByteReader::new(&bytes), english, 4).is_err());
        // Every truncation and every flipped byte is an error or a consistent index, never a
        // panic.
        for cut in 0..bytes.len() {
            assert!(TextColumn::decode(&mut ByteReader::new(&bytes[..cut]), plain(), 4).is_err());
        }
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x5a;
            let _ = TextColumn::decode(&mut ByteReader::new(&damaged), plain(), 4);
        }
    }

    #[test]
    fn top_k_breaks_ties_by_key() {
        let scores = vec![(0, 1.0), (1, 2.0), (2, 1.0), (3, 1.0)];
        let key = |slot: u32| [30u128, 10, 20, 5][slot as usize];
        assert_eq!(top_k_scores(scores.clone(), 2, key), [(2.0, 1), (1.0, 3)]);
        assert_eq!(
            top_k_scores(scores, 10, key),
            [(2.0, 1), (1.0, 3), (1.0, 2), (1.0, 0)]
        );
    }
}
